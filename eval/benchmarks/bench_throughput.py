"""Large-batch throughput at a fixed KV budget: the largest batch of long prompts each method fits, and the tokens per
second it generates, measured side by side in one run (the paper's large-batch claim, scaled to this machine).

1. One full-precision prefill of one prompt of ``--prompt-tokens`` tokens (Paul Graham essays + a question, chat
   template), shared by every method (``eval/benchmarks/rounds.py``).
2. Per method, the KV bytes of one sequence are measured on its cache branched from that prefill (FP16 deployment
   accounting of ``eval/kv_bytes.py``: full-precision parts at 2 bytes per element, packed codes at their size),
   plus the tokens it will generate here at FP16 size (an upper bound: no method stores a new token above FP16).
   The largest batch under a budget is ``floor(budget / per-sequence bytes)`` (at most ``--max-batch``).
3. Per (budget, method), the batch is built from the same prefill (``B`` identical prompts: a Cocktail cache is
   searched and quantized once and its rows repeated; the other caches get the prefill repeated ``B`` times; decode
   cost does not depend on the tokens' values), warmed up by ``--warmup-steps`` decode steps, then timed in
   ``--rounds`` alternating rounds of ``--steps`` greedy decode steps per (budget, method) (``model.generate``
   continuing the cache; forward order on even rounds, reverse on odd ones). Generated tokens per second = ``B x
   steps / round time`` (median over rounds); the ratio to ``fp16`` (``DynamicCache``) at the same budget is taken
   per round, median over rounds. The batch cache's bytes are measured again at the end (``kv MiB used``).

On this 2-core CPU the budgets are scaled down from the paper's GPU setting (a few GiB of KV cache per GPU): default
256 MiB and 512 MiB of FP16 KV cache with 4K-token prompts (SmolLM2-135M: an FP16 ``DynamicCache`` holds ~94 MiB per
4K-token sequence, so 2 and 5 sequences). The model runs in float32 here: the bytes really held by the full-precision
parts are twice the budgeted FP16 bytes (reported as ``kv MiB held``).

    python -m eval.benchmarks.bench_throughput --budgets-mib 256,512 --prompt-tokens 4000 --threads 2 \\
        --out eval/results/throughput/budgets_256_512mib.json
"""

from __future__ import annotations

import os
import statistics

from ..cli import UsageError, parse_int_list, run_cli
from ..kv_bytes import cache_kv_bytes, fp16_kv_bytes
from ..methods.kinds import CocktailMethod
from ..reporting import METHOD_COLUMNS, METHOD_RULE, method_cells, plot_name, pyplot, save_figure
from .harness import common_args, fp16_first, new_parser, warm_model, write_outputs
from .rounds import alternating_rounds, branch_runner, shared_prefill

MODULE = "eval.benchmarks.bench_throughput"
MIB = 1024 * 1024
DEFAULT_METHODS = "fp16,cocktail,recommended,int4,int2,hqq4,hqq2,quanto4,quanto2"


def parse_args(argv=None):
    p = new_parser(MODULE, __doc__)
    p.add_argument("--budgets-mib", default="256,512", help="KV budgets in MiB of FP16-deployed KV bytes")
    p.add_argument("--prompt-tokens", type=int, default=4000, help="context tokens of each prompt")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="decode steps per (budget, method) and round")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=64, help="cap on the batch (memory of this machine)")
    p.add_argument(
        "--max-setup-s",
        type=float,
        default=150.0,
        help="skip a (budget, method) whose batch would take longer than this to build, estimated as batch "
        "x its measured batch-1 setup (hqq's quantizer: ~30 s per 4K-token sequence here); Cocktail kinds "
        "quantize once and repeat the rows",
    )
    common_args(p, threads=2)
    args = p.parse_args(argv)
    args.budget_list = parse_int_list(args.budgets_mib, "--budgets-mib")
    if any(b <= 0 for b in args.budget_list):
        raise UsageError("--budgets-mib must be positive")
    args.method_list = fp16_first(args.methods)
    if min(args.rounds, args.steps, args.max_batch) < 1 or args.warmup_steps < 0:
        raise UsageError("--rounds, --steps and --max-batch must be >= 1, --warmup-steps >= 0")
    return args


def per_sequence_bytes(method, model, tok, shared, generated: int) -> dict:
    """The method's KV bytes for one sequence: measured on its batch-1 cache after the prompt, plus ``generated``
    tokens at FP16 size."""
    run = branch_runner(method, model, tok, shared)
    prompt_bytes = cache_kv_bytes(run.cache)
    seq = int(run.cache.get_seq_length())
    fp16_token = fp16_kv_bytes(model.config, 1)
    return {
        "prompt_kv_bytes": prompt_bytes,
        "cache_tokens": seq,
        "kv_ratio_prompt": prompt_bytes / fp16_kv_bytes(model.config, seq),
        "per_sequence_bytes": prompt_bytes + generated * fp16_token,
        "setup_s_batch1": run.setup_s,
    }


