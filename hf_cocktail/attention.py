"""Split-precision decode attention and the ``attn_implementation="cocktail"`` registration.

Shapes: B batch, H_q query heads, H_kv key/value heads (GQA: ``H_q = n_rep * H_kv``), L_q query tokens, D head dim.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .store import LayerStore

ATTN_NAME = "cocktail"
_BLOCK_TOKENS = 4096  # the PyTorch path dequantizes at most this many tokens of one segment at a time


def _segment_blocks(store: LayerStore, b: int):
    """Yield ``(kind, getter)`` for the blocks of sequence ``b``: the full-precision part, then each packed segment
    in blocks of at most ``_BLOCK_TOKENS`` tokens; ``getter(which)`` dequantizes keys (``"k"``) or values."""
    full = store.full
    s = full.start[b]
    yield "full", lambda which: (full.keys if which == "k" else full.values)[b, :, s:].float()
    for seg in store.segments:
        t0, t1 = seg.tok_off[b], seg.tok_off[b + 1]
        c0 = seg.chunk_off[b]
        for a in range(t0, t1, _BLOCK_TOKENS):
            # block boundaries are multiples of the chunk size within the sequence (4096 % C == 0 is not required:
            # the chunk index is computed from the token's offset inside its sequence)
            e = min(a + _BLOCK_TOKENS, t1)
            yield "packed", (lambda which, seg=seg, a=a, e=e, t0=t0, c0=c0: _dequant_block(seg, which, a, e, t0, c0))


def _dequant_block(seg, which: str, a: int, e: int, t0: int, c0: int) -> torch.Tensor:
    from . import quant

    if which == "v":
        return quant.dequantize_values(seg.v_codes[:, a:e], seg.v_scale[:, a:e], seg.v_zero[:, a:e], seg.bits,
                                       seg.group_size)
    c = quant.unpack_codes(seg.k_codes[:, a:e], seg.bits).float()
    idx = c0 + torch.arange(a - t0, e - t0, device=c.device) // seg.chunk_size
    return c * seg.k_scale.float().index_select(1, idx) + seg.k_zero.float().index_select(1, idx)


def split_precision_attention_torch(query: torch.Tensor, store: LayerStore, scaling: float) -> torch.Tensor:
    """Reference split-precision attention over a :class:`LayerStore` (the spec of the Triton kernel).

    Q·K per precision segment, one softmax over all concatenated scores, P·V per segment, outputs summed; computed
    in fp32. The newest ``L_q`` tokens of the full-precision part are the queries' own tokens: query ``i`` sees them
    causally. Packed segments are dequantized one block (at most 4096 tokens of one sequence) at a time; the whole
    cache is never materialised at full precision.

    Args:
        query: ``(B, H_q, L_q, D)``.
        store: the layer's storage (``B`` sequences, ``H_kv`` heads).
        scaling: softmax scale (usually ``D ** -0.5``).

    Returns:
        ``(B, H_q, L_q, D)`` in ``query.dtype``.
    """
    B, H_q, Lq, D = query.shape
    H_kv = store.full.keys.shape[1]
    if H_q % H_kv:
        raise ValueError(f"query heads H_q={H_q} must be a multiple of key/value heads H_kv={H_kv}")
    n_rep = H_q // H_kv
    R = store.full.length
    out = torch.empty_like(query)
    for b in range(B):
        q = query[b].float().reshape(H_kv, n_rep * Lq, D) * scaling  # rows ordered (rep, i)
        blocks = list(_segment_blocks(store, b))
        scores = []
        for kind, get in blocks:
            s = q @ get("k").transpose(1, 2)  # (H_kv, n_rep*Lq, T_block)
            if kind == "full" and Lq > 1:
                # key j of the full part (absolute index start+j) is visible to query i iff abs <= R - Lq + i
                T = s.shape[-1]
                j = torch.arange(T, device=s.device) + store.full.start[b]
                i = torch.arange(Lq, device=s.device).repeat(n_rep)
                s = s.masked_fill(j[None, None, :] > (R - Lq + i)[None, :, None], float("-inf"))
            scores.append(s)
        p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        o = torch.zeros(H_kv, n_rep * Lq, D, dtype=torch.float32, device=query.device)
        pos = 0
        for (kind, get), s in zip(blocks, scores):
            T = s.shape[-1]
            if T:
                o += p[..., pos:pos + T] @ get("v")
            pos += T
        out[b] = o.reshape(H_q, Lq, D).to(query.dtype)
    return out


def _split_precision_attention(query, store, scaling, backend: str):
    from .backend import resolve_backend

    if resolve_backend(backend, query.device) == "triton":
        from triton_ops import split_precision_attention as triton_attention

        return triton_attention(query, store, scaling)
    return split_precision_attention_torch(query, store, scaling)


def cocktail_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``attn_implementation="cocktail"``.

    Prefill (and any call whose keys do not come from a Cocktail layer after prefill) runs as SDPA does. Decode
    calls on a Cocktail layer run split-precision attention over the packed segments.
    """
    from .cache import layer_of

    layer = layer_of(key)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if layer is not None and window is not None:
        raise ValueError(
            f"CocktailCache with attn_implementation='cocktail' does not support sliding-window attention layers "
            f"(layer {getattr(module, 'layer_idx', '?')} has sliding_window={window}); load the model "
            "with attn_implementation='sdpa' (correct, dequantizing) or use a full-attention model")
    for name in ("softcap", "s_aux"):
        if layer is not None and kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='cocktail' does not support the model's `{name}` attention "
                             "argument; load the model with attn_implementation='eager'")
    if layer is None or layer.store is None or layer.in_prefill or layer.forbid_split:
        if layer is not None:
            layer.uses_split_attention = not layer.forbid_split
            if layer.deferred is not None:  # scorer="attention": the query tokens' attention scores the chunks
                layer.cache.accumulate_attention(query, key, scaling if scaling is not None else
                                                 query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer.uses_split_attention = True  # e.g. after load_prefill: the next steps skip the dequantization
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = _split_precision_attention(query, layer.store, scaling, layer.config.backend)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"cocktail"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_NAME, cocktail_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
