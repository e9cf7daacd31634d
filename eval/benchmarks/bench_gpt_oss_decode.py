"""Decode speed of a gpt-oss-shaped model on the fused CPU path: attention sinks in the split-precision kernel, against
the model's own ``DynamicCache`` (eager attention: transformers' gpt-oss has no SDPA path), in one run.

The model has gpt-oss-20b's attention shape (hidden 2880, 64 query heads, 8 key/value heads of dim 64, sinks,
sliding window 128 on every other layer) with random weights; its MoE is cut to ``--experts`` experts, all active, and
its vocabulary to 32000, so that it fits a small CPU (the work per token does not depend on the weights' values).
The ``--context`` tokens of each layer are random keys and values written into a ``DynamicCache``; the Cocktail cache
is branched from it (``load_prefill``, ``CocktailConfig.recommended()``: 4-bit keys, 3-bit values, rotated). The
model runs ``attn_implementation="eager"`` (transformers' own gpt-oss attention) with the DynamicCache and
``"cocktail"`` with the Cocktail cache. Then
``--rounds`` alternating rounds of ``--steps`` greedy decode steps per cache (``model.forward`` of one token),
forward order on even rounds, reverse on odd ones; reported: median ms per step over rounds and the median of the
per-round ratio Cocktail / DynamicCache. ``--attention-only`` adds one full-attention layer's decode attention alone:
the fused kernel with sinks over the store vs transformers' gpt-oss eager attention over the 16-bit keys and values.

    python -m eval.benchmarks.bench_gpt_oss_decode --context 8192 --layers 2 --rounds 5 --steps 8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GptOssConfig, GptOssForCausalLM

import hf_cocktail  # noqa: F401  (registers attn_implementation="cocktail")
from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.decode.dispatch import split_precision_attention
from hf_cocktail.integration.compat import cache_kwargs

from .timing import mean_ms

GPT_OSS_20B_ATTENTION = dict(
    hidden_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    sliding_window=128,
    intermediate_size=2880,
    vocab_size=32000,
)


def gpt_oss_model(layers: int, experts: int, dtype: torch.dtype) -> GptOssForCausalLM:
    types = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
    config = GptOssConfig(
        **GPT_OSS_20B_ATTENTION,
        num_hidden_layers=layers,
        layer_types=types,
        num_local_experts=experts,
        num_experts_per_tok=experts,
        max_position_embeddings=131072,
    )
    torch.manual_seed(0)
    return GptOssForCausalLM(config).to(dtype).eval()


def filled_caches(model, context: int, dtype: torch.dtype) -> tuple[DynamicCache, CocktailCache]:
    """A ``DynamicCache`` holding ``context`` random tokens per layer, and a recommended() Cocktail cache branched
    from it."""
    cfg = model.config
    dyn = DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(1)
    for i in range(cfg.num_hidden_layers):
        shape = (1, cfg.num_key_value_heads, context, cfg.head_dim)
        dyn.update(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype), i)
    cocktail = CocktailCache(CocktailConfig.recommended(), model_config=cfg)
    cocktail.load_prefill(dyn, split_attention=True)
    fresh = DynamicCache(config=cfg)  # load_prefill copied the sliding layers: the baseline keeps its own
    for i, layer in enumerate(dyn.layers):
        fresh.update(layer.keys, layer.values, i)
    return fresh, cocktail


@torch.no_grad()
def decode_steps(model, cache, steps: int) -> float:
    """ms per greedy decode step (one token) continuing ``cache`` (eager attention with a DynamicCache, the Cocktail
    attention with a Cocktail cache)."""
    model.config._attn_implementation = "cocktail" if isinstance(cache, CocktailCache) else "eager"
    token = torch.zeros(1, 1, dtype=torch.long)
    t = time.perf_counter()
    for _ in range(steps):
        token = model(input_ids=token, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t) / steps * 1e3


def attention_only(model, dyn: DynamicCache, cocktail: CocktailCache, steps: int) -> tuple[float, float]:
    """ms per decode attention of the first full-attention layer: transformers' gpt-oss eager attention (sinks) over
    the DynamicCache's keys and values, and the fused split-precision kernel with sinks over the Cocktail store."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    idx = next(i for i, layer in enumerate(cocktail.layers) if isinstance(layer, CocktailLayer))
    module = model.model.layers[idx].self_attn
    store = cocktail.layers[idx].store
    k, v = dyn.layers[idx].keys, dyn.layers[idx].values
    q = torch.randn(1, model.config.num_attention_heads, 1, model.config.head_dim).to(k.dtype)
    scaling = module.scaling

    def eager():
        eager_attention_forward(module, q, k, v, None, scaling)

    def fused():
        split_precision_attention(q, store, scaling, "auto", sinks=module.sinks)

    return mean_ms(eager, steps), mean_ms(fused, steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2, help="layers, alternating sliding / full (gpt-oss-20b: 24)")
    p.add_argument("--experts", type=int, default=4, help="MoE experts, all active (gpt-oss-20b: 4 of 32 active)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--attention-only", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = gpt_oss_model(args.layers, args.experts, dtype)
    dyn, cocktail = filled_caches(model, args.context, dtype)
    rounds: dict[str, list[float]] = {"DynamicCache": [], "Cocktail recommended()": []}
    caches = {"DynamicCache": dyn, "Cocktail recommended()": cocktail}
    for r in tqdm(range(args.rounds), desc="rounds"):
        order = list(caches) if r % 2 == 0 else list(reversed(caches))
        for name in order:
            rounds[name].append(decode_steps(model, caches[name], args.steps))
    base, ours = rounds["DynamicCache"], rounds["Cocktail recommended()"]
    ratios = [o / b for o, b in zip(ours, base)]
    rep = cocktail.memory_report()
    print(
        f"gpt-oss-shaped decode, context {args.context}, {args.layers} layers, {args.dtype}, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps"
    )
    print("| cache | ms/step (median of rounds) | ratio to DynamicCache (median, range) | KV bytes / FP16 |")
    print("|---|---|---|---|")
    print(f"| DynamicCache | {statistics.median(base):.1f} | 1.00 | 1.00 |")
    print(
        f"| Cocktail recommended() | {statistics.median(ours):.1f} | {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}) | {rep['ratio_to_fp16']:.3f} |"
    )
    if args.attention_only:
        eager_ms, fused_ms = attention_only(model, dyn, cocktail, args.steps * args.rounds)
        print(
            f"one full layer's decode attention with sinks: transformers eager over 16-bit KV {eager_ms:.2f} ms, fused "
            f"kernel {fused_ms:.2f} ms (ratio {fused_ms / eager_ms:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
