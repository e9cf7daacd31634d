"""KV-cache bytes and peak memory of each method vs a DynamicCache, at several context lengths, in one run.

For each context length (tokens of Paul Graham essays) and method, one ``model.generate`` of ``--new-tokens``
tokens; reported: KV bytes in an FP16 deployment and as held here (the model runs in float32 on CPU), the peak memory
growth during prefill and during decode (CUDA allocator on GPU, process RSS on CPU), each as a ratio to the ``fp16``
DynamicCache measured in the same run.

    python eval/bench_memory.py --quick
    python eval/bench_memory.py --contexts 1024,2048,4096,8192 --methods fp16,cocktail,int4,int2,kivi2
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.common import UsageError, hardware_info, parse_int_list, set_threads, write_json  # noqa: E402

MB = 1024 * 1024


def parse_args(argv=None, default_methods="fp16,cocktail,int4,int2,kivi2"):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--contexts", default=None, help="context lengths in tokens (default 1024,2048,4096,8192)")
    p.add_argument("--methods", default=None, help=f"methods (default {default_methods})")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per run (default 32)")
    p.add_argument("--quick", action="store_true",
                   help="defaults become: contexts 1024,2048, 8 new tokens, methods fp16,cocktail,int2")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device-map", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--essay-dir", default=None)
    p.add_argument("--out", default=None, help="also write the results to this JSON file (and a .md next to it)")
    args = p.parse_args(argv)
    quick = {"contexts": "1024,2048", "new_tokens": 8, "methods": "fp16,cocktail,int2"}
    full = {"contexts": "1024,2048,4096,8192", "new_tokens": 32, "methods": default_methods}
    for k in quick:
        if getattr(args, k) is None:
            setattr(args, k, (quick if args.quick else full)[k])
    args.context_list = parse_int_list(args.contexts, "--contexts")
    if any(c < 64 for c in args.context_list):
        raise UsageError(f"--contexts must be >= 64 tokens, got {args.context_list}")
    if args.new_tokens < 2:
        raise UsageError("--new-tokens must be >= 2 (decode time needs at least one decode step)")
    from eval.methods import parse_methods

    args.method_list = parse_methods(args.methods)
    if args.method_list[0].name != "fp16":
        args.method_list = [m for m in parse_methods("fp16")] + [m for m in args.method_list if m.name != "fp16"]
    return args


def run(args):
    from tqdm.auto import tqdm

    from eval.bench import haystack_context, measure
    from eval.common import load_model_and_tokenizer

    set_threads(1, args.threads)
    model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", args.device_map)
    # warm-up of every method (first-call overheads, lazy encoder loading would otherwise land in the measurements)
    for m in args.method_list:
        measure(m, model, tok, haystack_context(tok, 64, args.essay_dir), 2)
    results = []
    jobs = [(c, m) for c in args.context_list for m in args.method_list]
    for c, m in tqdm(jobs, desc="bench", dynamic_ncols=True):
        results.append(measure(m, model, tok, haystack_context(tok, c, args.essay_dir), args.new_tokens))
    return results, model, tok


def _ratio(a, b):
    return a / b if b else float("nan")


def memory_table(results) -> str:
    lines = ["| context | method | KV MB (fp16 deploy) | KV ratio | KV MB held here | peak prefill MB | "
             "peak decode MB | peak decode ratio |", "|---|---|---|---|---|---|---|---|"]
    base = {r["context_tokens"]: r for r in results if r["method"] == "fp16"}
    for r in results:
        b = base.get(r["context_tokens"], r)
        lines.append(f"| {r['context_tokens']} | {r['method']} | {r['kv_bytes'] / MB:.1f} | "
                     f"{_ratio(r['kv_bytes'], b['kv_bytes']):.3f} | {r['kv_bytes_in_memory'] / MB:.1f} | "
                     f"{r['peak_prefill_bytes'] / MB:.0f} | {r['peak_decode_bytes'] / MB:.0f} | "
                     f"{_ratio(r['peak_decode_bytes'], b['peak_decode_bytes']):.2f} |")
    return "\n".join(lines)


def save(args, results, table, title):
    if not args.out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    from eval.common import command_line, git_commit

    write_json(args.out, {"command": command_line(), "commit": git_commit(exclude=args.out),
                          "hardware": hardware_info(), "results": results})
    with open(os.path.splitext(args.out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(f"# {title}\n\n`{command_line()}`\n\n{table}\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    results, _, _ = run(args)
    table = memory_table(results)
    print(table)
    print("\nKV ratio: KV bytes / FP16 DynamicCache bytes (same tokens, full-precision parts at 2 bytes/element). "
          "Peak: growth of the process RSS (CPU) or CUDA allocated bytes over the baseline before generate; on CPU "
          "RSS is coarse (allocator caching), compare orders of magnitude.")
    save(args, results, table, "KV memory vs DynamicCache")
    return 0


if __name__ == "__main__":
    from eval.common import run_cli  # noqa: E402

    run_cli(main)