def table(results: list[dict]) -> str:
    lines = [
        f"| budget MiB | {METHOD_COLUMNS} | per-seq KV MiB | batch | kv MiB used (held here) | tokens/s (median) | "
        "ratio vs fp16 (range) | ms/step |",
        f"|---|{METHOD_RULE}|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['budget_mib']} | {method_cells(r['method'])} | {r['per_sequence_bytes'] / MIB:.1f} | {r['batch']} | "
            f"{r['batch_kv_bytes'] / MIB:.0f} ({r['batch_kv_bytes_held'] / MIB:.0f}) | "
            f"{r['tokens_per_s']:.2f} | {r['ratio_vs_fp16']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
            f" | {r['ms_per_step']:.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(r["method"] for r in results):
        rows = sorted((r for r in results if r["method"] == m), key=lambda r: r["budget_mib"])
        ax.plot(
            [r["budget_mib"] for r in rows],
            [r["tokens_per_s"] for r in rows],
            marker="o",
            label=f"{plot_name(m)} (batch {', '.join(str(r['batch']) for r in rows)})",
            linewidth=2.5 if m in ("fp16", "cocktail", "recommended") else 1.2,
        )
    ax.set_xlabel("KV budget (MiB of FP16-deployed KV bytes)")
    ax.set_ylabel("generated tokens / s (measured)")
    ax.set_title("Throughput at a fixed KV budget: largest batch of 4K-token prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    model, tok = warm_model(args)
    shared = shared_prefill(model, tok, args.prompt_tokens, args.essay_dir, args.method_list)
    print(f"prompt {shared.prompt_tokens} tokens, shared prefill {shared.prefill_s:.1f} s", flush=True)
    generated = 1 + args.warmup_steps + args.rounds * args.steps
    sizes = {m.name: per_sequence_bytes(m, model, tok, shared, generated) for m in args.method_list}
    runners, meta, skipped = [], [], []
    for budget in args.budget_list:
        for m in args.method_list:
            size = sizes[m.name]
            batch = min(args.max_batch, (budget * MIB) // size["per_sequence_bytes"])
            if batch < 1:
                print(f"budget {budget} MiB: {m.name} does not fit one sequence", flush=True)
                skipped.append(
                    {"budget_mib": budget, "method": m.name, "batch": 0, **size, "skipped": "does not fit one sequence"}
                )
                continue
            build_s = size["setup_s_batch1"] * (1 if isinstance(m, CocktailMethod) else batch)
            if build_s > args.max_setup_s:
                why = (
                    f"building batch {batch} would take ~{build_s:.0f} s (> --max-setup-s {args.max_setup_s:g}; "
                    f"{size['setup_s_batch1']:.1f} s per sequence)"
                )
                print(f"budget {budget} MiB: {m.name} skipped: {why}", flush=True)
                skipped.append({"budget_mib": budget, "method": m.name, "batch": batch, **size, "skipped": why})
                continue
            runners.append(branch_runner(m, model, tok, shared, batch=batch))
            meta.append({"budget_mib": budget, "method": m.name, "batch": batch, **size})
            print(
                f"budget {budget} MiB: {m.name} batch {batch} ({size['per_sequence_bytes'] / MIB:.1f} MiB/seq)",
                flush=True,
            )
    alternating_rounds(runners, model, args.rounds, args.steps, tok.eos_token_id, args.warmup_steps)
    results = []
    for r, info in zip(runners, meta):
        ref = next(x for x, i in zip(runners, meta) if i["budget_mib"] == info["budget_mib"] and i["method"] == "fp16")
        tps = [r.batch * args.steps / s for s in r.round_s]
        ratios = [a / b for a, b in zip(tps, (ref.batch * args.steps / s for s in ref.round_s))]
        results.append(
            {
                **info,
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_rounds": tps,
                "ms_per_step": 1000 * statistics.median(r.round_s) / args.steps,
                "ratio_vs_fp16": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "batch_kv_bytes": cache_kv_bytes(r.cache),
                "batch_kv_bytes_held": cache_kv_bytes(r.cache, deployed=False),
                "batch_cache_tokens": int(r.cache.get_seq_length()),
                "setup_s": r.setup_s,
            }
        )
    out = table(results)
    if skipped:
        out += "\n\nNot measured: " + "; ".join(
            f"{x['method']} at {x['budget_mib']} MiB ({x['skipped']})" for x in skipped
        )
    print(out)
    if args.out:
        base = os.path.splitext(args.out)[0]
        payload = {
            "prompt_tokens": shared.prompt_tokens,
            "shared_prefill_s": shared.prefill_s,
            "generated_tokens_per_sequence": generated,
            "results": results,
        }
        title = f"Throughput at a fixed KV budget ({shared.prompt_tokens}-token prompts)"
        image = f"\n![tokens/s vs KV budget]({os.path.basename(base)}.png)\n"
        write_outputs(args.out, MODULE, payload, title, out, image)
        plot(results, base + ".png")
    return 0


if __name__ == "__main__":
    run_cli(main)
