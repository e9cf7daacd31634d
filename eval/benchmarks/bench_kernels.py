"""Decode-attention microbenchmark: the fused Triton split-precision kernel vs FP16 SDPA and vs a
QuantizedCache-style decode (dequantize the whole cache, then SDPA), one layer, one new token.

GPU setting (default): Llama-3-8B-like heads H_q=32, H_kv=8, D=128, fp16; caches of T = 4K, 32K, 128K tokens;
batch B = 1 and 8. The cache holds T tokens: a full-precision tail of 32 tokens (template, question, the current
token) and T - 32 context tokens cut into chunks of C=32 tokens. Cache mixes (fractions of the context chunks):

* ``paper``: 10% FP16 / 30% INT4 / 60% INT2, chunks assigned at random (a typical Cocktail outcome with the paper's
  alpha=0.6, beta=0.1 thresholds);
* ``int4`` / ``int2``: every context chunk at that precision;
* ``paper_s8_f8``: the paper mix stored as the recommended settings store it: 8-bit scales and zeros
  (``scale_bits=8``) and the full-precision tail as 8-bit codes (``full_part_bits=8``), read as stored by the kernel.

Keys are quantized per channel within a chunk, values per token in groups of G=32 channels, fp16 scales/zeros.

Methods (one row each in the table and the CSV):

* ``fp16_sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over an FP16 cache of the same T tokens; the
  n_rep query heads of a kv head are folded into query rows (exact for one decode token), so each K/V byte is read
  once, as with ``enable_gqa``.
* ``qcache_int{4,2}``: transformers' ``QuantizedCache`` decode step for one layer: the layer's ``_dequantize`` of the
  whole key and value cache (``HQQQuantizedLayer`` or ``QuantoQuantizedLayer``, their defaults: q_group_size=64),
  then ``fp16_sdpa``. If neither backend works, it is emulated with :mod:`hf_cocktail.storage.quant`'s PyTorch
  dequantizer and labelled ``torch-emulated``.
* ``cocktail``: ``triton_ops.split_precision_attention`` over the tensors of a
  :class:`~hf_cocktail.storage.store.LayerStore` (arguments prepared once, as the decode path does), one store per
  mix. Its output is checked against the fp32 PyTorch reference ``split_precision_attention_torch`` (``max_abs_err``).

Bandwidth = bytes of the method's stored cache (each read once per step) / time; for ``qcache`` the bytes are the
nominal packed codes plus fp16 scale/zero per group (its dequantized copy, written and read again, is not counted:
its GB/s is an effective rate). ``pct_peak`` is relative to the H200's 4.8 TB/s HBM bandwidth. Times are medians of
``triton.testing.do_bench`` (which flushes the L2 cache between runs).

Usage::

    python -m eval.benchmarks.bench_kernels --out bench_kernels.csv       # GPU (eval/gpu_check.sh runs it)
    python -m eval.benchmarks.bench_kernels --smoke --out /tmp/smoke.csv  # tiny sizes on CPU, TRITON_INTERPRET=1
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

import triton_ops  # noqa: E402
from hf_cocktail.decode import dispatch  # noqa: E402
from hf_cocktail.decode.split_attention import split_precision_attention_torch  # noqa: E402
from hf_cocktail.storage import quant  # noqa: E402
from hf_cocktail.storage.full_part import full_part_from_sequences  # noqa: E402
from hf_cocktail.storage.store import LayerStore, PackedSegment  # noqa: E402

from ..reporting import write_dict_csv  # noqa: E402
from .timing import mean_ms  # noqa: E402

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e
MIXES = {  # FP16 / INT4 / INT2 chunks
    "paper": (0.1, 0.3, 0.6),
    "int4": (0.0, 1.0, 0.0),
    "int2": (0.0, 0.0, 1.0),
    "paper_s8_f8": (0.1, 0.3, 0.6),
}
QCACHE_GROUP = 64  # transformers' QuantizedCache default q_group_size


def sdpa_decode(q, k, v, scaling):
    """``q (B, H_q, 1, D)``, ``k, v (B, H_kv, T, D)``: GQA decode as MHA with the n_rep query heads as rows."""
    B, H_q, _, D = q.shape
    H_kv = k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(q.view(B, H_kv, H_q // H_kv, D), k, v, scale=scaling)
    return o.view(B, H_q, 1, D)


def chunk_plan(n_chunks: int, mix, gen: torch.Generator) -> torch.Tensor:
    """Bits (16, 4 or 2) of each context chunk: the mix's counts, in random order."""
    n16, n4 = round(mix[0] * n_chunks), round(mix[1] * n_chunks)
    bits = torch.tensor([16] * n16 + [4] * n4 + [2] * (n_chunks - n16 - n4))
    return bits[torch.randperm(n_chunks, generator=gen)]


