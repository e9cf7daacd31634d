"""The ``attn_implementation="cocktail"`` attention function and its registration with transformers.

Shapes: B batch, H_q query heads, H_kv key/value heads, L_q query tokens, D head dim.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_cocktail.cache.layer import CocktailLayer, layer_of
from hf_cocktail.decode.dispatch import split_precision_attention

ATTN_NAME = "cocktail"


# attention modules seen without a ``sliding_window`` attribute: looked up once per module, not at every decode step
# (a missing attribute goes through ``nn.Module.__getattr__``, about a microsecond per layer and step)
_WINDOWLESS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _module_window(module: torch.nn.Module):
    if module in _WINDOWLESS:
        return None
    window = getattr(module, "sliding_window", None)
    if window is None:
        _WINDOWLESS.add(module)
    return window


def _refuse_unsupported(module: torch.nn.Module, layer: CocktailLayer, kwargs: dict[str, Any]) -> None:
    window = kwargs.get("sliding_window") or _module_window(module)
    if window is not None:
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')} uses sliding-window attention (window {window}) but its cache "
            "layer is a Cocktail layer: the cache did not know the model's layer types. Pass "
            "model_config=model.config to CocktailCache (or call prepare_inputs before generate), so that sliding "
            "layers are the model's own"
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn_implementation='cocktail' does not support the model's `{name}` attention "
                "argument; load the model with attn_implementation='eager'"
            )


def cocktail_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``attn_implementation="cocktail"``.

    ``query (B, H_q, L_q, D)``, ``key``/``value`` as the cache layer returned them. Prefill (and any call whose keys
    do not come from a Cocktail layer) runs as SDPA does; decode calls on a Cocktail layer run split-precision
    attention over its packed store. Returns ``((B, L_q, H_q, D), None)`` as transformers expects.
    """
    layer = layer_of(key)
    if layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    _refuse_unsupported(module, layer, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    reads_store = layer.reads_packed_store()
    layer.claim_split_attention()
    if not reads_store:
        layer.observe_prefill_attention(query, key, scaling)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = split_precision_attention(query, layer.store, scaling, layer.config.backend)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"cocktail"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_NAME, cocktail_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
