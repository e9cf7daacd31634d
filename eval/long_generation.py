"""Long-generation fidelity (issue 44): teacher-forced KL divergence from FP16 over >= 1,024 generated tokens, with
generated tokens packed as they leave the residual window (``CocktailConfig.residual_tokens``).

Per text: ``--prompt-tokens`` tokens of the Paul Graham essays (``../shared/data/paul_graham_essays``, the whole
essays joined, windows ``--stride`` tokens apart) are the prompt (its last 64 tokens the "question" that
``prepare_inputs`` is given; with ``uniform_bits`` no search runs, the preset's salient tokens read them), the next
``--new-tokens`` are the continuation. FP16's logits come from a ``DynamicCache``: the prompt prefilled, the
continuation in one forward. Every method prefills the prompt in its cache and is then fed the continuation
``--block`` tokens per forward (1: token by token), as decode steps (the cache sees them as generated tokens: the
packed methods pack them a chunk at a time past ``residual_tokens``, at the start of each forward, so a block's
tokens stay unpacked while it is attended: up to ``block - 1`` more full-precision tokens than token by token);
at every fed position ``KL(P_fp16 || P_method)`` and top-1 agreement are recorded. ``fp16`` is a
``DynamicCache`` fed the same way (the numeric floor of step-by-step against one forward); ``*_unpacked`` twins keep
``residual_tokens`` beyond the generation (generated tokens never packed, the cache before issue 44).

    python -m eval.long_generation --texts 3 --prompt-tokens 512 --new-tokens 1024 --out eval/results/long_generation
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.calibrate.divergence import kl_and_top1
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.offline_models import load_offline_model

from .cli import UsageError, run_cli
from .essays import load_essays
from .paths import REPO_ROOT
from .records import write_json
from .reporting import pyplot, save_figure
from .run_info import command_line, git_commit, hardware_info

MODULE = "eval.long_generation"
NEVER_PACKED = 10**9  # residual_tokens of the unpacked twins
QUESTION_TOKENS = 64  # the prompt's last tokens, given to prepare_inputs as the question
PRESET = os.path.join(REPO_ROOT, "model_cards", "smollm2-135m-instruct")
WINDOWS = ((0, 128), (128, 512), (512, None))  # generated-token ranges of the summary (packing starts past 160)


def method_configs() -> dict[str, CocktailConfig | None]:
    """The methods: ``None`` is a ``DynamicCache``."""
    preset = CocktailConfig.from_pretrained(PRESET)
    return {
        "fp16": None,
        "int4": CocktailConfig(uniform_bits=4),
        "recommended": CocktailConfig.recommended(),
        "recommended_unpacked": CocktailConfig.recommended(residual_tokens=NEVER_PACKED),
        "preset": preset,
        "preset_unpacked": CocktailConfig.from_dict({**preset.to_dict(), "residual_tokens": NEVER_PACKED}),
    }


def texts(tok, n: int, prompt_tokens: int, new_tokens: int, stride: int) -> list[torch.Tensor]:
    """``n`` windows ``(prompt_tokens + new_tokens,)`` of the essays' tokens, ``stride`` tokens apart."""
    ids = tok("\n\n".join(load_essays()), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    need = prompt_tokens + new_tokens
    starts = [i * stride for i in range(n)]
    if starts[-1] + need > ids.shape[0]:
        raise UsageError(f"the essays have {ids.shape[0]} tokens: {n} windows of {need} need --stride < {stride}")
    return [ids[s : s + need] for s in starts]


@torch.no_grad()
def _forward(model, cache, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits[0].float()


def prompt_inputs(tok, prompt_ids: torch.Tensor, config: CocktailConfig | None):
    """The cache and the prompt's ids ``(1, L)`` (a Cocktail cache prepared with the prompt's text, its last
    :data:`QUESTION_TOKENS` tokens as the question)."""
    if config is None:
        return DynamicCache(), prompt_ids[None]
    cache = CocktailCache(config)
    text = tok.decode(prompt_ids)
    context = tok.decode(prompt_ids[:-QUESTION_TOKENS])
    enc = cache.prepare_inputs(tok, text, contexts=context, queries=tok.decode(prompt_ids[-QUESTION_TOKENS:]))
    return cache, enc["input_ids"]


def run_text(model, tok, window: torch.Tensor, prompt_tokens: int, methods: dict, block: int, bar) -> list[dict]:
    """Every method on one window, the continuation fed ``block`` tokens per decode forward; one record per
    method."""
    prompt, cont = window[:prompt_tokens], window[prompt_tokens:]
    records = []
    ref_logits = None
    for name, config in methods.items():
        cache, ids = prompt_inputs(tok, prompt, config)
        if ref_logits is None:  # the FP16 reference on the same prompt ids (the first method's tokenization)
            ref_ids = ids
            ref_cache = DynamicCache()
            _forward(model, ref_cache, ref_ids)
            ref_logits = _forward(model, ref_cache, cont[None])
            del ref_cache
        if not torch.equal(ids, ref_ids):
            raise RuntimeError(f"{name}: prepare_inputs tokenized the prompt differently from the reference")
        _forward(model, cache, ids)
        t0 = time.perf_counter()
        rows = []
        for i in range(0, cont.shape[0], block):
            rows.append(_forward(model, cache, cont[None, i : i + block]))
            bar.update(rows[-1].shape[0])
        kl, agree = kl_and_top1(ref_logits, torch.cat(rows))
        rep = cache.memory_report() if isinstance(cache, CocktailCache) else {}
        records.append(
            {
                "method": name,
                "prompt_tokens": int(ids.shape[1]),
                "new_tokens": int(cont.shape[0]),
                "kl": [round(float(x), 7) for x in kl],
                "top1": [bool(x) for x in agree],
                "ratio_to_fp16": rep.get("ratio_to_fp16", 1.0),
                "appended_packed_tokens": rep.get("appended_packed_tokens", 0),
                "decode_s": round(time.perf_counter() - t0, 1),
            }
        )
        del cache
    return records


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _key(a: int, b: int | None) -> str:
    return f"kl_{a}_{b or 'end'}"


def summarize(records: list[dict], methods: list[str]) -> list[dict]:
    """Per method: mean KL per window and over all positions (mean over texts of the per-text means), top-1
    agreement, the final ratio to FP16 and the packed generated tokens."""
    rows = []
    for m in methods:
        recs = [r for r in records if r["method"] == m]
        row: dict = {"method": m, "texts": len(recs)}
        for a, b in WINDOWS:
            row[_key(a, b)] = _mean([_mean(r["kl"][a:b]) for r in recs])
        row["kl_all"] = _mean([_mean(r["kl"]) for r in recs])
        row["kl_all_per_text"] = [_mean(r["kl"]) for r in recs]
        row["top1"] = _mean([_mean([float(x) for x in r["top1"]]) for r in recs])
        row["ratio_to_fp16"] = _mean([r["ratio_to_fp16"] for r in recs])
        row["appended_packed_tokens"] = _mean([r["appended_packed_tokens"] for r in recs])
        rows.append(row)
    return rows


def markdown(rows: list[dict], header: str) -> str:
    cols = [f"KL {a}-{b or 'end'}" for a, b in WINDOWS]
    lines = [
        header,
        "",
        f"| method | {' | '.join(cols)} | KL all | KL all per text | top-1 agree | packed generated | ratio_to_fp16 |",
        "|---|" + "---|" * (len(cols) + 5),
    ]
    for r in rows:
        kls = " | ".join(f"{r[_key(a, b)]:.5f}" for a, b in WINDOWS)
        per = ", ".join(f"{x:.5f}" for x in r["kl_all_per_text"])
        lines.append(
            f"| `{r['method']}` | {kls} | {r['kl_all']:.5f} | {per} | {r['top1']:.4f} | "
            f"{r['appended_packed_tokens']:.0f} | {r['ratio_to_fp16']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(path: str, records: list[dict], methods: list[str], window: int = 64) -> None:
    """KL from FP16 against the generated position (mean over texts, rolling mean over ``window`` positions)."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for m in methods:
        recs = [r for r in records if r["method"] == m]
        if m == "fp16" or not recs:
            continue
        kl = torch.tensor([r["kl"] for r in recs]).mean(0)
        smooth = torch.nn.functional.avg_pool1d(kl[None, None], window, 1)[0, 0]
        ax.plot(range(window // 2, window // 2 + smooth.shape[0]), smooth, label=m)
    ax.axvline(160, color="grey", lw=0.8, ls="--")
    ax.text(162, ax.get_ylim()[1] * 0.9, "first pack (residual 128 + chunk 32)", fontsize=8, color="grey")
    ax.set_xlabel("generated token (teacher-forced)")
    ax.set_ylabel(f"KL from FP16 (nats, rolling mean over {window})")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M-Instruct: long generation, generated tokens packed vs not")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--stride", type=int, default=20000, help="tokens between the windows' starts")
    p.add_argument("--methods", default=None, help="comma-separated subset of " + ", ".join(method_configs()))
    p.add_argument("--block", type=int, default=16, help="generated tokens fed per decode forward (1: token by token)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="a folder for records.jsonl, summary.md/json and the PNG")
    args = p.parse_args(argv)
    if args.prompt_tokens <= QUESTION_TOKENS or min(args.new_tokens, args.texts, args.block) < 1:
        raise UsageError(f"--prompt-tokens must exceed {QUESTION_TOKENS}; --new-tokens, --texts, --block be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = method_configs()
    if args.methods:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in names if m not in methods]
        if unknown:
            raise UsageError(f"--methods: unknown {unknown}; allowed {list(methods)}")
        methods = {m: methods[m] for m in names}
    commit, started = git_commit(exclude=args.out), time.time()
    model, tok = load_offline_model("smollm2-135m-instruct")
    windows = texts(tok, args.texts, args.prompt_tokens, args.new_tokens, args.stride)
    records = []
    with tqdm(total=len(windows) * len(methods) * args.new_tokens, desc="teacher-forced steps") as bar:
        for i, w in enumerate(windows):
            for r in run_text(model, tok, w, args.prompt_tokens, methods, args.block, bar):
                records.append({"text": i, **r})
    rows = summarize(records, list(methods))
    header = (
        f"Long generation, SmolLM2-135M-Instruct fp32, {len(windows)} essay windows: {args.prompt_tokens}-token "
        f"prompt, {args.new_tokens} teacher-forced generated tokens fed {args.block} per decode forward; "
        "KL(FP16 || method) "
        f"in nats per generated position. `{command_line(MODULE)}` at {commit}, "
        f"{time.time() - started:.0f} s, {torch.get_num_threads()} thread(s)."
    )
    print(markdown(rows, header))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "records.jsonl"), "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
            f.write(markdown(rows, header))
        info = {"command": command_line(MODULE), "commit": commit, "hardware": hardware_info(), "summary": rows}
        write_json(os.path.join(args.out, "summary.json"), info)
        plot(os.path.join(args.out, "kl_by_position.png"), records, list(methods))
    return 0


if __name__ == "__main__":
    run_cli(main)
