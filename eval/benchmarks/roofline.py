"""Roofline of decode attention: the bytes each cache setting reads per decode step, turned into a predicted time
at HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s), against FP16 FlashDecoding's bytes (every K/V element read
once at 2 bytes).

Bytes per token come from real stores, not typed constants: a :class:`~hf_cocktail.storage.store.PackedSegment`
of 1024 tokens per precision and a full part of 1024 tokens are built with the library (chunk 32, value group 32,
fp16 scales, or 8-bit scales / an 8-bit full part) for each model's KV heads and head dim, and their ``nbytes``
divided by the tokens; a rotated setting adds its matrices (``Rotation.make``'s tensors, read once per layer and
step). Per layer the tokens are the model's own (``eval.kv_bytes.layer_token_counts``: Gemma 3's sliding-window
layers hold at most 1023 tokens, kept at FP16 by a Cocktail cache too). A setting places a fixed share of the
context chunks at FP16 / INT4 / the low width (the shares of ``eval.benchmarks.bench_kernels``' mixes: 10 / 30 / 60
for the paper's thresholds), plus a full-precision tail of 32 tokens. What is not counted: the query, the output
and the split partials (kilobytes), the caches' index tensors.

    python -m eval.benchmarks.roofline --out eval/results/roofline
    python -m eval.benchmarks.roofline --compare OUT/bench_kernels.csv --out OUT   (the GPU check: measured / predicted)
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import sys
from dataclasses import dataclass

import torch

from ..reporting import pyplot, save_figure, write_dict_csv

BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # HBM bytes/s: H100 SXM (HBM3), H200 (HBM3e)
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
BATCHES = (1, 8, 32)
TAIL = 32  # full-precision tail (template, question, current token), as bench_kernels
REF_TOKENS = 1024  # tokens of the small real stores the bytes per token are measured on


@dataclass(frozen=True)
class Setting:
    """Shares of the context chunks at FP16 (the full part) / INT4 / ``low`` bits; 8-bit scales and zeros; an 8-bit
    full part; a rotation."""

    name: str
    shares: tuple[float, float, float]
    low: int = 2
    scale_bits: int = 16
    full_bits: int = 16
    rotation: str | None = None


SETTINGS = (
    Setting("int4", (0.0, 1.0, 0.0)),
    Setting("int2", (0.0, 0.0, 1.0)),
    Setting("paper", (0.1, 0.3, 0.6)),
    Setting("paper_int3", (0.1, 0.3, 0.6), low=3),
    Setting("paper_s8_f8", (0.1, 0.3, 0.6), scale_bits=8, full_bits=8),
    Setting("paper_s8_f8_hadamard", (0.1, 0.3, 0.6), scale_bits=8, full_bits=8, rotation="hadamard"),
)


def model_configs() -> dict:
    """transformers configs of the modelled shapes (no download): Llama-3-8B (32 layers, 8 KV heads of 128),
    Qwen2.5-7B (28 layers, 4 KV heads of 128), Gemma 3 4B (34 layers, 4 KV heads of 256, 5 of 6 layers sliding
    over 1024 tokens)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    return {
        "llama3-8b": LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096),
        "qwen2.5-7b": Qwen2Config(
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584
        ),
        "gemma3-4b": Gemma3TextConfig(
            num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024
        ),
    }


@functools.cache
def bytes_per_token(H_kv: int, D: int, what: str, scale_bits: int = 16) -> float:
    """Bytes one token of one sequence takes in one layer, measured on a real store of :data:`REF_TOKENS` tokens:
    ``what`` = ``"full16"`` / ``"full8"`` (the full part) or ``"int2"`` / ``"int3"`` / ``"int4"`` (a packed
    segment: codes, scales and zeros, 8-bit blocks)."""
    from hf_cocktail.storage.full_part import full_part_from_sequences
    from hf_cocktail.storage.store import PackedSegment

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(H_kv, REF_TOKENS, D, generator=g).half() for _ in range(2))
    if what.startswith("full"):
        return full_part_from_sequences([k], [v], int(what[4:]), torch.float16).nbytes() / REF_TOKENS
    seg = PackedSegment.from_sequences(
        [k.float()], [v.float()], int(what[3:]), 32, 32, torch.float16, None, None, None, scale_bits
    )
    return (seg.nbytes_codes() + seg.nbytes_params()) / REF_TOKENS


