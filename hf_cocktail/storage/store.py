"""Per-layer storage of a Cocktail cache: a full-precision part plus packed segments (INT4 and INT2, or INT4 and INT3).

Shapes: B batch, H_kv key/value heads, D head dim, C chunk size, G value group size.

* the full part (:mod:`hf_cocktail.storage.full_part`) holds every token outside the packed chunks (FP16 context
  chunks, the template and question tokens, generated tokens) as ``(B, H_kv, R, D)``, right-aligned: sequence ``b`` owns
  ``[start[b], R)``; at the model's precision or as 8-bit codes (``full_part_bits``).
* a :class:`~hf_cocktail.storage.segment.PackedSegment` holds the chunks of one precision (4, 3 or 2 bits) of all
  sequences laid end to end along the token axis (:mod:`hf_cocktail.storage.segment`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_cocktail.storage import key_outliers as outl
from hf_cocktail.storage import quant
from hf_cocktail.storage.full_part import FullPart, Int8FullPart, full_part_from_sequences
from hf_cocktail.storage.generated import AppendedPacking, appended_order
from hf_cocktail.storage.key_centering import centered, rows_of, uncentered
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.segment import PackedSegment, check_value_bits  # noqa: F401 (re-exported)


class DerivedCache(dict):
    """Values derived from a store's tensors, remade on demand: a copy of the store (``copy.deepcopy``) starts
    empty instead of duplicating the tensors they alias (the rotation's shared matrices)."""

    def __deepcopy__(self, memo: dict) -> DerivedCache:
        return DerivedCache()


@dataclass
class LayerStore:
    """Everything one layer holds after prefill: the full-precision part and the INT4 / INT2 segments."""

    full: FullPart | Int8FullPart
    segments: list[PackedSegment]  # INT4 then the low precision; a segment may hold 0 tokens
    rotation: Rotation | None = None  # everything stored (full part included) is rotated by it
    key_mean: torch.Tensor | None = None  # (B, H_kv, 1, D): every key stored minus it (.key_centering), or None
    # what the decode dispatch derives from the store once (its backend choice, the kernel's checked arguments), by
    # key; valid while ``segments`` and ``rotation`` are the same objects (the dispatch checks)
    kernel_cache: DerivedCache = field(default_factory=lambda: DerivedCache(), repr=False, compare=False)
    # tokens appended after the prefill (:mod:`.generated`): how they are packed (None: never), the full part's index
    # where they begin (-1: its length at construction) and how many per sequence were packed (all sequences alike)
    packing: AppendedPacking | None = None
    appended_from: int = -1
    packed_appended: int = 0

    def __post_init__(self) -> None:
        if self.appended_from < 0:
            self.appended_from = self.full.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``(B, H_kv, L_new, D)`` new tokens (rotated like the rest) to the full-precision part. A part with a
        fused writer (8-bit or at the model's precision) rotates them inside the writer (the same bits as
        :meth:`Rotation.rotate_pair`, one call per layer and step)."""
        rotation, full, k = self.rotation, self.full, centered(k, self.key_mean)
        if rotation is None:
            full.append(k, v)
        elif full.rotates_appends:
            full.append(k, v, (rotation.keys, rotation.values))
        else:
            full.append(*rotation.rotate_pair(k, v))

    def nbytes(self) -> int:
        """Every byte this store's tensors hold but the rotation matrices and the full part's key basis (shared
        with other layers and caches, so a cache counts each once: :meth:`CocktailCache.nbytes`): codes, scales and
        zeros, the full part with its room for appended tokens, and the offsets cached on the device."""
        packed = sum(s.nbytes_codes() + s.nbytes_params() for s in self.segments) + self.key_mean_bytes()
        return self.full.nbytes() + self.full.reserved_bytes() + packed + self.index_bytes()

    def key_mean_bytes(self) -> int:
        return 0 if self.key_mean is None else self.key_mean.numel() * self.key_mean.element_size()

    def index_bytes(self) -> int:
        return self.full.index_bytes() + sum(s.index_bytes() for s in self.segments)

    @classmethod
    def build(
        cls,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: list[dict],
        chunk_size: int,
        group_size: int,
        scale_dtype: torch.dtype,
        quantize_keys: Callable | None = None,
        quantize_values: Callable | None = None,
        rotation: Rotation | None = None,
        max_value_bits: int | None = None,
        scale_bits: int = 16,
        full_part_bits: int = 16,
        key_outlier_share: float = 0.0,
        key_mean: torch.Tensor | None = None,
        full_key_basis: torch.Tensor | None = None,
        exact_tokens: int = 0,
    ) -> LayerStore:
        """Store a prefill: ``k, v (B, H_kv, L, D)``; ``positions[b]`` maps ``"full"`` and each packed bit width to
        the prompt positions of sequence ``b`` that go there (chunk order kept). With ``rotation`` everything is
        stored rotated (:mod:`.rotation`); that ``key_outlier_share`` of key channels at 8 bits (:mod:`.key_outliers`);
        ``max_value_bits`` caps the values' code width (``None``: values get their chunk's bits, as keys do);
        ``scale_bits=8`` stores 8-bit scales and zeros; ``full_part_bits=8`` the full part as 8-bit codes;
        ``key_mean (B, H_kv, 1, D)``: keys stored minus it (:mod:`.key_centering`); ``full_key_basis (H_kv, D, D)``:
        an 8-bit full part's keys in a basis of their own, ``exact_tokens``: its first tokens of each sequence at the
        model's precision too (:class:`~.full_part.Int8FullPart`)."""
        k = centered(k, key_mean)
        if rotation is not None:
            k, v = rotation.rotate_keys(k), rotation.rotate_values(v)
        fulls_k, fulls_v = [], []
        packed_bits = [p for p in positions[0] if p != "full"] if positions else list(quant.PACKED_BITS)
        segs: dict[int, tuple[list, list]] = {bits: ([], []) for bits in packed_bits}
        for b, pos in enumerate(positions):
            pos = {p: t.to(k.device) for p, t in pos.items()}
            fulls_k.append(k[b].index_select(1, pos["full"]))
            fulls_v.append(v[b].index_select(1, pos["full"]))
            for bits in packed_bits:
                segs[bits][0].append(k[b].index_select(1, pos[bits]))
                segs[bits][1].append(v[b].index_select(1, pos[bits]))
        scores = outl.layer_channel_scores(segs, chunk_size, key_outlier_share)
        packed = [
            PackedSegment.from_sequences(
                *segs[bits],
                bits,
                chunk_size,
                group_size,
                scale_dtype,
                quantize_keys,
                quantize_values,
                bits if max_value_bits is None else min(bits, max_value_bits),
                scale_bits,
                outl.segment_outliers(scores, key_outlier_share, bits),
            )
            for bits in packed_bits
        ]
        full = full_part_from_sequences(fulls_k, fulls_v, full_part_bits, scale_dtype, full_key_basis, exact_tokens)
        return cls(full, packed, rotation, key_mean)

    def dequantized(self, positions: list[dict], seq_len: int, prefill_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer at the model's precision in original token order, ``(B, H_kv, seq_len, D)`` each, left
        padding as zeros; tokens from ``prefill_len`` on are the appended ones (see :meth:`build`)."""
        full, full_k, full_v = self.full, self.full.keys, self.full.values
        B, H, _, D = full_k.shape
        keys = full_k.new_zeros((B, H, seq_len, D))
        values = torch.zeros_like(keys)
        dev = keys.device
        G, gen = self.packed_appended, self.packing.segment if self.packing else -1  # appended tokens packed, where
        for b, pos in enumerate(positions):
            fpos = torch.cat([pos["full"].to(dev), torch.arange(prefill_len + G, seq_len, device=dev)])
            keys[b, :, fpos] = full_k[b, :, full.start[b] :]
            values[b, :, fpos] = full_v[b, :, full.start[b] :]
            for i, seg in enumerate(self.segments):
                k_b, v_b = seg.sequence(b, keys.dtype)
                p = appended_order(pos[seg.bits].to(dev), seg, G if i == gen else 0, prefill_len)
                keys[b, :, p] = k_b
                values[b, :, p] = v_b
        if self.rotation is not None:
            keys, values = self.rotation.unrotate_keys(keys), self.rotation.unrotate_values(values)
        return uncentered(keys, self.key_mean), values

    def select(self, indices: list[int], same_packed: bool = False) -> LayerStore:
        """Keep (and reorder / repeat) sequences ``indices``. ``same_packed``: each new row comes from the same prompt
        as the old row at its place (beams of one prompt), so only the full-precision part moves (and the packed
        segments too once appended tokens were packed into them)."""
        moved = not same_packed or self.packed_appended  # beams' packed appended tokens differ
        segments = [seg.select(indices) for seg in self.segments] if moved else self.segments
        new = LayerStore(self.full.select(indices), segments, self.rotation, rows_of(self.key_mean, indices))
        new.packing = self.packing
        new.appended_from, new.packed_appended = self.appended_from, self.packed_appended
        return new
