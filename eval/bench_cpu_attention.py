"""CPU decode-attention microbenchmark: the fused ``cpu_ops`` kernel vs SDPA over a full-precision cache and vs the
dequantize-then-attend PyTorch path, one layer, one new token.

Setting: SmolLM2-135M heads (B=1, H_kv=3, n_rep=3, D=64), query / full-part dtype float32 or bfloat16, fp16
scales/zeros, chunk size C=32, value group G=32. A cache of T tokens holds a full-precision tail of 32 tokens
(template, question, the current token) and T - 32 context tokens in chunks of C. Mixes of the context chunks:
``paper`` 10% FP16 / 30% INT4 / 60% INT2 (assigned at random, a typical Cocktail outcome) and ``int2`` (all INT2).

Methods (each timed in the same run, interleaved round by round so that machine noise hits all alike; the median of
every method's rounds is reported, and the minimum):

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over K/V of T tokens in the query dtype, GQA
  expanded (K/V repeated to H_q heads beforehand; the copy is not timed);
* ``sdpa_rows``: the same with the n_rep query heads of a kv head folded into query rows (exact for one decode token;
  what transformers does for a single query token, no K/V copy). Ratios use the faster of the two SDPA rows;
* ``torch``: hf_cocktail's PyTorch split-precision attention (dequantize each block to fp32, then attend);
* ``fused``: ``cpu_ops.split_precision_attention`` over the same store. Its max abs difference from ``torch`` is
  reported (``err``).

Usage::

    python -m eval.bench_cpu_attention                       # 2 threads, 4K/8K/16K, fp32 and bf16: ~1 minute
    python -m eval.bench_cpu_attention --threads 8 --lengths 8192 --out bench_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import cpu_ops
from hf_cocktail.storage.store import FullPart, LayerStore, PackedSegment

try:
    from hf_cocktail.decode.split_attention import split_precision_attention_torch
except ImportError:  # older layout
    from hf_cocktail.integration.attention import split_precision_attention_torch

H_KV, N_REP, D, C, G, TAIL = 3, 3, 64, 32, 32, 32
MIXES = {"paper": (0.1, 0.3, 0.6), "int2": (0.0, 0.0, 1.0)}  # fractions of context chunks at FP16 / INT4 / INT2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_store(T: int, mix, dtype: torch.dtype, gen: torch.Generator):
    """A one-sequence LayerStore of T tokens; returns it with the same cache as plain K/V ``(1, H_kv, T, D)``."""
    k = torch.randn(1, H_KV, T, D, generator=gen) * (1 + 3 * (torch.rand(1, 1, 1, D, generator=gen) < 0.1))
    v = torch.randn(1, H_KV, T, D, generator=gen)
    n_chunks = (T - TAIL) // C
    n16, n4 = round(mix[0] * n_chunks), round(mix[1] * n_chunks)
    bits = torch.tensor([16] * n16 + [4] * n4 + [2] * (n_chunks - n16 - n4))[torch.randperm(n_chunks, generator=gen)]
    full_idx, segs = [], []
    for b in (16, 4, 2):
        idx = [t for c in range(n_chunks) if bits[c] == b for t in range(c * C, (c + 1) * C)]
        if b == 16:
            full_idx = idx + list(range(n_chunks * C, T))  # FP16 chunks, then the tail (the current token last)
        elif idx:
            segs.append(PackedSegment.from_sequences([k[0, :, idx]], [v[0, :, idx]], b, C, G, torch.float16))
    full = FullPart.from_sequences([k[0, :, full_idx].to(dtype)], [v[0, :, full_idx].to(dtype)])
    return LayerStore(full, segs), k.to(dtype), v.to(dtype)


def time_interleaved(fns: dict, rounds: int, min_round_s: float = 0.02) -> tuple[dict, dict]:
    """Median and minimum seconds per call of each function over ``rounds`` rounds; every round runs each function
    ``n`` times back to back (n: about ``min_round_s`` worth of calls) and records their mean."""
    for f in fns.values():  # warm-up (also builds the extension on first use)
        f()
        f()
    n = {}
    for name, f in fns.items():
        t = time.perf_counter()
        f()
        n[name] = max(1, int(min_round_s / max(time.perf_counter() - t, 1e-6)))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            for _ in range(n[name]):
                f()
            samples[name].append((time.perf_counter() - t) / n[name])
    return ({name: statistics.median(s) for name, s in samples.items()}, {name: min(s) for name, s in samples.items()})


def run_case(T: int, dtype_name: str, mix_name: str, rounds: int, seed: int) -> dict:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    store, k, v = build_store(T, MIXES[mix_name], dtype, gen)
    q = torch.randn(1, H_KV * N_REP, 1, D, generator=gen).to(dtype)
    scaling = D**-0.5
    k_rep, v_rep = k.repeat_interleave(N_REP, 1), v.repeat_interleave(N_REP, 1)
    q_rows = q.view(1, H_KV, N_REP, D)
    full, segs = store.full, [s.kernel_args() for s in store.segments]
    start = full.start_tensor()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns = {
        "sdpa": lambda: sdpa(q, k_rep, v_rep, scale=scaling),
        "sdpa_rows": lambda: sdpa(q_rows, k, v, scale=scaling),
        "torch": lambda: split_precision_attention_torch(q, store, scaling),
        "fused": lambda: cpu_ops.split_precision_attention(q, full.keys, full.values, start, segs, scaling),
    }
    err = (fns["fused"]().float() - fns["torch"]().float()).abs().max().item()
    med, best = time_interleaved(fns, rounds)
    ms = {name: 1e3 * s for name, s in med.items()}
    ms_min = {name: 1e3 * s for name, s in best.items()}
    base = min(ms["sdpa"], ms["sdpa_rows"])
    cache_bytes = store.nbytes()
    return {
        "tokens": T,
        "dtype": dtype_name,
        "mix": mix_name,
        "ms": ms,
        "ms_min": ms_min,
        "fused_vs_sdpa": ms["fused"] / base,
        "torch_vs_sdpa": ms["torch"] / base,
        "fused_vs_sdpa_min": ms_min["fused"] / min(ms_min["sdpa"], ms_min["sdpa_rows"]),
        "fused_speedup_vs_torch": ms["torch"] / ms["fused"],
        "max_abs_err_vs_torch": err,
        "cache_bytes": cache_bytes,
        "full_precision_bytes": 2 * k.numel() * k.element_size(),
        "packed_tokens": sum(s.num_tokens for s in store.segments),
        "full_tokens": full.length,
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384], help="cache tokens T")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds per case (default 15)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the settings and results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ops.available():
        raise SystemExit(f"cpu_ops is unavailable: {cpu_ops.unavailable_reason()}")
    from cpu_ops._build import extension

    target = extension().kernel_target()
    print(
        f"threads={torch.get_num_threads()} torch={torch.__version__} kernel={target} cpu={platform.processor()}"
        f" | B=1 H_kv={H_KV} n_rep={N_REP} D={D} C={C} G={G}, times in ms (median)"
    )
    head = (
        f"{'T':>6} {'dtype':>8} {'mix':>5} | {'sdpa':>7} {'sdpa_rows':>9} {'torch':>7} {'fused':>7} | "
        f"{'fused/sdpa':>10} {'(min)':>6} {'torch/sdpa':>10} {'torch/fused':>11} | {'err':>8} {'MB':>6} "
        f"{'MB fp':>6}"
    )
    print(head)
    print("-" * len(head))
    results = []
    for dtype_name in args.dtypes:
        for mix_name in args.mixes:
            for T in args.lengths:
                r = run_case(T, dtype_name, mix_name, args.rounds, args.seed)
                results.append(r)
                ms = r["ms"]
                print(
                    f"{T:>6} {dtype_name:>8} {mix_name:>5} | {ms['sdpa']:7.3f} {ms['sdpa_rows']:9.3f} "
                    f"{ms['torch']:7.3f} {ms['fused']:7.3f} | {r['fused_vs_sdpa']:10.2f} {r['fused_vs_sdpa_min']:6.2f} "
                    f"{r['torch_vs_sdpa']:10.2f} "
                    f"{r['fused_speedup_vs_torch']:11.1f} | {r['max_abs_err_vs_torch']:8.1e} "
                    f"{r['cache_bytes'] / 1e6:6.2f} {r['full_precision_bytes'] / 1e6:6.2f}",
                    flush=True,
                )
    print(
        "fused/sdpa, torch/sdpa: median time relative to the faster SDPA row (< 1: faster than SDPA); (min): the "
        "same for the fastest round; MB: bytes of the store; MB fp: K/V at the query dtype"
    )
    if args.out:
        settings = {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "kernel_target": target,
            "cpu": platform.processor(),
            "B": 1,
            "H_kv": H_KV,
            "n_rep": N_REP,
            "D": D,
            "chunk_size": C,
            "group_size": G,
            "full_tail_tokens": TAIL,
            "rounds": args.rounds,
            "seed": args.seed,
        }
        with open(args.out, "w") as fh:
            json.dump({"settings": settings, "results": results}, fh, indent=1)
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
