"""Time per output token (and prefill time) of each method vs a DynamicCache at several context lengths, measured
in one run, plus the "no reorder" ablation of Cocktail's decode attention (``eval/benchmarks/no_reorder.py``).

* end to end: one ``model.generate`` of ``--new-tokens`` per (context, method); prefill = time to the first token,
  decode = the rest divided by the decode steps; ratios against ``fp16`` of the same run.
* no reorder: attention over precision segments vs chunk by chunk in the original order, on the real layer-0 store
  of a Cocktail cache at each context (PyTorch reference path), outputs checked to agree.

    python -m eval.benchmarks.bench_latency --quick
    python -m eval.benchmarks.bench_latency --contexts 1024,2048,4096,8192 --methods fp16,cocktail,int4,int2,kivi2
"""

from __future__ import annotations

from ..cli import run_cli
from .harness import parse_args, ratio, run, save
from .no_reorder import no_reorder_ablation

MODULE = "eval.benchmarks.bench_latency"


def latency_table(results: list[dict]) -> str:
    lines = ["| context | method | prefill s | prefill ratio | decode ms/token | decode ratio |",
             "|---|---|---|---|---|---|"]
    base = {r["context_tokens"]: r for r in results if r["method"] == "fp16"}
    for r in results:
        b = base.get(r["context_tokens"], r)
        lines.append(f"| {r['context_tokens']} | {r['method']} | {r['prefill_s']:.2f} | "
                     f"{ratio(r['prefill_s'], b['prefill_s']):.2f} | {r['decode_ms_per_token']:.1f} | "
                     f"{ratio(r['decode_ms_per_token'], b['decode_ms_per_token']):.2f} |")
    return "\n".join(lines)


def ablation_table(abl: list[dict]) -> str:
    lines = ["", "No reorder (one decode query, layer 0, PyTorch path): attention over segments vs chunk by chunk",
             "", "| context | chunks (packed) | segments ms | per-chunk ms | per-chunk / segments |",
             "|---|---|---|---|---|"]
    for a in abl:
        lines.append(f"| {a['context_tokens']} | {a['chunks']} ({a['packed_chunks']}) | {a['segments_ms']:.2f} | "
                     f"{a['per_chunk_ms']:.2f} | {ratio(a['per_chunk_ms'], a['segments_ms']):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv, MODULE, __doc__.split("\n\n")[0])
    results, model, tok = run(args)
    table = latency_table(results)
    print(table)
    abl = no_reorder_ablation(model, tok, args.context_list, args.essay_dir)
    abl_table = ablation_table(abl)
    print(abl_table)
    results_all = results + [dict(a, method="no_reorder_ablation") for a in abl]
    save(args, MODULE, results_all, table + "\n" + abl_table, "Decode latency vs DynamicCache")
    return 0


if __name__ == "__main__":
    run_cli(main)
