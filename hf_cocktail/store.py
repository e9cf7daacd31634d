"""Per-layer storage of a Cocktail cache: a full-precision part plus packed INT4 and INT2 segments.

Shapes: B batch, H_kv key/value heads, D head dim, C chunk size, G value group size.

* :class:`FullPart` holds every token kept at the model's precision (FP16 context chunks, the template and question
  tokens, generated tokens) as ``(B, H_kv, R, D)``, right-aligned: sequence ``b`` owns ``[start[b], R)``. Left
  padding is never stored as a valid token.
* :class:`PackedSegment` holds the chunks of one precision (4 or 2 bits) of all sequences laid end to end along the
  token axis: sequence ``b`` owns tokens ``[tok_off[b], tok_off[b+1])`` and chunks ``[chunk_off[b], chunk_off[b+1])``;
  within a sequence the chunks keep their original order and only the last one may be partial.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import quant


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass
class FullPart:
    keys: torch.Tensor  # (B, H_kv, R, D)
    values: torch.Tensor  # (B, H_kv, R, D)
    start: list[int]  # (B,) first valid index per sequence
    _start_t: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_sequences(cls, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> "FullPart":
        """``ks[b]``, ``vs[b]``: ``(H_kv, R_b, D)`` -> right-aligned ``(B, H_kv, max R_b, D)``."""
        R = max(k.shape[1] for k in ks)
        H, D = ks[0].shape[0], ks[0].shape[2]
        keys = ks[0].new_zeros((len(ks), H, R, D))
        values = vs[0].new_zeros((len(vs), H, R, D))
        start = []
        for b, (k, v) in enumerate(zip(ks, vs)):
            s = R - k.shape[1]
            keys[b, :, s:] = k
            values[b, :, s:] = v
            start.append(s)
        return cls(keys, values, start)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``(B, H_kv, L_new, D)`` new tokens for every sequence."""
        self.keys = torch.cat([self.keys, k.to(self.keys.dtype)], dim=2)
        self.values = torch.cat([self.values, v.to(self.values.dtype)], dim=2)

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def start_tensor(self) -> torch.Tensor:
        if self._start_t is None or self._start_t.device != self.keys.device:
            self._start_t = torch.tensor(self.start, dtype=torch.int32, device=self.keys.device)
        return self._start_t

    def valid_tokens(self) -> int:
        return sum(self.length - s for s in self.start)

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class PackedSegment:
    bits: int
    chunk_size: int
    group_size: int
    k_codes: torch.Tensor  # (H_kv, N, D*bits//8) uint8
    k_scale: torch.Tensor  # (H_kv, M, D)
    k_zero: torch.Tensor  # (H_kv, M, D)
    v_codes: torch.Tensor  # (H_kv, N, D*bits//8) uint8
    v_scale: torch.Tensor  # (H_kv, N, D//G)
    v_zero: torch.Tensor  # (H_kv, N, D//G)
    tok_off: list[int]  # (B+1,)
    chunk_off: list[int]  # (B+1,)
    _dev_offsets: tuple | None = field(default=None, repr=False)

    @classmethod
    def from_sequences(cls, ks: list[torch.Tensor], vs: list[torch.Tensor], bits: int, chunk_size: int,
                       group_size: int, scale_dtype: torch.dtype, quantize_keys=None,
                       quantize_values=None) -> "PackedSegment":
        """Quantize and pack per-sequence chunk-ordered segments ``ks[b], vs[b]: (H_kv, N_b, D)``.

        ``quantize_keys`` / ``quantize_values`` default to the PyTorch reference in :mod:`hf_cocktail.quant`; the
        Triton launchers have the same signatures.
        """
        qk = quantize_keys or quant.quantize_pack_keys
        qv = quantize_values or quant.quantize_pack_values
        parts = [(qk(k, bits, chunk_size, scale_dtype), qv(v, bits, group_size, scale_dtype)) for k, v in zip(ks, vs)]
        cat = lambda i, j: torch.cat([p[i][j] for p in parts], dim=1)  # noqa: E731
        return cls(bits, chunk_size, group_size,
                   cat(0, 0), cat(0, 1), cat(0, 2), cat(1, 0), cat(1, 1), cat(1, 2),
                   _offsets([k.shape[1] for k in ks]), _offsets([-(-k.shape[1] // chunk_size) for k in ks]))

    @property
    def num_tokens(self) -> int:
        return self.tok_off[-1]

    def device_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``tok_off`` and ``chunk_off`` as int32 tensors on the segment's device (cached)."""
        dev = self.k_codes.device
        if self._dev_offsets is None or self._dev_offsets[0].device != dev:
            self._dev_offsets = (torch.tensor(self.tok_off, dtype=torch.int32, device=dev),
                                 torch.tensor(self.chunk_off, dtype=torch.int32, device=dev))
        return self._dev_offsets

    def sequence(self, b: int, out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of sequence ``b``: ``(H_kv, N_b, D)`` each."""
        t0, t1 = self.tok_off[b], self.tok_off[b + 1]
        c0, c1 = self.chunk_off[b], self.chunk_off[b + 1]
        k = quant.dequantize_keys(self.k_codes[:, t0:t1], self.k_scale[:, c0:c1], self.k_zero[:, c0:c1], self.bits,
                                  self.chunk_size, out_dtype)
        v = quant.dequantize_values(self.v_codes[:, t0:t1], self.v_scale[:, t0:t1], self.v_zero[:, t0:t1],
                                    self.bits, self.group_size, out_dtype)
        return k, v

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero]

    def nbytes_codes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.v_codes))

    def nbytes_params(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_scale, self.k_zero, self.v_scale, self.v_zero))


@dataclass
class LayerStore:
    """Everything one layer holds after prefill: the full-precision part and the INT4 / INT2 segments."""

    full: FullPart
    segments: list[PackedSegment]  # INT4 then INT2; a segment may hold 0 tokens

    def nbytes(self) -> int:
        return self.full.nbytes() + sum(s.nbytes_codes() + s.nbytes_params() for s in self.segments)
