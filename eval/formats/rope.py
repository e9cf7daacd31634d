"""Undoing and redoing RoPE on stored keys, with the cos/sin the model itself applies to a layer.

A key ``k`` at position ``p`` is stored rotated: ``k_post = k * cos + rotate_half(k) * sin`` (transformers'
``apply_rotary_pos_emb``; ``cos``/``sin`` may carry the rope type's ``attention_scaling`` a, ``cos^2 + sin^2 = a^2``).
The inverse is ``k = (k_post * cos - rotate_half(k_post) * sin) / (cos^2 + sin^2)``: exact up to fp32 rounding.

Models with several layer types (Gemma 3: sliding layers with rope theta 10K, global layers with 1M) keep one
``inv_freq`` per type in ``model.model.rotary_emb`` and take the type as a third argument
(``rotary_emb(x, position_ids, layer_type)``); the type of layer ``i`` is ``config.layer_types[i]``.

Shapes: keys ``(H_kv, N, D)``; ``cos``/``sin`` ``(N, D)``.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``(x1, x2) -> (-x2, x1)`` over the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_module(model):
    """The model's rotary embedding module (``model.model.rotary_emb``); ValueError naming the model otherwise."""
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rot is None:
        raise ValueError(f"{type(model).__name__}: no model.model.rotary_emb; pre-RoPE keys need a RoPE model")
    return rot


@torch.no_grad()
def layer_cos_sin(model, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin (N, D)`` that layer ``layer`` applies to its keys at ``positions (N,)`` (int64)."""
    rot = rotary_module(model)
    x = torch.zeros(1, dtype=torch.float32, device=positions.device)
    layer_types = getattr(model.config, "layer_types", None)
    if hasattr(rot, "layer_types") and layer_types is not None:
        cos, sin = rot(x, positions[None], layer_types[layer])
    else:
        cos, sin = rot(x, positions[None])
    return cos[0].float(), sin[0].float()


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys ``(H_kv, N, D)`` -> the stored (rotated) keys, as transformers computes them (fp32)."""
    k = k.float()
    return k * cos + rotate_half(k) * sin


def undo_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Stored keys ``(H_kv, N, D)`` -> the keys before RoPE (fp32; the inverse of :func:`apply_rope`)."""
    k = k.float()
    return (k * cos - rotate_half(k) * sin) / (cos * cos + sin * sin)
