"""KV-byte accounting: what a cache would take in an FP16 deployment, and the FP16 ``DynamicCache`` baseline.

The model runs in float32 on CPU, so every floating-point tensor of a cache (full-precision part, residual windows,
scales and zeros) is counted at 2 bytes per element, as in an FP16 deployment; packed integer codes count their real
size. ``deployed=False`` gives the bytes really held here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache


def _text_config(model_config):
    return model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config


def layer_token_counts(model_config, num_tokens: int) -> list[int]:
    """Tokens the model's own ``DynamicCache(config=model_config)`` holds per layer after ``num_tokens`` tokens:
    every token in a full-attention layer, at most ``sliding_window - 1`` in a sliding-window layer (what
    transformers' ``DynamicSlidingWindowLayer`` keeps). A config without layer kinds: every layer full."""
    cfg = _text_config(model_config)
    try:
        layers = DynamicCache(config=cfg).layers
    except (TypeError, ValueError, AttributeError):
        layers = []
    if len(layers) != cfg.num_hidden_layers:
        return [num_tokens] * cfg.num_hidden_layers
    return [
        min(num_tokens, layer.sliding_window - 1) if getattr(layer, "is_sliding", False) else num_tokens
        for layer in layers
    ]


def full_attention_layers(model_config) -> list[int]:
    """Indices of the full-attention layers (those a CocktailCache quantizes; every layer when the config has no
    layer kinds)."""
    cfg = _text_config(model_config)
    huge = 1 << 30
    return [i for i, n in enumerate(layer_token_counts(cfg, huge)) if n == huge]


def kv_geometry(model_config) -> tuple[int, int]:
    """``(H_kv, D)``: the key/value heads and the head dim of the model's (text) attention."""
    cfg = _text_config(model_config)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _per_token_layer_bytes(model_config, batch: int = 1) -> int:
    """FP16 bytes of one token's key and value in one layer."""
    heads, head_dim = kv_geometry(model_config)
    return int(2 * batch * heads * head_dim * 2)


def fp16_kv_bytes(model_config, num_tokens: int, batch: int = 1) -> int:
    """Bytes of the model's own FP16 ``DynamicCache`` holding ``num_tokens`` tokens (2 bytes per key/value element;
    sliding-window layers hold their window, see :func:`layer_token_counts`)."""
    return _per_token_layer_bytes(model_config, batch) * sum(layer_token_counts(model_config, num_tokens))


def fp16_global_kv_bytes(model_config, num_tokens: int, batch: int = 1) -> int:
    """FP16 bytes of the full-attention layers alone holding ``num_tokens`` tokens."""
    return _per_token_layer_bytes(model_config, batch) * num_tokens * len(full_attention_layers(model_config))


def deployed_tensor_bytes(t, deployed: bool = True) -> int:
    """Bytes of a tensor in an FP16 deployment: floating-point tensors count 2 bytes per element whatever their dtype
    here, integer/packed tensors their real size. ``deployed=False``: the bytes really held here."""
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    inner = _quanto_inner_tensors(t)
    if inner is not None:
        return sum(deployed_tensor_bytes(x, deployed) for x in inner)
    if t.is_floating_point() and deployed:
        return t.numel() * 2
    return t.numel() * t.element_size()


def _quanto_inner_tensors(t) -> list | None:
    """optimum-quanto QTensors are tensor subclasses; their storage is in inner tensors (codes, scale, shift)."""
    names = getattr(t, "__tensor_flatten__", None)
    if names is None or type(t).__module__.split(".")[0] not in ("optimum",):
        return None
    inner_names, _ = t.__tensor_flatten__()
    out = []
    for n in inner_names:
        x = getattr(t, n)
        sub = _quanto_inner_tensors(x)
        out.extend(sub if sub is not None else [x])
    return out


def _walk_tensors(obj, seen: set) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk_tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_tensors(v, seen)


def cocktail_fp16_deployed_bytes(cache: CocktailCache) -> int:
    """A CocktailCache's bytes in an FP16 deployment, from its public ``memory_report``: packed codes, scales/zeros
    and the full part at 2 bytes per element (an 8-bit full part, ``full_part_bits=8``: its codes and scales as
    held) (``ratio_to_fp16`` x ``fp16_equivalent_bytes``; the evaluation runs one sequence with FP16 scales, where
    this is exact)."""
    rep = cache.memory_report()
    if not rep["fp16_equivalent_bytes"]:
        return 0
    return round(rep["ratio_to_fp16"] * rep["fp16_equivalent_bytes"])


def cache_kv_bytes(cache, deployed: bool = True) -> int:
    """Bytes of every key/value tensor a cache holds: in an FP16 deployment (``deployed=True``, see
    :func:`deployed_tensor_bytes`) or as really held here.

    Knows ``DynamicCache``, ``QuantizedCache`` (quanto, hqq), ``CocktailCache`` and any cache with a
    ``kv_nbytes(deployed)`` method (the KIVI-like cache of ``eval.methods.kivi``)."""
    if isinstance(cache, CocktailCache):
        return cocktail_fp16_deployed_bytes(cache) if deployed else cache.nbytes()
    if hasattr(cache, "kv_nbytes"):
        return cache.kv_nbytes(deployed)
    return _layers_bytes(cache.layers, deployed)


def _layers_bytes(layers, deployed: bool = True) -> int:
    """Bytes of the key/value tensors (plain or quantized: quanto, hqq) of transformers cache layers."""
    seen: set = set()
    attrs = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(
        deployed_tensor_bytes(t, deployed)
        for layer in layers
        for attr in attrs
        for t in _walk_tensors(getattr(layer, attr, None), seen)
    )


def global_kv_ratio(cache, model_config, num_tokens: int) -> float | None:
    """The full-attention layers' KV bytes (FP16 deployment) / the same layers in FP16 holding ``num_tokens``
    tokens: ``memory_report()["quantized_layers_ratio_to_fp16"]`` for a CocktailCache, the bytes of those layers
    for caches with per-layer tensors; None for a cache that cannot say (the KIVI-like cache)."""
    if isinstance(cache, CocktailCache):
        return cache.memory_report()["quantized_layers_ratio_to_fp16"]
    if hasattr(cache, "kv_nbytes") or not hasattr(cache, "layers"):
        return None
    full = [cache.layers[i] for i in full_attention_layers(model_config)]
    return _layers_bytes(full) / fp16_global_kv_bytes(model_config, num_tokens)
