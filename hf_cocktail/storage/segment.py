"""The packed chunks of one precision of a layer (:class:`PackedSegment`): keys and values as bit-packed codes with
their scales and zeros, all sequences laid end to end along the token axis: sequence ``b`` owns tokens ``[tok_off[b],
tok_off[b+1])`` and chunks ``[chunk_off[b], chunk_off[b+1])``; within a sequence the chunks keep their original order
and only the last one may be partial.

Shapes: B batch, H_kv key/value heads, N tokens, M chunks (C tokens each), D head dim, G value group size.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_cocktail.storage import key_outliers as outl
from hf_cocktail.storage import params8, quant

_DECODE = params8.decode_params8  # the reference decoder of 8-bit scales and zeros, the default of every decode=
Pair = tuple[torch.Tensor, torch.Tensor]


def _offsets(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


def check_value_bits(bits: int, value_bits: int) -> None:
    """Values may take fewer code bits than keys (never more)."""
    if value_bits not in quant.SUPPORTED_BITS or value_bits > bits:
        allowed = tuple(b for b in quant.SUPPORTED_BITS if b <= bits)
        raise ValueError(f"value_bits must be one of {allowed} for {bits}-bit keys, got {value_bits!r}")


@dataclass
class PackedSegment:
    bits: int
    chunk_size: int
    group_size: int
    k_codes: torch.Tensor  # (H_kv, N, D*bits//8) uint8
    k_scale: torch.Tensor  # (H_kv, M, D): scale_dtype, or uint8 codes with scale_bits=8 (as k_zero, v_scale, v_zero)
    k_zero: torch.Tensor  # (H_kv, M, D)
    v_codes: torch.Tensor  # (H_kv, N, D*value_bits//8) uint8
    v_scale: torch.Tensor  # (H_kv, N, D//G)
    v_zero: torch.Tensor  # (H_kv, N, D//G)
    tok_off: list[int]  # (B+1,)
    chunk_off: list[int]  # (B+1,)
    value_bits: int | None = None  # the values' code width (None: ``bits``, as the keys'); never above ``bits``
    k_block: torch.Tensor | None = None  # (H_kv, M, 3) scale_dtype: 8-bit scales and zeros (params8.encode_params8)
    v_block: torch.Tensor | None = None  # (H_kv, M, 3): the values' blocks, one per chunk as the keys'
    key_outliers: outl.OutlierChannels | None = None  # outlier key channels at 8 bits (.key_outliers: their format)
    _dev_offsets: tuple | None = field(default=None, repr=False)
    _coded_args: tuple | None = field(default=None, repr=False)  # coded_kernel_args, built once (asked every step)

    def __post_init__(self) -> None:
        if self.value_bits is None:
            self.value_bits = self.bits
        check_value_bits(self.bits, self.value_bits)
        if (self.k_block is None) != (self.v_block is None):
            raise ValueError(
                "k_block and v_block come together (8-bit scales and zeros for keys and values) or not at all"
            )

    @classmethod
    def from_sequences(
        cls,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
        bits: int,
        chunk_size: int,
        group_size: int,
        scale_dtype: torch.dtype,
        quantize_keys=None,
        quantize_values=None,
        value_bits: int | None = None,
        scale_bits: int = 16,
        key_outliers: outl.OutlierChannels | None = None,
    ) -> PackedSegment:
        """Quantize and pack per-sequence chunk-ordered segments ``ks[b], vs[b]: (H_kv, N_b, D)``: keys at ``bits``,
        values at ``value_bits`` (default ``bits``; at most ``bits``).

        ``quantize_keys`` / ``quantize_values`` default to the PyTorch reference in :mod:`hf_cocktail.storage.quant`;
        :func:`hf_cocktail.decode.dispatch.quantizers` gives the Triton / fused CPU ones with the same signature.
        ``scale_bits=8`` stores 8-bit scales and zeros (:func:`params8.encode_params8`),
        always quantized by the PyTorch reference; ``key_outliers``: outlier key channels at 8 bits (16-bit scales).
        """
        value_bits = bits if value_bits is None else value_bits
        check_value_bits(bits, value_bits)
        if scale_bits not in quant.SCALE_BITS:
            raise ValueError(f"scale_bits must be one of {quant.SCALE_BITS}, got {scale_bits!r}")
        qk: Callable = quantize_keys or quant.quantize_pack_keys
        qv: Callable = quantize_values or quant.quantize_pack_values
        if scale_bits == 8:
            qk = params8.quantize_pack_keys8
            qv = functools.partial(params8.quantize_pack_values8, chunk_size=chunk_size)
        qk = outl.outlier_quantizer(qk, key_outliers, scale_bits)
        parts = [
            (qk(k, bits, chunk_size, scale_dtype), qv(v, value_bits, group_size, scale_dtype)) for k, v in zip(ks, vs)
        ]
        cat = lambda i, j: torch.cat([p[i][j] for p in parts], dim=1)  # noqa: E731
        k_block, v_block = (cat(0, 3), cat(1, 3)) if scale_bits == 8 else (None, None)
        return cls(
            bits,
            chunk_size,
            group_size,
            cat(0, 0),
            cat(0, 1),
            cat(0, 2),
            cat(1, 0),
            cat(1, 1),
            cat(1, 2),
            _offsets([k.shape[1] for k in ks]),
            _offsets([-(-k.shape[1] // chunk_size) for k in ks]),
            value_bits,
            k_block,
            v_block,
            key_outliers,
        )

    @property
    def scale_bits(self) -> int:
        """16: scales and zeros are stored as numbers; 8: as 8-bit codes on per-block numbers (``k_block``)."""
        return 16 if self.k_block is None else 8

    def key_params(self, c0: int = 0, c1: int | None = None, decode: Callable = _DECODE) -> Pair:
        """Scales and zeros of chunks ``[c0, c1)`` as numbers, ``(H_kv, c1 - c0, D)`` each (with ``scale_bits=8``
        decoded to fp32 by ``decode``: :func:`params8.decode_params8` or a fast one of its signature)."""
        scale, zero = self.k_scale[:, c0:c1], self.k_zero[:, c0:c1]
        if self.k_block is None:
            return scale, zero
        return decode(scale, zero, self.k_block[:, c0:c1]) if scale.numel() else (scale.float(), zero.float())

    def value_params(self, a: int = 0, e: int | None = None, decode: Callable = _DECODE) -> Pair:
        """Scales and zeros of tokens ``[a, e)`` as numbers, ``(H_kv, e - a, D // G)`` each (``decode``: see above)."""
        scale, zero = self.v_scale[:, a:e], self.v_zero[:, a:e]
        if self.v_block is None:
            return scale, zero
        if not scale.numel():  # an empty segment (each decode step of a uniform setting): nothing to decode
            return scale.float(), zero.float()
        return decode(scale, zero, self.v_block, self._token_chunks()[a:e])

    def _token_chunks(self) -> torch.Tensor:
        """``(N,)`` int64: the chunk index of every token (sequence ``b``'s tokens fill its chunks in order)."""
        dev, lengths = self.v_codes.device, [e - s for s, e in zip(self.tok_off, self.tok_off[1:])]
        parts = [torch.arange(n, device=dev) // self.chunk_size + c for n, c in zip(lengths, self.chunk_off)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=dev)

    @property
    def num_tokens(self) -> int:
        return self.tok_off[-1]

    def device_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``tok_off`` and ``chunk_off`` as int32 tensors on the segment's device (cached)."""
        dev = self.k_codes.device
        if self._dev_offsets is None or self._dev_offsets[0].device != dev:
            self._dev_offsets = (
                torch.tensor(self.tok_off, dtype=torch.int32, device=dev),
                torch.tensor(self.chunk_off, dtype=torch.int32, device=dev),
            )
        return self._dev_offsets

    def sequence(self, b: int, out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of sequence ``b``: ``(H_kv, N_b, D)`` each."""
        t0, t1 = self.tok_off[b], self.tok_off[b + 1]
        c0, c1 = self.chunk_off[b], self.chunk_off[b + 1]
        k = outl.segment_keys(self, t0, t1, c0, c1, out_dtype)
        v = quant.dequantize_values(
            self.v_codes[:, t0:t1], *self.value_params(t0, t1), self.value_width, self.group_size, out_dtype
        )
        return k, v

    def tensors(self, decode: Callable = _DECODE) -> list[torch.Tensor]:
        """Codes, scales and zeros as the kernels read them (scales and zeros as numbers, decoded for the call only)."""
        return [self.k_codes, *self.key_params(decode=decode), self.v_codes, *self.value_params(decode=decode)]

    def max_sequence_tokens(self) -> int:
        """The most tokens one sequence owns in this segment."""
        return max((self.tok_off[b + 1] - self.tok_off[b] for b in range(len(self.tok_off) - 1)), default=0)

    @property
    def code_bits(self) -> int | tuple[int, int]:
        """The code widths as the kernels take them: ``bits`` where keys and values share it, else the pair
        ``(bits, value_bits)``."""
        return self.bits if self.value_width == self.bits else (self.bits, self.value_width)

    @property
    def value_width(self) -> int:
        """The values' code width: ``value_bits`` (``__post_init__`` sets it to ``bits`` where it was None)."""
        return self.bits if self.value_bits is None else self.value_bits

    def kernel_args(self, decode: Callable = _DECODE) -> tuple:
        """The segment as the kernel packages (``triton_ops``, ``cpu_ops``) take it: ``(bits, chunk_size,
        group_size, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tok_off, chunk_off)`` with ``bits`` as
        :attr:`code_bits` (an int, or ``(key_bits, value_bits)``) and the offsets as int32 tensors ``(B+1,)`` on the
        segment's device. ``decode``: see :meth:`key_params`."""
        return (self.code_bits, self.chunk_size, self.group_size, *self.tensors(decode), *self.device_offsets())

    def coded_kernel_args(self) -> tuple:
        """:meth:`kernel_args` for a kernel that reads 8-bit scales and zeros itself (``cpu_ops``): with
        ``scale_bits=8`` the uint8 scale and zero codes in place of the numbers, then ``k_block``, ``v_block`` as
        items 12 and 13; otherwise :meth:`kernel_args`. Nothing is decoded here; the
        tuple is built once (a segment's tensors do not change after prefill)."""
        if self._coded_args is None or self._coded_args[3].device != self.k_codes.device:
            self._coded_args = self._coded_kernel_args()
        return self._coded_args

    def _coded_kernel_args(self) -> tuple:
        if self.k_block is None or not self.k_scale.numel() or not self.v_scale.numel():
            return self.kernel_args()
        codes = (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero)
        return (
            self.code_bits,
            self.chunk_size,
            self.group_size,
            *codes,
            *self.device_offsets(),
            self.k_block,
            self.v_block,
        )

    def select(self, indices: list[int]) -> PackedSegment:
        """The segment holding sequences ``indices`` (reordered / repeated) of this one."""
        tok = [slice(self.tok_off[i], self.tok_off[i + 1]) for i in indices]
        chk = [slice(self.chunk_off[i], self.chunk_off[i + 1]) for i in indices]

        def cat(t: torch.Tensor, sl: list[slice]) -> torch.Tensor:
            return torch.cat([t[:, s] for s in sl], dim=1) if sl else t[:, :0]

        return PackedSegment(
            self.bits,
            self.chunk_size,
            self.group_size,
            cat(self.k_codes, tok),
            cat(self.k_scale, chk),
            cat(self.k_zero, chk),
            cat(self.v_codes, tok),
            cat(self.v_scale, tok),
            cat(self.v_zero, tok),
            _offsets([s.stop - s.start for s in tok]),
            _offsets([s.stop - s.start for s in chk]),
            self.value_bits,
            None if self.k_block is None else cat(self.k_block, chk),
            None if self.v_block is None else cat(self.v_block, chk),
            self.key_outliers,
        )

    def nbytes_codes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.v_codes))

    def nbytes_params(self) -> int:
        params = [self.k_scale, self.k_zero, self.v_scale, self.v_zero]
        params += [t for t in (self.k_block, self.v_block, outl.channels_of(self.key_outliers)) if t is not None]
        return sum(t.numel() * t.element_size() for t in params)

    def index_bytes(self) -> int:
        """The offsets cached on the device (:meth:`device_offsets`), two ``(B+1,)`` int32 tensors once read."""
        return sum(t.numel() * t.element_size() for t in self._dev_offsets or ())
