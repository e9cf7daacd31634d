"""What packing generated tokens costs a decode step, per layer (issue 44): one pack (a chunk of appended tokens
quantized, the segment copied with it inserted, the residual window moved down, ``storage.generated.pack_appended``)
against one decode step's attention over the same store, and the first attention after a pack (the kernel's
arguments prepared again for the new segment) against a steady one. Synthetic keys/values with a model's shapes
(default SmolLM2-135M: 3 KV heads of 64, 9 query heads) under ``CocktailConfig.recommended()``'s format (whatever it
is at the commit run: its docstring), ``--context`` prompt tokens in the packed segment; the backend's own
quantizers and attention (``auto``: the fused CPU kernel). Timings alternate (attention, pack, attention after pack)
``--reps`` times; medians. The pack happens once per ``chunk_size`` decode steps, so its amortised cost per step is
``pack / chunk_size``.

    python -m eval.benchmarks.pack_cost --context 8000 --reps 30 \
        --out eval/results/decode_latency/generated_pack_cost.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_cocktail import CocktailConfig
from hf_cocktail.decode.dispatch import attach_fused_writer, quantizers, split_precision_attention
from hf_cocktail.planning.key_rotation import ROTATED
from hf_cocktail.storage.generated import AppendedPacking, pack_appended
from hf_cocktail.storage.key_centering import context_key_mean
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from ..cli import run_cli
from ..run_info import command_line, git_commit

MODULE = "eval.benchmarks.pack_cost"


def make_store(context: int, H_kv: int, D: int, cfg: CocktailConfig, dtype: torch.dtype) -> LayerStore:
    """A layer's store after a prefill of ``context`` tokens: 4 sink tokens and the last 32 at full precision, the
    rest packed at ``cfg``'s widths, scales and zeros, centred on the packed keys' mean where ``cfg`` centres;
    appended tokens packed as the layer packs them."""
    torch.manual_seed(0)
    k, v = torch.randn(1, H_kv, context, D, dtype=dtype), torch.randn(1, H_kv, context, D, dtype=dtype)
    full = torch.cat([torch.arange(4), torch.arange(context - 32, context)])
    positions = [{"full": full, 4: torch.arange(4, context - 32), 2: torch.zeros(0, dtype=torch.long)}]
    qk, qv = quantizers(cfg.backend, k.device)
    kind = ROTATED if cfg.rotation == "auto" else cfg.rotation  # "auto" with no prefill queries: keys rotated too
    rotation = Rotation.make(kind, H_kv, D, cfg.rotation_seed, k.device)
    key_mean = context_key_mean(k, [(4, context - 32)], torch.float16) if cfg.center_keys else None
    store = LayerStore.build(
        k, v, positions, cfg.chunk_size, cfg.group_size, torch.float16, qk, qv, rotation, cfg.value_bits,
        scale_bits=cfg.scale_bits, full_part_bits=cfg.full_part_bits, key_mean=key_mean,
    )  # fmt: skip
    store.packing = AppendedPacking(0, torch.float16, cfg.scale_bits, qk, qv)
    attach_fused_writer(store, cfg.backend)
    return store


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(args) -> dict:
    cfg = CocktailConfig.recommended()
    dtype = getattr(torch, args.dtype)
    store = make_store(args.context, args.kv_heads, args.head_dim, cfg, dtype)
    C, keep = cfg.chunk_size, cfg.residual_tokens
    q = torch.randn(1, args.q_heads, 1, args.head_dim, dtype=dtype)
    new = lambda n: torch.randn(1, args.kv_heads, n, args.head_dim, dtype=dtype)  # noqa: E731
    attend = lambda: split_precision_attention(q, store, args.head_dim**-0.5, cfg.backend)  # noqa: E731
    store.append(new(keep + C - 1), new(keep + C - 1))
    attend()  # the kernel built and its arguments prepared before timing
    steady, packs, after = [], [], []
    for _ in range(args.reps):
        store.append(new(1), new(1))  # the residual window reaches keep + C: the next pack takes one chunk
        steady.append(_ms(attend))
        n = []
        packs.append(_ms(lambda: n.append(pack_appended(store, keep))))
        assert n == [C], n
        after.append(_ms(attend))
        store.append(new(C - 1), new(C - 1))
    med = statistics.median
    return {
        "context": args.context,
        "packed_tokens": store.segments[0].num_tokens,
        "attention_ms": med(steady),
        "pack_ms": med(packs),
        "attention_after_pack_ms": med(after),
        "amortised_pack_per_step": med(packs) / C / med(steady),
        "prepare_per_step": (med(after) - med(steady)) / C / med(steady),
    }


def markdown(r: dict, header: str) -> str:
    return (
        f"{header}\n\n"
        "| context | packed tokens at the end | attention ms (steady) | pack ms | attention ms (first after a pack) | "
        "pack / 32 steps, vs attention | re-prepare / 32 steps, vs attention |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {r['context']} | {r['packed_tokens']} | {r['attention_ms']:.3f} | {r['pack_ms']:.3f} | "
        f"{r['attention_after_pack_ms']:.3f} | {r['amortised_pack_per_step']:.3f} | {r['prepare_per_step']:.3f} |\n"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the markdown table here too")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = measure(args)
    header = (
        f"Generated-token packing against decode attention, one layer ({args.kv_heads} KV heads of {args.head_dim}, "
        f"{args.q_heads} query heads, {args.dtype}, recommended()), {args.reps} alternations, medians, "
        f"{args.threads} thread(s): `{command_line(MODULE)}` at {git_commit(exclude=args.out)}."
    )
    text = markdown(r, header)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    run_cli(main)
