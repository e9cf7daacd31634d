"""The ``attn_implementation="cocktail"`` attention function and its registration with transformers.

Shapes: B batch, H_q query heads, H_kv key/value heads, L_q query tokens, T key tokens, D head dim.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_cocktail.cache.layer import AttentionPath, CocktailLayer, layer_of
from hf_cocktail.decode.dispatch import split_precision_attention

ATTN_NAME = "cocktail"
WINDOWED_TYPES = ("sliding_attention", "chunked_attention")

# the window each attention module uses where its calls do not say it (no ``sliding_window`` keyword): the layer type
# in its config, else its ``sliding_window`` attribute; looked up once per module, not at every decode step
_WINDOWS: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def _module_window(module: torch.nn.Module) -> Any:
    if module in _WINDOWS:
        return _WINDOWS[module]
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if isinstance(layer_types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(layer_types):
        windowed = layer_types[idx] in WINDOWED_TYPES
        window = (getattr(module, "sliding_window", None) or layer_types[idx]) if windowed else None
    else:
        window = getattr(module, "sliding_window", None)
    _WINDOWS[module] = window
    return window


def layer_window(module: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
    """The window this call of ``module`` really attends with: the call's ``sliding_window`` keyword where it has one
    (EXAONE 4 sets the attribute on every layer and passes ``None`` on its full-attention layers), else the layer's
    type in ``module.config.layer_types``, else the module's ``sliding_window`` attribute; None for full attention."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    return _module_window(module)


def _refuse_windowed(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    window = layer_window(module, kwargs)
    if window is not None:
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')} uses sliding-window attention (window {window}) but its cache "
            "layer is a Cocktail layer: the cache did not know the model's layer types. Pass "
            "model_config=model.config to CocktailCache (or call prepare_inputs before generate), so that sliding "
            "layers are the model's own"
        )


def _refuse_transformed_values(module: torch.nn.Module, layer: CocktailLayer, value: torch.Tensor) -> None:
    """The split path reads the values stored in the layer: the model must attend over the values ``update``
    returned, not a transform of them (DiffLlama splits and repeats them across heads)."""
    stored = layer.store.full.split_path_tensors()[1] if layer.store is not None else None
    if stored is not None and value.shape == stored.shape and value.data_ptr() == stored.data_ptr():
        return
    raise ValueError(
        f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__}) transforms the values that the cache's "
        "update returned before its attention (as DiffLlama's differential attention does): "
        "attn_implementation='cocktail' reads the stored values and would give a different result. Load the model "
        "with attn_implementation='sdpa' or 'eager' (the Cocktail cache then hands them the dequantized cache)"
    )


SCORES_PER_BLOCK = 1 << 24  # exact attention computes at most this many scores at once (64 MiB in fp32)


def exact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """transformers' eager attention with logit soft-capping (Gemma 2) and attention sinks (gpt-oss), for the calls
    that do not read a packed store (prefill, the model's own sliding layers): SDPA refuses both. Computed in blocks
    of query rows (at most :data:`SCORES_PER_BLOCK` scores at once: a long prefill never holds ``L_q x T`` scores).

    ``query (B, H_q, L_q, D)``, ``key``/``value`` ``(B, H_kv, T, D)``; ``attention_mask``: sdpa_mask's boolean
    ``(B, 1, L_q, T)`` (True: visible), a float mask to add, or None for causal attention (the last ``L_q`` keys
    are the queries' own). ``s_aux`` ``(H_q,)``: one more logit per head in the softmax, with no value. Returns
    ``((B, L_q, H_q, D), None)``."""
    B, H_q, Lq, _ = query.shape
    n_rep = H_q // key.shape[1]
    key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    rows = max(1, SCORES_PER_BLOCK // max(1, B * H_q * key.shape[2]))
    outs = []
    for a in range(0, Lq, rows):
        mask = attention_mask
        if mask is not None and mask.shape[-2] != 1:
            mask = mask[..., a : a + rows, :]
        outs.append(
            _exact_block(module, query[:, :, a : a + rows], key, value, mask, a, Lq, scaling, dropout, softcap, s_aux)
        )
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).transpose(1, 2).contiguous(), None


