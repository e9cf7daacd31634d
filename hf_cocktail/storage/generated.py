"""Packing of the tokens a layer appends after its prefill (generated tokens, a later chat turn, assisted decoding's
candidates): the oldest whole chunks beyond the newest ``keep`` (``CocktailConfig.residual_tokens``) leave the full
part for the layer's packed segment of their width, quantized with the store's rotation (the full part is already
rotated), quantizers and scale format.

Shapes: B batch, H_kv heads, D head dim, C chunk size, N / M tokens / chunks of a segment.

Where they go. A segment lays its sequences end to end and a kernel finds token ``t``'s chunk as ``chunk_off[b] + (t -
tok_off[b]) // C``: within a sequence only the last chunk may be partial. A sequence's prompt tokens in a segment may
end with a partial chunk (the context's last), its *tail* (``N_b % C`` tokens). Appended chunks are whole and go just
before it: sequence ``b``'s range is [the prompt's whole chunks, the appended chunks oldest first, the tail]. Attention
is one softmax over every token, so the order inside a segment matters only to :func:`appended_order`
(``LayerStore.dequantized``), which rebuilds it from the counts.

Why a copy per pack. The kernels read a segment as contiguous ``(H_kv, N, ...)`` tensors, heads outermost
(``cpu_ops`` copies a non-contiguous one), so a sequence's range cannot grow in place; each pack writes a new segment
object: one copy of the segment's codes and parameters (nothing is quantized again), once per ``C`` decode steps with
the default rule, about ``2 / C`` of the bytes those steps' attention reads from it. The new object is also what
tells the decode dispatch to redo what it derived from the old one (``LayerStore.kernel_cache`` entries compare segment
identity; a segment's cached kernel arguments live on the object). With several sequences the same copy inserts every
sequence's block at once: decode appends to all of them together, so they all have the same appended tokens.

A crop longer than the unpacked appended tokens (``residual_tokens`` below what assisted decoding or the user crops)
takes the newest packed chunks out; the tokens of them that stay return to the full part as their dequantized values
(what attention read for them), to be packed again as they age: those tokens are quantized twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TOKEN_FIELDS = ("k_codes", "v_codes", "v_scale", "v_zero")  # a segment's tensors indexed by token (dim 1)
CHUNK_FIELDS = ("k_scale", "k_zero", "k_block", "v_block")  # ... by chunk (the blocks may be None)


@dataclass
class AppendedPacking:
    """How a layer packs its appended tokens: into ``LayerStore.segments[segment]``, with ``quantize_keys`` /
    ``quantize_values`` (None: the PyTorch reference of :mod:`.quant`), scales and zeros in ``scale_dtype`` and
    ``scale_bits`` 16 or 8 (as the prefill's chunks)."""

    segment: int
    scale_dtype: torch.dtype
    scale_bits: int = 16
    quantize_keys: Callable | None = None
    quantize_values: Callable | None = None


def tails(seg: Any) -> list[int]:
    """Per sequence, the tokens of its last, partial chunk in segment ``seg`` (0 where every chunk is whole)."""
    return [(e - s) % seg.chunk_size for s, e in zip(seg.tok_off, seg.tok_off[1:])]


def _cuts(seg: Any) -> tuple[list[int], list[int]]:
    """Per sequence, the token and the chunk index where appended chunks go: before its tail."""
    t = tails(seg)
    return [e - r for e, r in zip(seg.tok_off[1:], t)], [e - (r > 0) for e, r in zip(seg.chunk_off[1:], t)]


def _rebuilt(seg: Any, pieces: Callable[[str, list[int], list[int]], list[torch.Tensor]], tok_off, chunk_off) -> Any:
    """A new segment like ``seg`` whose every field ``name`` is ``torch.cat(pieces(name, offsets, cuts), dim=1)``
    (offsets and cuts of the field's axis, tokens or chunks), with offsets ``tok_off`` and ``chunk_off``."""
    tok_cut, chunk_cut = _cuts(seg)
    fields: dict[str, Any] = {}
    for names, off, cut in ((TOKEN_FIELDS, seg.tok_off, tok_cut), (CHUNK_FIELDS, seg.chunk_off, chunk_cut)):
        for name in names:
            fields[name] = None if getattr(seg, name) is None else torch.cat(pieces(name, off, cut), dim=1)
    return dataclasses.replace(
        seg, **fields, tok_off=list(tok_off), chunk_off=list(chunk_off), _dev_offsets=None, _coded_args=None
    )


def insert_chunks(seg: Any, new: Any) -> Any:
    """``seg`` with sequence ``b``'s tokens of segment ``new`` (whole chunks of the same widths and format) inserted
    before sequence ``b``'s tail, for every ``b``: one copy of ``seg``, a new object."""
    if new.tok_off[-1] == 0:
        return seg
    if any(tails(new)):
        raise ValueError(f"insert_chunks takes whole chunks of {seg.chunk_size} tokens, got {new.tok_off}")

    def pieces(name: str, off: list[int], cut: list[int]) -> list[torch.Tensor]:
        a, x = getattr(seg, name), getattr(new, name)
        new_off = new.tok_off if name in TOKEN_FIELDS else new.chunk_off
        out = []
        for b in range(len(cut)):
            out += [a[:, off[b] : cut[b]], x[:, new_off[b] : new_off[b + 1]], a[:, cut[b] : off[b + 1]]]
        return out

    return _rebuilt(
        seg,
        pieces,
        [a + b for a, b in zip(seg.tok_off, new.tok_off)],
        [a + b for a, b in zip(seg.chunk_off, new.chunk_off)],
    )


def split_before_tails(seg: Any, n: int) -> tuple[Any, Any]:
    """``(seg without the n tokens before each sequence's tail, a segment of those tokens)``: ``n`` a multiple of the
    chunk size, at most what each sequence holds before its tail."""
    C = seg.chunk_size
    if n % C:
        raise ValueError(f"split_before_tails takes whole chunks of {C} tokens, got n={n}")
    tok_cut, _ = _cuts(seg)
    if any(cut - s < n for s, cut in zip(seg.tok_off, tok_cut)):
        raise ValueError(f"split_before_tails: a sequence holds fewer than {n} tokens before its tail")

    def kept(name: str, off: list[int], cut: list[int]) -> list[torch.Tensor]:
        m = n if name in TOKEN_FIELDS else n // C
        a = getattr(seg, name)
        return [p for b in range(len(cut)) for p in (a[:, off[b] : cut[b] - m], a[:, cut[b] : off[b + 1]])]

    def taken(name: str, off: list[int], cut: list[int]) -> list[torch.Tensor]:
        m = n if name in TOKEN_FIELDS else n // C
        return [getattr(seg, name)[:, c - m : c] for c in cut]

    B = len(seg.tok_off) - 1
    rest = _rebuilt(seg, kept, _minus(seg.tok_off, n), _minus(seg.chunk_off, n // C))
    out = _rebuilt(seg, taken, [b * n for b in range(B + 1)], [b * (n // C) for b in range(B + 1)])
    return rest, out


def _minus(offsets: list[int], per_sequence: int) -> list[int]:
    return [o - b * per_sequence for b, o in enumerate(offsets)]


def pack_appended(store: Any, keep: int) -> int:
    """Move the oldest whole chunks of ``store``'s unpacked appended tokens, all but the newest ``keep`` (at least
    that many stay), from the full part into the packed segment ``store.packing`` names; the number of tokens packed
    per sequence (0: nothing to do, or a store without ``packing``). Call it before appending a forward's tokens, so
    that every query of that forward is newer than every packed token."""
    packing, full = store.packing, store.full
    if packing is None:
        return 0
    seg = store.segments[packing.segment]
    C, at = seg.chunk_size, store.appended_from
    n = (full.length - at - keep) // C * C
    if n <= 0:
        return 0
    k, v = full.tokens(at, n)
    new = type(seg).from_sequences(
        [t.contiguous() for t in k],
        [t.contiguous() for t in v],
        seg.bits,
        C,
        seg.group_size,
        packing.scale_dtype,
        packing.quantize_keys,
        packing.quantize_values,
        seg.value_width,
        packing.scale_bits,
        seg.key_outliers,  # the segment's outlier key channels (the prefill chose them), as its other chunks
    )
    _replace_segment(store, packing.segment, insert_chunks(seg, new))
    full.remove(at, n)
    store.packed_appended += n
    return n


def _replace_segment(store: Any, i: int, seg: Any) -> None:
    """A new list (a store made by ``select(same_packed=True)`` may share the old one)."""
    store.segments = [seg if j == i else s for j, s in enumerate(store.segments)]


def crop_appended(store: Any, n: int) -> None:
    """Drop ``store``'s newest ``n`` tokens: the unpacked ones, then (past them) the newest packed appended chunks,
    whose tokens that stay go back to the full part dequantized (the module docstring)."""
    full = store.full
    unpacked = full.length - store.appended_from
    if n <= unpacked or store.packed_appended == 0:
        full.truncate(n)
        store.appended_from = min(store.appended_from, full.length)
        return
    deeper = n - unpacked
    if deeper > store.packed_appended:
        raise ValueError(
            f"crop of {n} tokens reaches past the {store.packed_appended} packed appended tokens and the {unpacked} "
            "unpacked ones into the prefill, which a store with packed appended tokens cannot give back"
        )
    i = store.packing.segment
    C = store.segments[i].chunk_size
    m = -(-deeper // C) * C  # the packed tokens taken out, whole chunks
    rest, taken = split_before_tails(store.segments[i], m)
    full.truncate(unpacked)
    _replace_segment(store, i, rest)
    store.packed_appended -= m
    stay = m - deeper
    if stay:
        dtype = getattr(full, "dtype", None) or full.keys.dtype
        pairs = [taken.sequence(b, dtype) for b in range(len(taken.tok_off) - 1)]
        full.append(torch.stack([k[:, :stay] for k, _ in pairs]), torch.stack([v[:, :stay] for _, v in pairs]))


def appended_order(positions: torch.Tensor, seg: Any, packed: int, prefill_len: int) -> torch.Tensor:
    """The prompt and appended positions of one sequence's tokens in ``seg`` in stored order, ``positions`` being the
    prompt's (its plan's, for this segment's width) and ``packed`` the appended tokens packed there, whose positions
    start at ``prefill_len``: [the prompt's whole chunks, the appended ones, the tail]."""
    if not packed:
        return positions
    cut = positions.shape[0] - positions.shape[0] % seg.chunk_size
    appended = torch.arange(prefill_len, prefill_len + packed, device=positions.device)
    return torch.cat([positions[:cut], appended, positions[cut:]])


def packs_within(store: Any, keep: int, n_tokens: int) -> bool:
    """True when feeding ``n_tokens`` appended tokens to ``store`` one forward each would pack some of them during
    those forwards, where one forward of all ``n_tokens`` packs none until the next (:func:`pack_appended` runs at
    the start of a forward): the two ways then differ. ``store`` None (a layer that builds its store at its first
    decode step) counts as no appended token yet."""
    if n_tokens < 2 or (store is not None and store.packing is None):
        return False
    unpacked = 0 if store is None else store.full.length - store.appended_from
    C = store.segments[store.packing.segment].chunk_size if store is not None else 1
    if unpacked >= keep + C:  # the block's first forward packs these first, either way
        unpacked = keep + (unpacked - keep) % C
    return unpacked + n_tokens - 1 >= keep + C
