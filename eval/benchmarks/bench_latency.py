"""Time per output token of each method vs a DynamicCache at several context lengths, measured in one run.

Per context one full-precision prefill shared by every method (``eval/benchmarks/rounds.py``), each method's cache
branched from it, then ``--rounds`` alternating rounds of ``--steps-per-round`` decode steps per method (a
``model.generate`` continuing the method's cache; forward order on even rounds, reverse on odd ones). Reported:
median ms/token over rounds and the median over rounds of the per-round ratio to ``fp16`` (``DynamicCache``), with
its range; ``setup s`` is the method's cache construction from the prefill (search + quantization for Cocktail).
Prefill speed: ``bench_prefill``; one ``generate`` per method with its peak memory: ``bench_memory``.

Methods: registry names, ``recommended`` (``CocktailConfig.recommended()``) and ``NAME:torch`` (a Cocktail method on
the PyTorch path; plain names use ``backend="auto"``, the fused CPU kernel on CPU).

    python -m eval.benchmarks.bench_latency --quick
    python -m eval.benchmarks.bench_latency --contexts 8000 --methods fp16,cocktail,recommended,int2,hqq4,quanto4 \
        --rounds 5 --steps-per-round 8 --threads 2 --out eval/results/decode_latency/smollm2_fp32_8k.json

``--unpacked-twins`` adds ``NAME_unpacked`` beside every Cocktail method: the same config with
``residual_tokens`` beyond any generation, so generated tokens stay in the full part as before they were packed
(issue 44); ``--warmup-steps`` past ``residual_tokens + chunk_size`` (160 by default) times the packed methods with
packing under way (one pack per ``chunk_size`` steps).
"""

from __future__ import annotations

import dataclasses

import torch

from ..cli import run_cli
from ..kv_bytes import cache_kv_bytes, fp16_kv_bytes
from ..methods.kinds import CocktailMethod
from ..models import load_model_and_tokenizer
from ..reporting import METHOD_COLUMNS, METHOD_RULE, method_cells
from .harness import parse_args, save, warm_model
from .rounds import alternating_rounds, branch_runner, cast_prefill, shared_prefill, summarize_rounds

MODULE = "eval.benchmarks.bench_latency"


def rounds_table(results: list[dict]) -> str:
    lines = [
        f"| context | {METHOD_COLUMNS} | dtype | decode ms/token (median) | min | ratio vs fp16 (median of rounds) | "
        "ratio range | setup s | kv_ratio |",
        f"|---|{METHOD_RULE}|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['context_tokens']} | {method_cells(r['method'])} | {r['dtype']} | {r['decode_ms_per_token']:.1f} | "
            f"{r['decode_ms_per_token_min']:.1f} | {r['decode_ratio']:.2f} | "
            f"{r['decode_ratio_min']:.2f}-{r['decode_ratio_max']:.2f} | {r['setup_s']:.2f} | "
            f"{r['kv_ratio']:.3f} |"
        )
    return "\n".join(lines)


def run_rounds(args) -> tuple[list[dict], object, object]:
    """The measurement at every context (see the module docstring)."""
    model, tok = warm_model(args, args.device_map)
    prefill_model = model
    if args.prefill_dtype and args.prefill_dtype != args.dtype:
        prefill_model, _ = load_model_and_tokenizer(args.model, args.prefill_dtype, "cocktail", args.device_map)
    results = []
    for ctx in args.context_list:
        shared = shared_prefill(prefill_model, tok, ctx, args.essay_dir, args.method_list)
        if prefill_model is not model:
            shared = cast_prefill(shared, getattr(torch, args.dtype))
        print(
            f"context {ctx}: prompt {shared.prompt_tokens} tokens, shared prefill {shared.prefill_s:.1f} s", flush=True
        )
        runners = [branch_runner(m, model, tok, shared) for m in args.method_list]
        prompt_tokens, shared_prefill_s = shared.prompt_tokens, shared.prefill_s
        del shared
        steps, pad = args.steps_per_round, tok.eos_token_id
        alternating_rounds(runners, model, args.rounds, steps, pad, args.warmup_steps, f"rounds {ctx}")
        for r, row in zip(runners, summarize_rounds(runners, args.steps_per_round)):
            seq = int(r.cache.get_seq_length())
            kv = cache_kv_bytes(r.cache)
            row.update(
                context_tokens=prompt_tokens,
                requested_context=ctx,
                dtype=args.dtype,
                cache_tokens=seq,
                prefill_dtype=args.prefill_dtype or args.dtype,
                shared_prefill_s=shared_prefill_s,
                kv_bytes=kv,
                fp16_kv_bytes=fp16_kv_bytes(model.config, seq),
                kv_ratio=kv / fp16_kv_bytes(model.config, seq),
            )
            results.append(row)
        print(rounds_table(results[-len(runners) :]), flush=True)
        del runners
    return results, model, tok


NEVER_PACKED = 10**9  # residual_tokens of the unpacked twins: beyond any generation


def unpacked_twins(methods: list) -> list:
    """``methods`` with ``NAME_unpacked`` after every Cocktail method (``residual_tokens`` = :data:`NEVER_PACKED`)."""
    out = []
    for m in methods:
        out.append(m)
        if isinstance(m, CocktailMethod):
            overrides = {**m.overrides, "residual_tokens": NEVER_PACKED}
            out.append(
                dataclasses.replace(
                    m,
                    name=f"{m.name}_unpacked",
                    description=f"{m.description} [never packs generated tokens]",
                    overrides=overrides,
                )
            )
    return out


def main(argv=None) -> int:
    args = parse_args(argv, MODULE, __doc__, rounds=True)
    if args.unpacked_twins:
        args.method_list = unpacked_twins(args.method_list)
    results, _, _ = run_rounds(args)
    table = rounds_table(results)
    print(table)
    save(args, MODULE, results, table, "Decode latency vs DynamicCache (alternating rounds from one shared prefill)")
    return 0


if __name__ == "__main__":
    run_cli(main)