def _exact_block(module, query, key, value, mask, first, Lq, scaling, dropout, softcap, s_aux) -> torch.Tensor:
    """Query rows ``[first, first + rows)`` of :func:`exact_attention_forward`: ``(B, H_q, rows, D)``."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    weights = _masked(weights, mask, first, Lq)
    if s_aux is None:
        probs = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sinks = s_aux.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], 1).to(weights.dtype)
        combined = torch.cat([weights, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    return torch.matmul(probs, value)


def _masked(weights: torch.Tensor, mask: torch.Tensor | None, first: int, Lq: int) -> torch.Tensor:
    """``weights (B, H_q, rows, T)`` of query rows ``first ...`` with ``mask`` applied (see
    :func:`exact_attention_forward`)."""
    if mask is None:
        rows, T = weights.shape[-2:]
        i = torch.arange(first, first + rows, device=weights.device)[:, None]
        hidden = torch.arange(T, device=weights.device)[None, :] > T - Lq + i
        return weights.masked_fill(hidden, torch.finfo(weights.dtype).min)
    if mask.dtype == torch.bool:
        return weights.masked_fill(~mask[..., : weights.shape[-1]], torch.finfo(weights.dtype).min)
    return weights + mask[..., : weights.shape[-1]]


def _attention_without_store(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """Prefill, or a layer that is not a Cocktail layer: SDPA, or the exact eager computation where the model
    soft-caps its logits or has attention sinks."""
    softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is None and s_aux is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return exact_attention_forward(module, query, key, value, attention_mask, scaling, dropout, softcap, s_aux)


def cocktail_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``attn_implementation="cocktail"``.

    ``query (B, H_q, L_q, D)``, ``key``/``value`` as the cache layer returned them. Prefill (and any call whose keys
    do not come from a Cocktail layer) runs as SDPA does (as eager attention does where the call passes ``softcap``
    or ``s_aux``); decode calls on a Cocktail layer run split-precision attention over its packed store, with the
    call's logit soft-cap and attention sinks. Returns ``((B, L_q, H_q, D), None)`` as transformers expects.
    """
    layer = layer_of(key)
    if layer is None:
        return _attention_without_store(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    _refuse_windowed(module, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    reads_store = layer.reads_packed_store()
    claimed = layer.path is AttentionPath.SPLIT  # update returned the full part (not the whole dequantized cache)
    layer.claim_split_attention()
    if not reads_store:
        shift_sensitive = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
        layer.observe_prefill_attention(query, key, scaling, shift_sensitive)
        return _attention_without_store(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if claimed:
        _refuse_transformed_values(module, layer, value)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    extras = {} if softcap is None and sinks is None else {"sinks": sinks, "softcap": softcap}
    out = split_precision_attention(query, layer.store, scaling, layer.config.backend, **extras)
    return out.transpose(1, 2).contiguous(), None


# model types that compute their attention in their own code (never through transformers' attention functions) but
# build their causal mask with the registered mask function: attn_implementation="cocktail" cannot serve them
OWN_ATTENTION = {"mpt": "MPT (ALiBi attention)"}


def cocktail_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The ``"cocktail"`` mask function: SDPA's (``sdpa_mask``), after refusing the models that would never call
    :func:`cocktail_attention_forward` (:data:`OWN_ATTENTION`)."""
    model_type = getattr(kwargs.get("config"), "model_type", None)
    if model_type in OWN_ATTENTION:
        raise ValueError(
            f"attn_implementation='cocktail' does not support {OWN_ATTENTION[model_type]} models: they compute their "
            "attention in their own code, not through transformers' attention functions. Load the model with "
            "attn_implementation='eager' (a CocktailCache then hands it the dequantized cache) or use its own cache"
        )
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``"cocktail"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_NAME, cocktail_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, cocktail_mask)
