"""Which cache layer each model layer gets: a :class:`CocktailLayer` for every full-attention layer (a
:class:`HybridCocktailLayer` where the full attention runs beside a state-space / linear block in the same layer, as
in Falcon-H1), transformers' own layer for everything else (sliding-window and chunked attention keep only their
window at full precision, linear-attention / convolution / state-space layers of hybrid models keep their states,
KV-sharing layers store nothing) — exactly what ``DynamicCache(config=model.config)`` would give those layers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

from hf_cocktail.cache.layer import CocktailLayer

try:  # transformers >= 5.x: attention beside a state-space block in one layer (Falcon-H1)
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer as _NativeHybrid
except ImportError:  # pragma: no cover - older transformers have no such layer
    _NativeHybrid = None


class HybridCocktailLayer(CocktailLayer, LinearAttentionLayer):
    """A Cocktail layer for a model layer whose full attention runs beside a state-space / linear-attention block
    (Falcon-H1): its keys and values in a Cocktail store, its conv / recurrent states as transformers'
    ``LinearAttentionAndFullAttentionLayer`` keeps them."""

    def __init__(self, cache: Any, layer_idx: int, number_of_states: int = 1):
        CocktailLayer.__init__(self, cache, layer_idx)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """``(keys, values)`` from ``update``; states by keyword from ``update_conv_state`` and the like."""
        if len(args) == 2 and not kwargs:
            CocktailLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        CocktailLayer.reset(self)

    def select_sequences(self, indices: list[int], same_packed: bool = False) -> None:
        CocktailLayer.select_sequences(self, indices, same_packed)
        LinearAttentionLayer.reorder_cache(self, torch.tensor(indices, dtype=torch.long))

    def crop(self, max_length: int) -> None:
        LinearAttentionLayer.crop(self, max_length)
        CocktailLayer.crop(self, max_length)

    def get_seq_length(self) -> int:
        return CocktailLayer.get_seq_length(self)

    def get_max_length(self) -> int:
        return CocktailLayer.get_max_length(self)


def model_layers(cache: Any, model_config: Any) -> list:
    """One cache layer per model layer for ``model_config`` (a transformers config): Cocktail layers where the model's
    default cache has a full-attention layer (a plain ``DynamicLayer``, or full attention beside a state-space
    block), the default cache's own layers elsewhere."""
    native = DynamicCache(config=model_config).layers
    return [_cocktail_layer(cache, i, layer) if quantizes(layer) else layer for i, layer in enumerate(native)]


def _cocktail_layer(cache: Any, idx: int, native: Any) -> CocktailLayer:
    if type(native) is DynamicLayer:
        return CocktailLayer(cache, idx)
    return HybridCocktailLayer(cache, idx, native.number_of_states)


def is_full_attention(layer: Any) -> bool:
    """A plain full-attention layer of the model's default cache (keys and values only)."""
    return type(layer) is DynamicLayer


def quantizes(layer: Any) -> bool:
    """A layer of the model's default cache whose place a Cocktail layer takes: a plain full-attention layer, or
    transformers' full attention beside a state-space block in one layer (Falcon-H1)."""
    return is_full_attention(layer) or (_NativeHybrid is not None and type(layer) is _NativeHybrid)


def holds_states(layer: Any) -> bool:
    """A layer with linear-attention / convolution / state-space states (hybrid models): the model's own, or a
    :class:`HybridCocktailLayer`."""
    return hasattr(layer, "update_conv_state") and (
        isinstance(layer, HybridCocktailLayer) or not isinstance(layer, CocktailLayer)
    )


def hybrid_state_tensors(layers: list) -> list[torch.Tensor]:
    """The state tensors (conv, recurrent, the length counter) that the :class:`HybridCocktailLayer` s among
    ``layers`` hold beside their stores: bytes held, as the model's own layers' states are."""
    out: list[torch.Tensor] = []
    for layer in layers:
        if isinstance(layer, HybridCocktailLayer):
            length = getattr(layer, "cumulative_length_linear", None)  # (transformers >= 5.2x; none before)
            states = [*layer.conv_states.values(), *layer.recurrent_states.values(), length]
            out += [t for t in states if isinstance(t, torch.Tensor)]
    return out


def native_nbytes(layer: Any, fp16: bool = False) -> int:
    """Bytes held by a native layer's key/value tensors (``fp16``: counted at 2 bytes per element)."""
    total = 0
    for name in ("keys", "values"):
        t = getattr(layer, name, None)
        if t is not None and hasattr(t, "numel"):
            total += t.numel() * (2 if fp16 else t.element_size())
    return total


class HybridStates:
    """The conv / recurrent state API of transformers' ``Cache`` for :class:`~hf_cocktail.CocktailCache` (a mixin
    before ``Cache``): hybrid models' states live in the model's own layers, which :func:`model_layers` made."""

    layers: list
    _layer: Any

    def _linear_state(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Conv / recurrent states of hybrid models live in the model's own layers (see this module)."""
        self._layer(0)
        if not any(holds_states(layer) for layer in self.layers):
            raise ValueError(
                "CocktailCache got a linear-attention / convolution state but has no layer for it: pass "
                "model_config=model.config to CocktailCache (or call prepare_inputs before generate) so that the "
                "model's own layers hold those states"
            )
        return getattr(super(), name)(*args, **kwargs)

    def update_conv_state(self, *args: Any, **kwargs: Any) -> Any:
        return self._linear_state("update_conv_state", *args, **kwargs)

    def update_recurrent_state(self, *args: Any, **kwargs: Any) -> Any:
        return self._linear_state("update_recurrent_state", *args, **kwargs)

    def get_conv_state(self, *args: Any, **kwargs: Any) -> Any:
        return self._linear_state("get_conv_state", *args, **kwargs)

    def get_recurrent_state(self, *args: Any, **kwargs: Any) -> Any:
        return self._linear_state("get_recurrent_state", *args, **kwargs)

    def has_previous_state(self, *args: Any, **kwargs: Any) -> bool:
        return self._linear_state("has_previous_state", *args, **kwargs)
