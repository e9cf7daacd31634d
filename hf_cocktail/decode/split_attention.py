"""Split-precision decode attention in plain PyTorch: the spec that the Triton and CPU kernels implement.

Shapes: B batch, H_q query heads, H_kv key/value heads (GQA: ``H_q = n_rep * H_kv``), L_q query tokens, D head dim,
R length of the full-precision part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch

from hf_cocktail.storage import key_outliers, quant
from hf_cocktail.storage.key_centering import logit_offsets
from hf_cocktail.storage.store import LayerStore, PackedSegment

BLOCK_TOKENS = 4096  # the PyTorch path dequantizes at most this many tokens of one segment at a time

Getter = Callable[[str], torch.Tensor]


def _segment_blocks(store: LayerStore, b: int, full: tuple[torch.Tensor, torch.Tensor]) -> Iterator[tuple[str, Getter]]:
    """Yield ``(kind, getter)`` for the blocks of sequence ``b``: the full part (``full``: its keys and values as read
    once for the step, ``(B, H_kv, R, D)`` each), then each packed segment in blocks of at most ``BLOCK_TOKENS``
    tokens; ``getter(which)`` dequantizes keys (``"k"``) or values."""
    s = store.full.start[b]
    yield "full", lambda which: full[0 if which == "k" else 1][b, :, s:].float()
    for seg in store.segments:
        t0, t1 = seg.tok_off[b], seg.tok_off[b + 1]
        for a in range(t0, t1, BLOCK_TOKENS):
            e = min(a + BLOCK_TOKENS, t1)
            yield "packed", functools.partial(_dequantize_block, seg, a=a, e=e, first_token=a - t0, c0=seg.chunk_off[b])


def _dequantize_block(seg: PackedSegment, which: str, *, a: int, e: int, first_token: int, c0: int) -> torch.Tensor:
    """Tokens ``[a, e)`` of ``seg`` dequantized in fp32; ``first_token`` is ``a``'s offset in its sequence, whose
    first chunk is ``c0``."""
    if which == "v":
        return quant.dequantize_values(
            seg.v_codes[:, a:e],
            *seg.value_params(a, e),
            seg.value_width,
            seg.group_size,
        )
    return key_outliers.segment_keys(seg, a, e, c0, first=first_token)  # (outlier key channels too)


def causal_mask_full_part(scores: torch.Tensor, start: int, R: int, Lq: int, n_rep: int) -> torch.Tensor:
    """Mask the full part's scores ``(H_kv, n_rep*L_q, T)``: key ``j`` (absolute index ``start + j``) is visible to
    query ``i`` iff ``start + j <= R - L_q + i`` (the newest ``L_q`` tokens are the queries' own)."""
    if Lq == 1:
        return scores
    j = torch.arange(scores.shape[-1], device=scores.device) + start
    i = torch.arange(Lq, device=scores.device).repeat(n_rep)
    return scores.masked_fill(j[None, None, :] > (R - Lq + i)[None, :, None], float("-inf"))


def split_precision_attention_torch(
    query: torch.Tensor,
    store: LayerStore,
    scaling: float,
    *,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference split-precision attention over a :class:`LayerStore` (the spec of the fast kernels).

    Q·K per precision segment, one softmax over all concatenated scores, P·V per segment, outputs summed; computed
    in fp32. The newest ``L_q`` tokens of the full-precision part are the queries' own tokens: query ``i`` sees them
    causally. Packed segments are dequantized one block (at most ``BLOCK_TOKENS`` tokens of one sequence) at a time;
    the whole cache is never materialised at full precision. A rotated store (``store.rotation``) is never
    un-rotated: the query is rotated once and the output rotated back once (:func:`with_rotation`). Centred keys
    (``store.key_mean``) need nothing: the common shift of a query's scores cancels in the softmax. Under ``sinks``
    or ``softcap`` it does not, and the shift is added back to every score.

    The scores are those of transformers' eager attention: ``s = scaling * q·k``; with ``softcap``,
    ``s = softcap * tanh(s / softcap)`` (Gemma 2 logit soft-capping) before the causal mask; with ``sinks`` (gpt-oss
    attention sinks, its ``module.sinks``), query head ``h``'s softmax denominator gains ``exp(sinks[h])``, a logit
    that contributes no value.

    Args:
        query: ``(B, H_q, L_q, D)``.
        store: the layer's storage (``B`` sequences, ``H_kv`` heads).
        scaling: softmax scale (usually ``D ** -0.5``).
        sinks: ``(H_q,)`` one logit per query head, or None.
        softcap: a positive float, or None.

    Returns:
        ``(B, H_q, L_q, D)`` in ``query.dtype``.
    """
    offsets = None
    if store.key_mean is not None and (sinks is not None or softcap is not None):  # centring is no longer invisible
        offsets = logit_offsets(query, store.key_mean, scaling)
    return with_rotation(attend_in_store_basis, query, store, scaling, sinks=sinks, softcap=softcap, offsets=offsets)


def with_rotation(attend: Callable, query: torch.Tensor, store: LayerStore, scaling: float, **kwargs) -> torch.Tensor:
    """Run ``attend(query, store, scaling, out_dtype, **kwargs)`` in the store's basis: with a rotation, on the fp32
    rotated query, the output rotated back to ``query.dtype``; without one, as is (``sinks`` and ``softcap`` act on
    scores, which the rotation leaves unchanged)."""
    rotation = store.rotation
    if rotation is None:
        return attend(query, store, scaling, query.dtype, **kwargs)
    out = attend(rotation.rotate_query(query), store, scaling, torch.float32, **kwargs)
    return rotation.unrotate_output(out, query.dtype)


def soft_capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (``scores`` as is without ``softcap``)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``scores (H_kv, n_rep*L_q, T)`` (rows ordered ``(rep, i)``); with ``sinks``
    ``(H_q,)`` (``H_q = H_kv * n_rep``), the row of query head ``h`` has one more logit ``sinks[h]`` in its
    denominator (transformers' eager attention with ``s_aux``: the sink column is dropped after the softmax)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    H_kv, rows, _ = scores.shape
    n_rep = sinks.shape[0] // H_kv
    sink = sinks.float().reshape(H_kv, n_rep, 1).expand(H_kv, n_rep, rows // n_rep).reshape(H_kv, rows, 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def attend_in_store_basis(
    query: torch.Tensor,
    store: LayerStore,
    scaling: float,
    out_dtype: torch.dtype,
    *,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`split_precision_attention_torch` on a query already in the store's (rotated) basis; ``offsets (B, H_q,
    L_q, 1)``, added to every score before the soft-cap: what centred keys took from them (:mod:`.key_centering`)."""
    B, H_q, Lq, D = query.shape
    H_kv = store.full.shape[1]
    if H_q % H_kv:
        raise ValueError(f"query heads H_q={H_q} must be a multiple of key/value heads H_kv={H_kv}")
    if sinks is not None and tuple(sinks.shape) != (H_q,):
        raise ValueError(f"sinks must have shape (H_q,) = ({H_q},), got {tuple(sinks.shape)}")
    n_rep = H_q // H_kv
    R = store.full.length
    out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
    full = (store.full.keys, store.full.values)  # an 8-bit full part dequantizes here, once per step
    for b in range(B):
        q = query[b].float().reshape(H_kv, n_rep * Lq, D) * scaling  # rows ordered (rep, i)
        blocks = list(_segment_blocks(store, b, full))
        shift = 0.0 if offsets is None else offsets[b].reshape(H_kv, n_rep * Lq, 1)
        scores = []
        for kind, get in blocks:
            s = soft_capped(q @ get("k").transpose(1, 2) + shift, softcap)  # (H_kv, n_rep*Lq, T_block)
            scores.append(causal_mask_full_part(s, store.full.start[b], R, Lq, n_rep) if kind == "full" else s)
        p = softmax_with_sinks(torch.cat(scores, dim=-1), sinks)
        o = torch.zeros(H_kv, n_rep * Lq, D, dtype=torch.float32, device=query.device)
        pos = 0
        for (_, get), s in zip(blocks, scores):
            T = s.shape[-1]
            if T:
                o += p[..., pos : pos + T] @ get("v")
            pos += T
        out[b] = o.reshape(H_q, Lq, D).to(out_dtype)
    return out
