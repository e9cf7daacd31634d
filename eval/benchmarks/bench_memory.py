"""KV-cache bytes and peak memory of each method vs a DynamicCache, at several context lengths, in one run.

For each context length (tokens of Paul Graham essays) and method, one ``model.generate`` of ``--new-tokens``
tokens; reported: KV bytes in an FP16 deployment and as held here (the model runs in float32 on CPU), the peak memory
growth during prefill and during decode (CUDA allocator on GPU, process RSS on CPU), each as a ratio to the ``fp16``
DynamicCache measured in the same run.

    python -m eval.benchmarks.bench_memory --quick
    python -m eval.benchmarks.bench_memory --contexts 1024,2048,4096,8192 --methods fp16,cocktail,int4,int2,kivi2
"""

from __future__ import annotations

from ..cli import run_cli
from ..reporting import METHOD_COLUMNS, METHOD_RULE, method_cells
from .harness import parse_args, ratio, run, save, with_fp16_baseline

MODULE = "eval.benchmarks.bench_memory"
MB = 1024 * 1024
NOTE = (
    "KV ratio: KV bytes / FP16 DynamicCache bytes (same tokens, full-precision parts at 2 bytes/element). "
    "Peak: growth of the process RSS (CPU) or CUDA allocated bytes over the baseline before generate; on CPU "
    "RSS is coarse (allocator caching), compare orders of magnitude."
)


def memory_table(results: list[dict]) -> str:
    lines = [
        f"| context | {METHOD_COLUMNS} | KV MB (fp16 deploy) | KV ratio | KV MB held here | peak prefill MB | "
        "peak decode MB | peak decode ratio |",
        f"|---|{METHOD_RULE}|---|---|---|---|---|---|",
    ]
    for r, b in with_fp16_baseline(results):
        lines.append(
            f"| {r['context_tokens']} | {method_cells(r['method'])} | {r['kv_bytes'] / MB:.1f} | "
            f"{ratio(r['kv_bytes'], b['kv_bytes']):.3f} | {r['kv_bytes_in_memory'] / MB:.1f} | "
            f"{r['peak_prefill_bytes'] / MB:.0f} | {r['peak_decode_bytes'] / MB:.0f} | "
            f"{ratio(r['peak_decode_bytes'], b['peak_decode_bytes']):.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv, MODULE, __doc__)
    results, _, _ = run(args)
    table = memory_table(results)
    print(table)
    print("\n" + NOTE)
    save(args, MODULE, results, table, "KV memory vs DynamicCache")
    return 0


if __name__ == "__main__":
    run_cli(main)
