"""The registry of eval/results/: one entry per question the documentation answers, its folder (the current run; a
rerun replaces it, git keeps the old one) and what docs/results.md shows of it. ``tests/test_layout.py`` checks that
every file under eval/results/ lies in a registered folder, that every registered folder exists, and that no result
name is versioned (``_v2``, ``_run3``, ``_before``, ``_after``).

To add a result: write it to ``eval/results/<what-it-measures>/`` (or a file in an existing question's folder), add a
:class:`Question` here (or a :class:`Report` to that question), run ``python -m eval.make_docs``."""

from __future__ import annotations

from dataclasses import dataclass

RESULTS = "eval/results"


@dataclass(frozen=True)
class Report:
    """A markdown report of a question's folder, as docs/results.md shows it."""

    file: str  # relative to the question's folder
    headings: tuple[str, ...] = ()  # the sections shown, by the start of their heading text; (): all of them
    methods: tuple[str, ...] = ()  # the method ids whose table rows are shown; (): every row
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (column, values shown) for tables with that column
    preamble: bool = False  # show the report's first paragraph (its settings; the speed scripts: their command)
    tables: tuple[int, ...] = ()  # the tables shown (0: the first of the sections shown), with their captions; (): all
    notes: bool = False  # keep the paragraphs that are no table's caption (the reports' reading notes)


@dataclass(frozen=True)
class Question:
    """One question the documentation answers, and the folder of its current run."""

    folder: str  # relative to eval/results/
    title: str  # the question (the section title of docs/results.md)
    about: str  # what was run, in a sentence or two; no measured number (those come from the reports)
    reports: tuple[Report, ...] = ()  # () : the folder is cited (its files are read by code or a card), not shown
    images: tuple[str, ...] = ()  # PNGs of the folder drawn under the reports


KLD_SHOWN = (  # FP16 itself (0 by definition) is left out
    "cocktail",
    "int4",
    "int2",
    "int4_had",
    "kivi2",
    "int4v3_had_g64",
    "recommended",
    "int4_auto_s8_g64",
    "recommended_k4v3",
    "layers3r2_had_s8_sal1_f8",
    "preset",
)
# the fidelity reports: the candidates
FIDELITY_SHOWN = (
    "int4",
    "recommended",
    "int4_auto_s8_g64",
    "recommended_f8",
    "recommended_k4v3",
    "preset",
    "preset_020",
)
REFINED = (  # the 8-bit parameters' codes refined per group (params8.refine_codes, 2026-12-07): which rows were rerun
    " The rows with 8-bit parameters shown (`recommended`, `int4_auto_s8_g64`, `recommended_f8`, the presets) were "
    "rerun with the refined codes (`8b994da`); the folder's other 8-bit-parameter rows are from before."
)
FULL8_RERUN = (  # the 8-bit full part's exact sinks and own key basis (5694d71): which rows were rerun
    " The rows with an 8-bit full part (`recommended_f8`, the presets, the `_f8` storages) were rerun when that part "
    "came to keep its sink tokens at full precision and its keys in a basis of their own (`5694d71`)."
)
UNROTATED_F8 = (  # no key basis without a rotation (c79742b): which rows were rerun
    " The rows with an 8-bit full part in layers with no rotation at all ({rows}) were rerun once more when such a "
    "part stopped taking a Hadamard basis for its keys that `memory_report` had not counted (`c79742b`)."
)
FULL8_BEFORE = (
    " Its rows with an 8-bit full part (the presets, `_f8` storages) are from before that part kept its sink tokens "
    "at full precision and, beside values-only rotation, its keys in the values' basis (`5694d71`, `c79742b`; "
    "`gemma3_270m/fidelity_8k/` has both at 8K)."
)
LONGBENCH_SHOWN = ("cocktail", "int4", "kivi2", "hqq2", "recommended_k4v3")  # the report: int2, nosearch, quanto2 too
SINGLE_LENGTH = (("length", ("2000",)),)  # a one-length RULER run: its "all" rows repeat the length's
ROOFLINE_ROWS = (
    ("model", ("llama3-8b",)),
    ("context", ("32768",)),
    ("batch", ("1",)),
    ("setting", ("fp16_flashdecoding", "int4", "paper", "paper_s8_f8")),
)
SPEED = "ratios against `DynamicCache` in the same run, alternating rounds, on a shared 2-core CPU"

