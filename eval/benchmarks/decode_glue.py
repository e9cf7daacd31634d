"""The per-layer work of one decode step outside the fused CPU attention kernel, on a real model and preset, unprofiled.

Builds a preset's cache on a real prompt (essays + the benchmark question, ``--context`` tokens; prefill and one
greedy decode step with ``model.generate``, so every layer is in its decode state on the split path), then times,
per Cocktail layer and new token (random ``(1, H_kv, 1, D)`` key / value, ``(1, H_q, 1, D)`` query):

* ``rotation``: ``store.rotation.rotate_pair`` (the new key / value rotated before the append);
* ``append``: ``store.append`` (rotation + 8-bit fused append) then the truncate that undoes it;
* ``cache update``: ``CocktailCache.update`` (what the model's attention module calls) + the same crop;
* ``attention fn``: ``cocktail_attention_forward`` (the registered attention function) with the C++ kernel call
  replaced by a precomputed output, so the figure is the Python glue around the kernel (dispatch, launcher checks,
  argument lists, output transpose); ``launcher``: the public, fully checked ``cpu_ops.split_precision_attention``
  alone on the store's arguments, kernel replaced;
* ``kernel``: the C++ kernel alone on the launcher's arguments (for scale);
* ``model step``: one whole greedy decode forward of the model (then the crop), for scale.

Every figure is the min and the median over ``--repeat`` blocks of ``--number`` calls (µs of this thread's CPU time
per call, ``time.thread_time``), cycled over all layers; short blocks, so that the min finds quiet moments of a shared
machine. Run with ``--threads 1``; A/B two checkouts by running this file from each (``PYTHONPATH=.``), in
alternation. ``--preset recommended`` measures ``CocktailConfig.recommended()`` instead of a preset folder.

    PYTHONPATH=. python -m eval.benchmarks.decode_glue --context 1500 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable

import torch

import cpu_ops.attention as cpu_attention
from hf_cocktail import CocktailCache, CocktailConfig, offline_encoder_path
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.integration.attention import cocktail_attention_forward
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.offline_models import load_offline_model
from hf_cocktail.storage import params8

from ..essays import essay_prefix
from .rounds import QUESTION, make_prompt


def block_times(fn: Callable[[], object], number: int, repeat: int) -> tuple[float, float]:
    """``(min, median)`` µs per call of ``fn`` over ``repeat`` blocks of ``number`` calls (one warm-up block), in
    this thread's CPU time (``time.thread_time``: what the other core's jobs do not inflate; run with one thread)."""
    for _ in range(number):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        for _ in range(number):
            fn()
        times.append((time.thread_time() - t0) / number * 1e6)
    return min(times), statistics.median(times)


@contextlib.contextmanager
def kernel_replaced(outputs: dict[int, torch.Tensor]):
    """``cpu_ops``' C++ attention call returns ``outputs[H_q]`` instead of running (the launcher's checks and
    argument building still run)."""
    real = cpu_attention.extension

    class Stub:
        @staticmethod
        def split_attention(query, *args):
            return outputs[query.shape[1]]

    cpu_attention.extension = lambda: Stub  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_attention.extension = real  # type: ignore[assignment]


@contextlib.contextmanager
def captured_kernel_args(calls: list):
    """Record the arguments of every C++ attention call (to time the kernel alone)."""
    real = cpu_attention.extension

    class Recorder:
        @staticmethod
        def split_attention(*args):
            calls.append(args)
            return real().split_attention(*args)

    cpu_attention.extension = lambda: Recorder  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_attention.extension = real  # type: ignore[assignment]


def prefilled(model, tok, preset: str, context_tokens: int) -> tuple[CocktailCache, torch.Tensor]:
    """The preset's cache after the prefill and one decode step of the benchmark prompt; the last token's id."""
    if preset == "recommended":
        cfg = CocktailConfig.recommended(encoder=offline_encoder_path())
    else:
        cfg = CocktailConfig.from_pretrained(preset, encoder=offline_encoder_path())
    cache = CocktailCache(cfg, model_config=model.config)
    context = essay_prefix(tok, context_tokens)
    prompt, kw = make_prompt(tok, context)
    inputs = cache.prepare_inputs(tok, prompt, contexts=context, queries=QUESTION, **kw)
    with torch.no_grad():
        out = model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=2, do_sample=False)
    return cache, out[:, -1:]


def measure(model, cache: CocktailCache, last: torch.Tensor, number: int, repeat: int) -> dict[str, tuple]:
    layers = [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, CocktailLayer)]
    attn = model.model.layers[0].self_attn
    H_q, D = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    H_kv = model.config.num_key_value_heads
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, H_kv, 1, D, generator=g), torch.randn(1, H_kv, 1, D, generator=g)
    q = torch.randn(1, H_q, 1, D, generator=g)
    scaling = D**-0.5
    n = len(layers)
    state = {"i": 0}

    def next_layer():
        state["i"] = (state["i"] + 1) % n
        return layers[state["i"]]

    def rotation():
        _, layer = next_layer()
        layer.store.rotation.rotate_pair(k, v)

    def append():
        _, layer = next_layer()
        layer.store.append(k, v)
        layer.store.full.truncate(1)

    def update():
        i, layer = next_layer()
        cache.update(k, v, i)
        layer.crop(-1)

    tagged = {}
    for i, _ in layers:  # the keys the attention function receives (tagged with their layer)
        keys, values = cache.update(k, v, i)
        tagged[i] = (keys, values)
    calls: list = []
    with captured_kernel_args(calls):
        for i, _ in layers:
            cocktail_attention_forward(attn, q, *tagged[i], None, scaling=scaling)
    for _, layer in layers:
        layer.crop(-1)
    kernel_args = calls[-1]
    outputs = {H_q: cpu_attention.extension().split_attention(*kernel_args)}

    def attention_fn():
        i, _ = next_layer()
        cocktail_attention_forward(attn, q, *tagged[i], None, scaling=scaling)

    def launcher():
        _, layer = next_layer()
        store, full = layer.store, layer.store.full
        scales = getattr(full, "scales", None)
        cpu_attention.split_precision_attention(
            q,
            *full.split_path_tensors(),
            full.start_tensor(),
            [s.coded_kernel_args() for s in store.segments],
            scaling,
            full_scales=None if scales is None else (scales.keys, scales.values),
            rotation=(store.rotation.keys, store.rotation.values),
            scale_table=params8.scale_table("cpu"),
        )

    def kernel():
        cpu_attention.extension().split_attention(*kernel_args)

    def model_step():
        with torch.no_grad():
            model(input_ids=last, **cache_kwargs(model, cache), use_cache=True)
        cache.crop(-1)

    out = {
        "rotation": block_times(rotation, number, repeat),
        "append": block_times(append, number, repeat),
        "cache update": block_times(update, number, repeat),
    }
    with kernel_replaced(outputs):
        out["attention fn"] = block_times(attention_fn, number, repeat)
        out["launcher"] = block_times(launcher, number, repeat)
    out["kernel"] = block_times(kernel, max(1, number // 10), repeat)
    out["model step"] = block_times(model_step, 1, max(3, repeat // 4))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.benchmarks.decode_glue", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--preset", default="model_cards/smollm2-135m-instruct", help="a preset folder, or `recommended` (the config)"
    )
    p.add_argument("--context", type=int, default=1500, help="context tokens (essays)")
    p.add_argument("--number", type=int, default=30, help="calls per timed block")
    p.add_argument("--repeat", type=int, default=100, help="timed blocks")
    p.add_argument("--rounds", type=int, default=3, help="measure this many times (same cache), print each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--label", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_offline_model(args.model)
    cache, last = prefilled(model, tok, args.preset, args.context)
    for r in range(args.rounds):
        res = measure(model, cache, last, args.number, args.repeat)
        cells = ", ".join(f"{name} {lo:.1f}/{med:.1f}" for name, (lo, med) in res.items())
        print(f"{args.label} round {r}: us per layer call (min/median): {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