def build_store(k, v, mix, C, G, tail, gen, quantize_keys, quantize_values, formats8: bool = False) -> LayerStore:
    """A LayerStore of the FP16 cache ``k, v (B, H_kv, T, D)`` (last ``tail`` tokens full precision); ``formats8``:
    8-bit scales and zeros and an 8-bit full part."""
    B, _, T, _ = k.shape
    ctx = T - tail
    n_chunks = -(-ctx // C)
    tok_chunk = torch.arange(ctx) // C
    parts = {16: ([], []), 4: ([], []), 2: ([], [])}
    for b in range(B):
        bits = chunk_plan(n_chunks, mix, gen)[tok_chunk]
        for p, (ks, vs) in parts.items():
            idx = (bits == p).nonzero().flatten()
            if p == 16:
                idx = torch.cat([idx, torch.arange(ctx, T)])
            idx = idx.to(k.device)
            ks.append(k[b].index_select(1, idx))
            vs.append(v[b].index_select(1, idx))
    segs = [
        PackedSegment.from_sequences(
            *parts[bits], bits, C, G, torch.float16, quantize_keys, quantize_values, scale_bits=8 if formats8 else 16
        )
        for bits in (4, 2)
    ]
    full = full_part_from_sequences(*parts[16], 8 if formats8 else 16, torch.float16)
    return LayerStore(full, segs)


class QCacheDecode:
    """One layer of transformers' QuantizedCache after prefill: each decode step dequantizes the whole cache."""

    def __init__(self, k, v, bits, backend):
        self.bits, self.label = bits, None
        errors = []
        for name in [backend] if backend != "auto" else ["hqq", "quanto"]:
            if name == "torch":
                break
            try:
                from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

                cls = HQQQuantizedLayer if name == "hqq" else QuantoQuantizedLayer
                self.layer = cls(nbits=bits, q_group_size=QCACHE_GROUP)
                self.layer.update(k, v)  # the prefill call quantizes everything
                self.dequant = lambda: (
                    self.layer._dequantize(self.layer._quantized_keys),
                    self.layer._dequantize(self.layer._quantized_values),
                )
                self.dequant()
                self.label = f"{name} dequant + SDPA"
                return
            except Exception as e:  # a missing package or a failing extension build: try the next one
                errors.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
        # emulation: the same per-chunk / per-group format, dequantized by the PyTorch reference of hf_cocktail
        B, H, T, D = k.shape
        packed = [
            (quant.quantize_pack_keys(k[b], bits, QCACHE_GROUP), quant.quantize_pack_values(v[b], bits, 32))
            for b in range(B)
        ]

        def dequant():
            ks = [quant.dequantize_keys(*pk, bits, QCACHE_GROUP, torch.float16) for pk, _ in packed]
            vs = [quant.dequantize_values(*pv, bits, 32, torch.float16) for _, pv in packed]
            return torch.stack(ks), torch.stack(vs)

        self.dequant = dequant
        self.label = "torch-emulated dequant + SDPA" + (f" ({'; '.join(errors)})" if errors else "")

    def __call__(self, q, scaling):
        kd, vd = self.dequant()
        return sdpa_decode(q, kd, vd, scaling)


def qcache_nbytes(B, H_kv, T, D, bits) -> int:
    """Nominal storage: packed codes + fp16 scale and zero per group of QCACHE_GROUP, keys and values."""
    return 2 * B * H_kv * T * (D * bits // 8 + 2 * 2 * D // QCACHE_GROUP)


def timer(smoke: bool):
    if smoke:
        return lambda fn: mean_ms(fn, 2)
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def fused_attention(store: LayerStore):
    """``f(q, scaling)``: the fused kernel over ``store``, read as stored, as the decode path calls it."""
    return lambda q, scaling: dispatch._triton_attention(q, store, scaling, q.dtype)


@dataclass
class Shape:
    dev: str
    H_q: int
    H_kv: int
    D: int
    C: int
    G: int
    tail: int
    contexts: list[int]
    batches: list[int]
    dtype: torch.dtype = torch.float16


def shape_of(args) -> Shape:
    if args.smoke:
        return Shape("cpu", 8, 2, 64, 32, 32, 8, args.contexts or [256], args.batches or [1, 2])
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU (or --smoke for the CPU check of the script)")
    return Shape("cuda", 32, 8, 128, 32, 32, 32, args.contexts or [4096, 32768, 131072], args.batches or [1, 8])


def bench_case(sh: Shape, T: int, B: int, bench, gen: torch.Generator, qcache_backend: str) -> list[tuple]:
    """``(method, cache, ms, bytes, err)`` of every method at cache length ``T`` and batch ``B``."""
    scaling = sh.D**-0.5
    dgen = torch.Generator(device=sh.dev).manual_seed(T * 16 + B)
    k = torch.randn(B, sh.H_kv, T, sh.D, generator=dgen, device=sh.dev).to(sh.dtype)
    v = torch.randn(B, sh.H_kv, T, sh.D, generator=dgen, device=sh.dev).to(sh.dtype)
    q = torch.randn(B, sh.H_q, 1, sh.D, generator=dgen, device=sh.dev).to(sh.dtype)
    res = [
        (
            "fp16_sdpa",
            str(sh.dtype).replace("torch.", ""),
            bench(lambda: sdpa_decode(q, k, v, scaling)),
            2 * k.numel() * k.element_size(),
            None,
        )
    ]
    for bits in (4, 2):
        qc = QCacheDecode(k, v, bits, qcache_backend)
        res.append(
            (
                f"qcache_int{bits}",
                qc.label,
                bench(lambda: qc(q, scaling)),
                qcache_nbytes(B, sh.H_kv, T, sh.D, bits),
                None,
            )
        )
    for mix_name, mix in MIXES.items():
        store = build_store(
            k,
            v,
            mix,
            sh.C,
            sh.G,
            sh.tail,
            gen,
            triton_ops.quantize_pack_keys,
            triton_ops.quantize_pack_values,
            formats8=mix_name.endswith("_s8_f8"),
        )
        fused = fused_attention(store)
        err = (fused(q, scaling).float() - split_precision_attention_torch(q.float(), store, scaling)).abs().max()
        shares = " / ".join(f"{round(100 * f)}% {p}" for f, p in zip(mix, ("fp16", "int4", "int2")))
        res.append(
            (
                f"cocktail_{mix_name}",
                f"{shares} of chunks",
                bench(lambda: fused(q, scaling)),
                store.nbytes(),
                err.item(),
            )
        )
    return res


def table_rows(T: int, B: int, res: list[tuple], smoke: bool) -> list[dict]:
    t_ref = {m: ms for m, _, ms, _, _ in res}
    rows = []
    for method, cache, ms, nbytes, err in res:
        gbps = nbytes / (ms * 1e-3) / 1e9
        rows.append(
            dict(
                context_tokens=T,
                batch=B,
                method=method,
                cache=cache,
                time_us=round(ms * 1e3, 2),
                cache_bytes=nbytes,
                GBps=round(gbps, 1),
                pct_peak="" if smoke else round(100 * gbps * 1e9 / PEAK_BYTES_PER_S, 1),
                speedup_vs_fp16_sdpa=round(t_ref["fp16_sdpa"] / ms, 3),
                speedup_vs_qcache_int4=round(t_ref["qcache_int4"] / ms, 3),
                speedup_vs_qcache_int2=round(t_ref["qcache_int2"] / ms, 3),
                max_abs_err="" if err is None else f"{err:.2e}",
            )
        )
    return rows


def print_rows(T: int, B: int, rows: list[dict]) -> None:
    print(f"\nT={T} B={B}")
    print(
        f"{'method':18s} {'time_us':>10s} {'MB':>9s} {'GB/s':>8s} {'%peak':>6s} {'x fp16':>7s} "
        f"{'x qc4':>6s} {'x qc2':>6s} {'max_err':>8s}  cache"
    )
    for r in rows:
        print(
            f"{r['method']:18s} {r['time_us']:10.1f} {r['cache_bytes'] / 1e6:9.2f} {r['GBps']:8.1f} "
            f"{str(r['pct_peak']):>6s} {r['speedup_vs_fp16_sdpa']:7.2f} {r['speedup_vs_qcache_int4']:6.2f} "
            f"{r['speedup_vs_qcache_int2']:6.2f} {r['max_abs_err']:>8s}  {r['cache']}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.benchmarks.bench_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_kernels.csv", help="CSV file to write")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="cache lengths T (default 4K 32K 128K)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8)")
    ap.add_argument(
        "--qcache-backend",
        choices=["auto", "hqq", "quanto", "torch"],
        default="auto",
        help="QuantizedCache baseline backend (auto: hqq, else quanto, else torch emulation)",
    )
    args = ap.parse_args(argv)
    sh = shape_of(args)
    bench = timer(args.smoke)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(
        f"device={torch.cuda.get_device_name() if sh.dev == 'cuda' else 'cpu (TRITON_INTERPRET=1, smoke)'} "
        f"H_q={sh.H_q} H_kv={sh.H_kv} D={sh.D} C={sh.C} G={sh.G} dtype={sh.dtype}"
    )
    for T in sh.contexts:
        for B in sh.batches:
            case_rows = table_rows(T, B, bench_case(sh, T, B, bench, gen, args.qcache_backend), args.smoke)
            print_rows(T, B, case_rows)
            rows += case_rows
            write_dict_csv(args.out, rows)  # after every case: a run stopped by a timeout keeps what finished
            if sh.dev == "cuda":
                torch.cuda.empty_cache()
    print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