QUESTIONS = (
    Question(
        "kld",
        "SmolLM2-135M-Instruct: how far from FP16 is each storage, 2K LongBench windows and needles",
        "`eval.kld`, 32 LongBench windows of 2048 tokens (2 per task) and 4 needle prompts, every method on the same "
        "prefill; the folder holds every variant measured (the lab log says which study each belongs to), the page "
        "the ones the README and the presets build on. `recommended` and `int4_auto_s8_g64` were rerun with the "
        "refined 8-bit codes (`8b994da`); the other 8-bit-parameter rows are from before." + FULL8_BEFORE,
        (Report("summary.md", ("longbench",), KLD_SHOWN),),
    ),
    Question(
        "kld_calibrated",
        "SmolLM2-135M-Instruct: the calibrated preset against uniform INT4, same windows",
        "`eval.kld --preset model_cards/smollm2-135m-instruct` on the windows and needles of `kld/`; the preset's rows "
        "rerun with the refined 8-bit codes (`8b994da`), and again with the 8-bit full part's exact sinks (`5694d71`, "
        "`c79742b`).",
        (Report("summary.md", ("Paired with `int4`",), ("preset",)),),
    ),
    Question(
        "kld_8k",
        "SmolLM2-135M-Instruct: the same on 8K windows",
        "`eval.kld --window 8000`, 32 LongBench windows of 8000 tokens.",
        (),  # the lab log has what it showed
    ),
    Question(
        "fidelity_8k",
        "SmolLM2-135M-Instruct at 8K: `recommended()`, the storages it was chosen from, a preset at 0.20x",
        "`eval.kld --window 8000 --per-task 1` on 4 LongBench tasks (issue 46; written as `recommended_8k/`): "
        'uniform INT4, `recommended()` (4-bit keys and values, `rotation="auto"`, 8-bit parameters, centred keys), '
        "the same without centring (`int4_auto_s8_g64`), with an 8-bit full part (`recommended_f8`) and the one "
        "before (`recommended_k4v3`), 4-bit storages with 8-bit parameters, G = 64 and an 8-bit full part per "
        "rotation, the shipped preset and the preset calibrated at `--target-bytes 0.20` (`presets_020/`)."
        + REFINED
        + ' `recommended`, `int4_auto_s8_g64` and `recommended_f8` were rerun once more when `rotation="auto"` came '
        "to choose on the nearest codes (`66bf7cd`)." + FULL8_RERUN + UNROTATED_F8.format(rows="`int4_s8_g64_f8`"),
        (Report("summary.md", ("longbench",), FIDELITY_SHOWN),),
    ),
    Question(
        "gemma3_270m/fidelity_8k",
        "Gemma 3 270M at 8K: `recommended()`, the storages it was chosen from, a preset at 0.20x",
        "As `fidelity_8k/`, with uniform INT4 changed one thing at a time (8-bit parameters, rerun with the refined "
        "codes; G = 64; an 8-bit full part): the 8-bit full part was what cost Gemma its fidelity."
        + REFINED
        + FULL8_RERUN
        + UNROTATED_F8.format(rows="the presets, `int4_f8`, `int4_s8_g64_f8`"),
        (Report("summary.md", ("longbench",), FIDELITY_SHOWN + ("int4_s8", "int4_f8")),),
    ),
    Question(
        "fidelity_2k",
        "SmolLM2-135M-Instruct at 2K: the same settings",
        "`eval.kld --window 2048 --per-task 1` on 8 LongBench tasks (issue 46's 2K comparison)."
        + REFINED
        + FULL8_RERUN,
        (Report("summary.md", ("longbench",), FIDELITY_SHOWN),),
    ),
    Question(
        "gemma3_270m/fidelity_2k",
        "Gemma 3 270M at 2K: the same settings",
        "`eval.kld --model gemma-3-270m --window 2048 --per-task 1` on 8 LongBench tasks."
        + REFINED
        + FULL8_RERUN
        + UNROTATED_F8.format(rows="`preset_020`; `preset` measured then too"),
        (Report("summary.md", ("longbench",), FIDELITY_SHOWN),),
    ),
    Question(
        "presets_020",
        "Presets calibrated at a fifth of the bytes (not shipped)",
        "`python -m hf_cocktail.calibrate ... --target-bytes 0.20` with the bytes measured on an 8K-token prompt "
        "(`--bytes-window`, default), for both models, rerun 2026-12-07 with centred keys and the refined 8-bit codes, "
        "and again with the 8-bit full part's exact sinks and own key basis (`5694d71`; the same widths chosen), "
        "Gemma 3's once more when a part in unrotated layers lost that basis (`c79742b`; the same widths, held-out "
        "KLD 0.0029 -> 0.0031 at 0.1995x): "
        "their cards, configs and `calibration.json`; measured in `fidelity_8k/` and `fidelity_2k/` as `preset_020` "
        "(`--preset preset_020=eval/results/presets_020/<model>`).",
    ),
    Question(
        "key_outliers_8k",
        "SmolLM2-135M-Instruct at 8K: outlier key channels at 8 bits (key_outlier_share)",
        "`eval.kld --window 8000 --per-task 1` on 8 LongBench tasks: uniform INT4, the former `recommended()` "
        "(`recommended_k4v3`) with 1/16 and 1/8 "
        "of each head's key channels at 8 bits, and the same storage unrotated without and with 1/8 (issue 46).",
        (),  # the lab log has what it showed
    ),
    Question(
        "gemma3_270m/key_outliers_8k",
        "Gemma 3 270M at 8K: outlier key channels at 8 bits (key_outlier_share)",
        "`eval.kld --model gemma-3-270m --window 8000 --per-task 1` on 4 LongBench tasks: uniform INT4 and "
        "the former `recommended()` without and with 1/16 and 1/8 of each head's key channels at 8 bits, and the same "
        "storage unrotated without and with 1/8 (issue 46).",
        (),  # the lab log has what it showed
    ),
    Question(
        "gemma3_270m/kld",
        "Gemma 3 270M: how far from FP16 is each storage, 2K LongBench windows and needles",
        "`eval.kld --model gemma-3-270m`, 16 LongBench windows (1 per task) and 8 needle prompts; its `preset` rows "
        "are an earlier preset (the current one: next section).",
        (Report("summary.md", ("longbench",), tuple(m for m in KLD_SHOWN if m != "preset")),),
    ),
    Question(
        "gemma3_270m/kld_calibrated",
        "Gemma 3 270M: the calibrated preset against uniform INT4, same windows",
        "`eval.kld --model gemma-3-270m --preset model_cards/gemma-3-270m` on the windows and needles of "
        "`gemma3_270m/kld/`; the preset's rows rerun with the refined 8-bit codes (`8b994da`), and again with the "
        "8-bit full part's exact sinks (`5694d71`, `c79742b`).",
        (Report("summary.md", ("Paired with `int4`",), ("preset",)),),
    ),
    Question(
        "gemma3_270m/target_030",
        "Gemma 3 270M: what calibrating at a 0.30 byte target gives (not the card's preset)",
        "`python -m hf_cocktail.calibrate --target-bytes 0.30` wrote `preset/`; `kld/` and `ruler/` measure it beside "
        "uniform INT4 on the cases of `gemma3_270m/kld/` and `gemma3_270m/ruler/` (the page: `kld/`).",
        (),  # the lab log has what it showed
    ),
    Question(
        "gemma3_270m/ppl",
        "Gemma 3 270M: perplexity over the quantized context",
        "`eval.ppl`, one window of WikiText-2 and one of the essays: 1920 quantized tokens, 128 scored.",
        (),  # the lab log has what it showed
    ),
    Question(
        "ruler_calibrated",
        "SmolLM2-135M-Instruct: RULER-style needles with the calibrated preset",
        "`eval.needle --variant single,multikey,multivalue,multiquery`, 128 cases at 2000 tokens (`NOTE.md`: which "
        "runs the records come from); the preset's rows rerun with the 8-bit full part's exact sinks (`5694d71`).",
        (Report("ruler_summary.md", where=SINGLE_LENGTH, tables=(1,)),),
    ),
    Question(
        "ruler",
        "SmolLM2-135M-Instruct: RULER-style needles, rotated INT4, `recommended()` and per-layer widths",
        "`eval.needle --variant single,multikey,multivalue,multiquery --lengths 2000,4000`, 24 samples per variant.",
        (),  # the lab log has what it showed
    ),
    Question(
        "ruler_8k",
        "SmolLM2-135M-Instruct: RULER-style needles at 8K tokens",
        "`eval.needle --variant single,multikey,multivalue,multiquery --lengths 8192 --samples 6` (issue 46): "
        "uniform INT4, `recommended()` (centred keys), before the centring (`int4_auto_s8_g64`) and before that "
        "(`recommended_k4v3`), the shipped preset. The rows with 8-bit parameters (`recommended`, "
        '`int4_auto_s8_g64`, `preset`) rerun with the refined codes (`8b994da`; `rotation="auto"` still chose on '
        "refined codes, before `66bf7cd`)." + FULL8_BEFORE,
        (Report("ruler_summary.md", where=(("length", ("8192",)),), tables=(1,)),),
    ),
    Question(
        "gemma3_270m/ruler_8k",
        "Gemma 3 270M: RULER-style needles at 8K tokens",
        "As `ruler_8k/`, with `--model gemma-3-270m --preset model_cards/gemma-3-270m`; the rows with 8-bit "
        "parameters rerun with the refined codes, INT4 and `recommended_k4v3` completed to the 24 cases."
        + FULL8_BEFORE,
        (Report("ruler_summary.md", where=(("length", ("8192",)),), tables=(1,)),),
    ),
    Question(
        "ruler_multikey",
        "SmolLM2-135M-Instruct: RULER multikey needles, the hardest variant, on more cases",
        "`eval.needle --variant multikey --lengths 2000,4000 --samples 64`.",
        (),  # the lab log has what it showed
    ),
    Question(
        "gemma3_270m/ruler",
        "Gemma 3 270M: RULER-style needles with the calibrated preset",
        "`eval.needle --model gemma-3-270m`, 256 cases at 2000 tokens (`NOTE.md`: how the folder was filled)."
        + FULL8_BEFORE,
        (Report("ruler_summary.md", where=SINGLE_LENGTH, tables=(1,)),),
    ),
    Question(
        "needle",
        "SmolLM2-135M-Instruct: a passcode needle at every depth of 3000 tokens",
        "`eval.needle --lengths 3000`, 11 depths x 2 samples; whether the paper's chunk search keeps the needle's "
        "chunk at FP16 and whether that saves the answer.",
        (Report("needle_accuracy.md", methods=("fp16", "cocktail", "int4", "recommended_k4v3")),),
        ("heatmap_cocktail.png",),
    ),
    Question(
        "longbench",
        "SmolLM2-135M-Instruct: LongBench task scores",
        "`eval.longbench`, all 187 MiniLongBench examples of 16 English tasks at a 2048-token window (scores near the "
        "model's floor: read the paired rows); `summary.md` has the scores per task and method, the kv_ratio and "
        "times.",
        (Report("summary.md", methods=LONGBENCH_SHOWN, tables=(2,)),),
    ),
    Question(
        "layer_calibration",
        "SmolLM2-135M-Instruct: which layers tolerate fewer bits (per-layer widths, three rounds)",
        "`eval.layers` (left at `c4e549a`; `python -m hf_cocktail.calibrate` runs the same probe and solver): "
        "`round1/` around 4-bit keys and 3-bit values, `round2/` and `round3/` one bit around the previous round's "
        "choice; the `layers*` methods and `model_cards/smollm2-135m-instruct-layers` read their `layer_bits.json`.",
        (),
        ("round2/sensitivity.png",),
    ),
    Question(
        "calibrate_search",
        "Chunk search on top of calibrated widths, at low byte targets",
        "`eval.calibrate_search --targets 0.20,0.15` (left at `78ae457`): the best setting with and without "
        "Cocktail's chunk search (`python -m hf_cocktail.calibrate --search`), on held-out texts, one "
        "`summary.md` per model.",
        (),  # the lab log has what it showed
    ),
    Question(
        "decode_latency",
        "Decode speed against `DynamicCache` on CPU",
        f"`eval.benchmarks.bench_latency` at 8K-32K tokens, fp32 and bf16, both models; {SPEED}. "
        "The page shows SmolLM2 at 8K and 16K (fp32), with the shipped preset and the one calibrated at 0.20x; "
        "`smollm2_fp32_32k.md` holds 32K, `smollm2_bf16.md` bf16, "
        "`gemma3_fp32.md` Gemma 3 270M, "
        "`smollm2_layers_preset_8k.md` the per-layer-widths preset (cited by its card) and "
        "`smollm2_generated_packing_8k.md` generated tokens packed against never packed (issue 44). The 8K/16K runs "
        "of both models (with the presets at 0.20x) were rerun after the 8-bit full part came to keep its sinks exact "
        "and its keys in a basis of their own (`5694d71`), Gemma 3's once more when its presets' unrotated layers lost "
        "that basis (`c79742b`); the 32K, bf16 and per-layer-widths runs are from before.",
        (Report("smollm2_fp32_8k_16k.md"),),
        ("latency.png",),
    ),
    Question(
        "prefill",
        "Prefill overhead: the chunk search, quantization and store build",
        f"`eval.benchmarks.bench_prefill` at 4K and 8K tokens; {SPEED}. The page shows 8K (`4k_8k.md`: 4K too).",
        (Report("4k_8k.md", where=(("context", ("8043",)),)),),
    ),
    Question(
        "memory",
        "KV bytes and peak memory in prefill and decode",
        "`eval.benchmarks.bench_memory` at 4K and 8K tokens, one `generate` per context and method. The page shows "
        "8K (`4k_8k.md`: 4K and `hqq2` too).",
        (
            Report(
                "4k_8k.md",
                preamble=True,
                methods=("fp16", "cocktail", "int4", "kivi2"),
                where=(("context", ("8235",)),),
            ),
        ),
    ),
    Question(
        "dropin",
        "A drop-in for plain generate: long generations and a second turn packed",
        "`python -m eval.dropin_check`: a tiny random Llama (head dim 64) on CPU, token ids straight into `generate` "
        "with `recommended()` (no `prepare_inputs`): uniform 16-bit against `DynamicCache`, then a 512-token prompt, "
        "1,536 generated tokens and a 550-token second turn on the same cache, against issue 44's bars.",
        (Report("report.md", preamble=True),),
        ("ratio.png",),
    ),
    Question(
        "long_generation",
        "Long generations: KL divergence from FP16 with generated tokens packed",
        "`python -m eval.long_generation`: SmolLM2-135M-Instruct (fp32, CPU), three 512-token essay windows, each "
        "continued by 1,024 teacher-forced tokens fed as decode steps (16 per forward); uniform INT4, "
        "`recommended()` and the SmolLM2 preset packing generated tokens past `residual_tokens` (issue 44), beside "
        "their never-packing twins (`*_unpacked`).",
        (
            Report(
                "summary.md",
                methods=("int4", "recommended_k4v3", "recommended_k4v3_unpacked", "preset", "preset_unpacked"),
            ),
        ),
        ("kl_by_position.png",),
    ),
    Question(
        "throughput",
        "Throughput under a fixed KV budget",
        f"`eval.benchmarks.bench_throughput`: the largest batch of 4K-token prompts that fits each "
        f"budget; {SPEED}. The page shows the 2 GiB budget; `budgets_256_512mib.md` the smaller ones.",
        (Report("budget_2gib.md"),),
    ),
    Question(
        "triton_aot",
        "The Triton kernels compiled for A100 / H100 without a GPU",
        "`python -m triton_ops.aot`: every launch specialization the dispatch reaches compiled for sm_80 and sm_90 on "
        "a CPU machine, with registers, stack, spills, shared memory and the load widths of the inner loops.",
        (Report("report.md", tables=(0,), notes=True, where=(("kernel", ("split_attn_kernel",)),)),),
    ),
    Question(
        "roofline",
        "Decode-attention roofline: bytes per step and predicted time at HBM bandwidth",
        "`eval.benchmarks.roofline`: the bytes each setting reads per decode step, measured on real stores, over the "
        "H100's and H200's HBM bandwidth, against FP16 FlashDecoding; not measured on a GPU. This page shows batch 1 "
        "at 32K tokens (the report: 4K / 32K / 128K, batch 1 and 32; `roofline.csv`: every context and batch).",
        (Report("report.md", where=ROOFLINE_ROWS),),
        ("roofline.png",),
    ),
    Question(
        "gpt_oss_decode",
        "gpt-oss on the fast path: decode with attention sinks at 8K",
        "`eval.benchmarks.bench_gpt_oss_decode`: a gpt-oss-20b-attention-shaped model with random weights decoding "
        'at 8K tokens, `recommended()` under `"cocktail"` (sinks in the fused CPU kernel) against `DynamicCache` '
        f"under transformers' eager attention (gpt-oss has no SDPA path); {SPEED}.",
        (Report("report.md", preamble=True),),
    ),
)