@functools.cache
def rotation_bytes(H_kv: int, D: int, kind: str | None) -> int:
    from hf_cocktail.storage.rotation import Rotation

    rot = Rotation.make(kind, H_kv, D, seed=0)
    return 0 if rot is None else sum(t.numel() * t.element_size() for t in rot.tensors())


def layer_bytes(H_kv: int, D: int, setting: Setting | None, tokens: int, batch: int, quantized: bool = True) -> float:
    """Bytes one decode step reads in one layer holding ``tokens`` tokens per sequence; ``setting`` None (or a
    layer the cache does not quantize): FP16 FlashDecoding, 2 bytes per K/V element."""
    fp16 = 2 * 2 * H_kv * D
    if setting is None or not quantized:
        return batch * tokens * fp16
    ctx = max(tokens - TAIL, 0)
    f16, f4, flow = setting.shares
    full = (TAIL + f16 * ctx) * bytes_per_token(H_kv, D, f"full{setting.full_bits}")
    packed = f4 * ctx * bytes_per_token(H_kv, D, "int4", setting.scale_bits)
    packed += flow * ctx * bytes_per_token(H_kv, D, f"int{setting.low}", setting.scale_bits)
    return batch * (full + packed) + rotation_bytes(H_kv, D, setting.rotation)


def step_bytes(config, setting: Setting | None, context: int, batch: int) -> float:
    """Bytes of one decode step over every layer of ``config`` at ``context`` tokens."""
    from eval.kv_bytes import full_attention_layers, kv_geometry, layer_token_counts

    H_kv, D = kv_geometry(config)
    full_layers = set(full_attention_layers(config))
    counts = layer_token_counts(config, context)
    return sum(layer_bytes(H_kv, D, setting, n, batch, i in full_layers) for i, n in enumerate(counts))


def table() -> list[dict]:
    from tqdm import tqdm

    rows = []
    configs = model_configs()
    work = [(m, c, b) for m in configs for c in CONTEXTS for b in BATCHES]
    for model, context, batch in tqdm(work, desc="roofline"):
        base = step_bytes(configs[model], None, context, batch)
        for s in (None, *SETTINGS):
            nbytes = base if s is None else step_bytes(configs[model], s, context, batch)
            row = dict(model=model, context=context, batch=batch, setting="fp16_flashdecoding" if s is None else s.name)
            row.update(MB=round(nbytes / 1e6, 2), bytes_vs_fp16=round(nbytes / base, 4))
            row.update({f"pred_us_{gpu}": round(nbytes / bw * 1e6, 2) for gpu, bw in BANDWIDTH.items()})
            rows.append(row)
    return rows


