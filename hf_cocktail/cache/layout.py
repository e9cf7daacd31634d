"""Which cache layer each model layer gets: a :class:`CocktailLayer` for every full-attention layer, transformers'
own layer for everything else (sliding-window and chunked attention keep only their window at full precision,
linear-attention / convolution / state-space layers of hybrid models keep their states, KV-sharing layers store
nothing) — exactly what ``DynamicCache(config=model.config)`` would give those layers.
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import DynamicCache, DynamicLayer

from hf_cocktail.cache.layer import CocktailLayer


def model_layers(cache: Any, model_config: Any) -> list:
    """One cache layer per model layer for ``model_config`` (a transformers config): Cocktail layers where the model's
    default cache has a plain full-attention ``DynamicLayer``, the default cache's own layers elsewhere."""
    native = DynamicCache(config=model_config).layers
    return [CocktailLayer(cache, i) if is_full_attention(layer) else layer for i, layer in enumerate(native)]


def is_full_attention(layer: Any) -> bool:
    """A plain full-attention layer of the model's default cache (what Cocktail quantizes)."""
    return type(layer) is DynamicLayer


def holds_states(layer: Any) -> bool:
    """A linear-attention / convolution / state-space layer (hybrid models): conv or recurrent states."""
    return hasattr(layer, "update_conv_state") and not isinstance(layer, CocktailLayer)


def native_nbytes(layer: Any, fp16: bool = False) -> int:
    """Bytes held by a native layer's key/value tensors (``fp16``: counted at 2 bytes per element)."""
    total = 0
    for name in ("keys", "values"):
        t = getattr(layer, name, None)
        if t is not None and hasattr(t, "numel"):
            total += t.numel() * (2 if fp16 else t.element_size())
    return total