def write_markdown(rows: list[dict], path: str, command: str) -> None:
    shown = [r for r in rows if r["batch"] in (1, 32) and r["context"] in (4096, 32768, 131072)]
    cols = list(rows[0])
    lines = [
        "# Decode-attention roofline: bytes per decode step and predicted time at HBM bandwidth",
        "",
        f"Command: `{command}`",
        "",
        "Predicted time = bytes read per decode step (all layers) / HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 "
        "TB/s): a lower bound no kernel beats. Bytes per token measured on real stores built by the library (see "
        "eval/benchmarks/roofline.py); settings place 10/30/60% of the context chunks at FP16/INT4/low bits "
        "(`paper*`) or all at one width, plus a 32-token FP16 tail. Not measured on a GPU: no GPU was lent to this "
        "session; eval/gpu_check.sh reports measured / predicted when one is (roofline_vs_measured.csv).",
        "",
        "Batch 1 and 32 at 4K / 32K / 128K shown; every context and batch 1 / 8 / 32 in roofline.csv.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in shown]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(rows: list[dict], path: str) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = pyplot().subplots(2, len(models), figsize=(5 * len(models), 7.5), sharey="row")
    for col, model in enumerate(models):
        for setting in dict.fromkeys(r["setting"] for r in rows):
            mine = [r for r in rows if (r["model"], r["setting"], r["batch"]) == (model, setting, 8)]
            style = dict(marker="o", label=setting, linestyle="--" if setting.startswith("fp16") else "-")
            axes[0, col].plot([r["context"] for r in mine], [r["pred_us_H100"] for r in mine], **style)
            axes[1, col].plot([r["context"] for r in mine], [r["bytes_vs_fp16"] for r in mine], **style)
        axes[0, col].set(yscale="log", title=f"{model}, batch 8")
        axes[1, col].set(xlabel="context tokens", ylim=(0, 1.05))
        for ax in axes[:, col]:
            ax.set_xscale("log")
            ax.set_xticks(CONTEXTS, [f"{c // 1024}K" for c in CONTEXTS])
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("predicted time per decode step on H100 (us)")
    axes[1, 0].set_ylabel("bytes read / FP16 FlashDecoding's")
    axes[0, -1].legend(fontsize=7)
    fig.suptitle("Decode-attention roofline: bytes read per step (all layers) / 3.35 TB/s; not measured on a GPU")
    save_figure(fig, path, dpi=110)


def compare(bench_csv: str, bandwidth: float) -> list[dict]:
    """Rows of ``eval.benchmarks.bench_kernels``' CSV (one Llama-3-8B-shaped layer, FP16 SDPA and the Cocktail
    mixes) with the roofline's predicted time for the same layer, mix and size, and measured / predicted."""
    by_method = {"fp16_sdpa": None, **{f"cocktail_{s.name}": s for s in SETTINGS}}
    out = []
    with open(bench_csv) as f:
        for r in csv.DictReader(f):
            if r["method"] not in by_method:
                continue
            nbytes = layer_bytes(8, 128, by_method[r["method"]], int(r["context_tokens"]), int(r["batch"]))
            pred = nbytes / bandwidth * 1e6
            measured = float(r["time_us"])
            out.append(
                dict(
                    context_tokens=r["context_tokens"],
                    batch=r["batch"],
                    method=r["method"],
                    measured_us=measured,
                    predicted_us=round(pred, 2),
                    measured_over_predicted=round(measured / pred, 2),
                    pct_of_roofline=round(100 * pred / measured, 1),
                    predicted_MB=round(nbytes / 1e6, 3),
                    measured_cache_MB=round(int(r["cache_bytes"]) / 1e6, 3),
                )
            )
    return out


def _bandwidth(arg: str | None) -> float:
    if arg:
        return BANDWIDTH.get(arg) or float(arg)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    for gpu, bw in BANDWIDTH.items():
        if gpu in name:
            return bw
    raise SystemExit(f"unknown GPU {name!r}: pass --bandwidth (bytes/s, or one of {list(BANDWIDTH)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the table, the PNG (or the comparison)")
    ap.add_argument("--compare", help="bench_kernels CSV measured on a GPU: write roofline_vs_measured.csv")
    ap.add_argument("--bandwidth", help="HBM bytes/s or H100 / H200 (default: from the GPU's name)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    command = "python -m eval.benchmarks.roofline " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.compare:
        if not os.path.exists(args.compare):
            print(f"no {args.compare}: the kernel benchmark did not write it; nothing to compare")
            return 1
        rows = compare(args.compare, _bandwidth(args.bandwidth))
        write_dict_csv(os.path.join(args.out, "roofline_vs_measured.csv"), rows)
        for r in rows:
            print(r)
        return 0
    rows = table()
    write_dict_csv(os.path.join(args.out, "roofline.csv"), rows)
    write_markdown(rows, os.path.join(args.out, "report.md"), command)
    plot(rows, os.path.join(args.out, "roofline.png"))
    print(f"{len(rows)} rows -> {args.out}/roofline.csv, report.md, roofline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
