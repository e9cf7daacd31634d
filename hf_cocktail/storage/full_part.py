"""The full part of a layer's storage: the tokens outside the packed chunks (template, question, FP16 chunks, sink
and salient tokens, generated tokens), at the model's precision or as 8-bit codes.

Shapes: B batch, H_kv key/value heads, R tokens of the part (right-aligned: sequence ``b`` owns ``[start[b], R)``;
left padding is never stored as a valid token), D head dim.

* :class:`FullPart` holds them at the model's precision, ``(B, H_kv, R, D)``.
* :class:`Int8FullPart` (``CocktailConfig(full_part_bits=8)``) holds 8-bit codes and one scale per token and head
  (:func:`hf_cocktail.storage.quant.quantize_tokens8`): 8 + 16/D bits per element instead of 16. Its ``keys`` and
  ``values`` are dequantized on each read (the PyTorch attention reads them once per step; the fused kernels read the
  codes and scales themselves; ``update`` hands out the codes, :meth:`Int8FullPart.split_path_tensors`), so the codes
  are all it keeps. Where the layer's keys are stored unrotated beside rotated values, its keys get a basis of their
  own (:attr:`Int8FullPart.key_basis`, the values' Hadamard rotation, which the layer holds anyway:
  :func:`~.rotation.full_part_key_basis`): one scale per token cannot serve a few large channels and many small ones
  at once, and a rotation spreads them (on Gemma 3 270M, 2K tokens, every global-layer key at 8 bits this way: KL
  divergence from FP16 2.1e-4 unrotated, 4.4e-5 rotated, keys centred in both; the lab log, issue 46).
  Its first tokens of every sequence (the prompt's sink tokens) also stay at the model's precision
  (:mod:`.exact_head`).
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field, fields, replace

import torch

from hf_cocktail.storage import quant
from hf_cocktail.storage.exact_head import ExactHead
from hf_cocktail.storage.rotation import per_head

# a fused 8-bit writer (cpu_ops.append_tokens8): (k, v, (key codes, value codes), (key scales, value scales), pos,
# rotation=(key matrices, value matrices) or None) -> the four buffers' views of their first pos + L tokens
Write8 = Callable[..., list]
# a fused writer at the model's precision (cpu_ops.append_tokens): (k, v, (key buffer, value buffer), pos,
# rotation=(key matrices, value matrices) or None) -> the two buffers' views of their first pos + L tokens
Write = Callable[..., list]
HEADROOM_STEP = 16  # tokens of room the first append after the prefill reserves (then: half the tokens appended)


@dataclass
class FullPart:
    keys: torch.Tensor  # (B, H_kv, R, D)
    values: torch.Tensor  # (B, H_kv, R, D)
    start: list[int]  # (B,) first valid index per sequence
    _start_t: torch.Tensor | None = field(default=None, repr=False)
    _buffers: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # (B, H_kv, capacity, D)
    _base: int | None = field(default=None, repr=False)  # the length before the first append (the prefill's)
    # a fused writer with the signature of cpu_ops.append_tokens (the decode dispatch sets it where it runs), or None
    write: Write | None = field(default=None, repr=False)
    key_basis = None  # keys are stored in the layer's basis (see Int8FullPart.key_basis)

    @classmethod
    def from_sequences(cls, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> FullPart:
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

    def append(self, k: torch.Tensor, v: torch.Tensor, rotation: tuple | None = None) -> None:
        """Append ``(B, H_kv, L_new, D)`` new tokens for every sequence. ``keys``/``values`` are views of buffers
        whose room beyond the tokens (:meth:`reserved_bytes`) is proportionate to what was appended, not to the
        prefill: :data:`HEADROOM_STEP` tokens at the first append, then half the tokens appended so far (the appended
        part grows 1.5x per copy), so a long generation copies the part O(log) times instead of once per step.

        With :attr:`write` set, one call of the fused writer makes the same copies (and views); ``rotation``: ``(key
        matrices, value matrices)`` for it to rotate ``k`` and ``v`` first, with the bits of ``Rotation.rotate_pair``
        (the reference path takes tokens already rotated)."""
        R, n = self.length, k.shape[2]
        write = self.write
        if write is not None:
            if k.stride(-1) != 1 or v.stride(-1) != 1:  # the writer reads rows of D
                k, v = k.contiguous(), v.contiguous()
            self.keys, self.values = write(k, v, self.reserve(n), R, rotation)
            return
        if rotation is not None:
            raise ValueError("FullPart.append: rotation= needs the fused writer (write); rotate k, v first")
        buf_k, buf_v = self.reserve(n)
        buf_k.narrow(2, R, n).copy_(k)
        buf_v.narrow(2, R, n).copy_(v)
        self.advance(n)

    def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers ``(B, H_kv, capacity, D)``, grown (:meth:`append`'s rule) so that tokens
        ``[length, length + n)`` fit; :meth:`advance` then makes written tokens part of ``keys`` / ``values``."""
        R = self.length
        if self._buffers is None or R + n > self._buffers[0].shape[2]:
            B, H, _, D = self.keys.shape
            base = R if self._base is None else self._base
            self._base = base
            capacity = R + n + max(HEADROOM_STEP, (R + n - base) // 2)
            bufs = tuple(t.new_empty((B, H, capacity, D)) for t in (self.keys, self.values))
            bufs[0][:, :, :R], bufs[1][:, :, :R] = self.keys, self.values
            self._buffers = (bufs[0], bufs[1])
        return self._buffers

    def advance(self, n: int, views: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The ``n`` tokens written after ``length`` into the :meth:`reserve` d buffers join the part. ``views``: the
        key and value buffers' views of their first ``length + n`` tokens where the writer made them (the fused 8-bit
        writer returns them); else they are made here."""
        if self._buffers is None:
            raise RuntimeError("FullPart.advance without reserve")
        if views is not None:
            self.keys, self.values = views
            return
        end = self.length + n
        self.keys, self.values = self._buffers[0].narrow(2, 0, end), self._buffers[1].narrow(2, 0, end)

    def truncate(self, n: int) -> None:
        """Drop the last ``n`` tokens (their buffer room is reused by the next append)."""
        self.keys, self.values = self.keys.narrow(2, 0, self.length - n), self.values.narrow(2, 0, self.length - n)

    def tokens(self, at: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[at, at + n)`` of every sequence, ``(B, H_kv, n, D)`` keys and values (views)."""
        return self.keys.narrow(2, at, n), self.values.narrow(2, at, n)

    def remove(self, at: int, n: int) -> None:
        """Drop tokens ``[at, at + n)`` of every sequence (each must own them: ``at >= max(start)``); the tokens after
        them move down ``n`` places, within the buffers where the part has them (one copy of those later tokens:
        the residual window, when the dropped ones were packed), so the room stays for the next appends; where the
        room left would exceed the tokens held (a long turn appended at once, then packed), the part moves to
        buffers with half its tokens' room instead (one copy of the part)."""
        R = self.length
        if n == 0:
            return
        if self._buffers is None:
            self.keys, self.values = (
                torch.cat([t[:, :, :at], t[:, :, at + n :]], dim=2) for t in (self.keys, self.values)
            )
            return
        bufs = self._buffers
        if bufs[0].shape[2] - (R - n) > max(HEADROOM_STEP, R - n):  # a bulk append's room, now packed: give it back
            room = max(HEADROOM_STEP, (R - n) // 2)
            shape = (*bufs[0].shape[:2], R - n + room, bufs[0].shape[3])
            new_k, new_v = bufs[0].new_empty(shape), bufs[1].new_empty(shape)
            for new, old in ((new_k, bufs[0]), (new_v, bufs[1])):
                new[:, :, :at], new[:, :, at : R - n] = old[:, :, :at], old[:, :, at + n : R]
            bufs = self._buffers = (new_k, new_v)
        else:
            for buf in bufs:
                buf[:, :, at : R - n] = buf[:, :, at + n : R].clone()
        self.keys, self.values = bufs[0].narrow(2, 0, R - n), bufs[1].narrow(2, 0, R - n)

    def reserved_bytes(self) -> int:
        """Buffer capacity held beyond the valid tokens (room for the next appended tokens)."""
        if self._buffers is None:
            return 0
        return sum(b.numel() * b.element_size() for b in self._buffers) - self.nbytes()

    def reserved_deployed_bytes(self) -> int:
        """:meth:`reserved_bytes` in an FP16 deployment: 2 per element whatever the dtype here."""
        if self._buffers is None:
            return 0
        return 2 * sum(b.numel() for b in self._buffers) - self.deployed_bytes()

    def index_bytes(self) -> int:
        """The cached ``start`` tensor (:meth:`start_tensor`), ``(B,)`` int32."""
        return 0 if self._start_t is None else self._start_t.numel() * self._start_t.element_size()

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

    def deployed_bytes(self) -> int:
        """Bytes in an FP16 deployment: 2 per key/value element whatever the dtype here."""
        return 2 * (self.keys.numel() + self.values.numel())

    @property
    def shape(self) -> torch.Size:
        """``(B, H_kv, R, D)``."""
        return self.keys.shape

    @property
    def rotates_appends(self) -> bool:
        """Whether :meth:`append` takes the storage rotation and rotates the new tokens itself (a fused writer set)."""
        return self.write is not None

    def split_path_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decode ``update`` returns on the split path, where attention reads the store, not these: the keys
        and values themselves (views, no copy)."""
        return self.keys, self.values

    def select(self, indices: list[int]) -> FullPart:
        """The part holding sequences ``indices`` (reordered / repeated) of this one."""
        idx = torch.tensor(indices, dtype=torch.long, device=self.keys.device)
        return FullPart(
            self.keys.index_select(0, idx),
            self.values.index_select(0, idx),
            [self.start[i] for i in indices],
            write=self.write,
        )


@dataclass
class Int8FullPart:
    """The full part as 8-bit codes: two :class:`FullPart` of the same tokens, the int8 codes ``(B, H_kv, R, D)``
    and their scales ``(B, H_kv, R, 1)`` (so appending, cropping and row selection are :class:`FullPart`'s own);
    ``keys`` / ``values`` dequantize to ``dtype``, in the layer's basis.

    ``key_basis``: ``(H_kv, D, D)`` fp32 orthonormal matrices ``F`` (one per KV head), or None. With them the codes
    are those of ``k·F`` (``k`` in the layer's basis): :attr:`keys` turns them back (``·Fᵀ``), and a kernel that reads
    the codes scores them with the query ``q·F`` (:meth:`key_query`), as ``(q·F)·(k·F) = q·k``.

    ``head``: the first tokens of every sequence at the model's precision (:class:`~.exact_head.ExactHead`, keys in
    the layer's basis), read instead of their codes; or None."""

    codes: FullPart
    scales: FullPart
    dtype: torch.dtype
    # a fused writer with the signature of cpu_ops.append_tokens8 (the decode dispatch sets it where it runs), or None
    write8: Write8 | None = field(default=None, repr=False)
    key_basis: torch.Tensor | None = field(default=None, repr=False)  # (H_kv, D, D) fp32, shared: never modified
    head: ExactHead | None = field(default=None, repr=False)

    @classmethod
    def from_sequences(
        cls,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
        scale_dtype: torch.dtype,
        key_basis: torch.Tensor | None = None,
        exact_tokens: int = 0,
    ) -> Int8FullPart:
        """``ks[b]``, ``vs[b]``: ``(H_kv, R_b, D)`` -> right-aligned codes and scales; ``key_basis``: the keys' own
        basis (the class docstring), or None; ``exact_tokens``: the first tokens of each sequence kept at the model's
        precision too (the :attr:`head`)."""
        qk = [quant.quantize_tokens8(per_head(k[None], key_basis)[0], scale_dtype) for k in ks]
        qv = [quant.quantize_tokens8(v, scale_dtype) for v in vs]
        codes = FullPart.from_sequences([c for c, _ in qk], [c for c, _ in qv])
        scales = FullPart.from_sequences([s for _, s in qk], [s for _, s in qv])
        head = ExactHead.from_sequences(ks, vs, exact_tokens)
        return cls(codes, scales, ks[0].dtype, key_basis=key_basis, head=head)

    @property
    def keys(self) -> torch.Tensor:
        """``(B, H_kv, R, D)`` in ``dtype``, in the layer's basis (left padding dequantizes to zeros)."""
        return self._exact(self._keys(self.codes.keys, self.scales.keys), "k")

    def _exact(self, x: torch.Tensor, which: str, at: int = 0) -> torch.Tensor:
        """``x``, the part's tokens from ``at`` on, with the :attr:`head`'s rows in place of their codes'."""
        return x if self.head is None else self.head.overlay(x, which, self.start, at)

    def _keys(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if self.key_basis is None:
            return quant.dequantize_tokens8(codes, scales, self.dtype)
        keys = quant.dequantize_tokens8(codes, scales, torch.float32)
        return per_head(keys, self.key_basis, transpose=True, out_dtype=self.dtype)

    def __deepcopy__(self, memo: dict) -> Int8FullPart:
        """A copy shares the key basis (never modified; often the layer's rotation matrices, shared too)."""
        memo[id(self.key_basis)] = self.key_basis
        return replace(self, **{f.name: deepcopy(getattr(self, f.name), memo) for f in fields(self)})

    def key_query(self, query: torch.Tensor) -> torch.Tensor | None:
        """The query a kernel reading the key codes scores them with: ``query (B, H_q, L_q, D)`` (in the layer's
        basis) times :attr:`key_basis`, fp32; None without a basis of their own (the layer's query serves)."""
        return None if self.key_basis is None else per_head(query, self.key_basis, out_dtype=torch.float32)

    @property
    def values(self) -> torch.Tensor:
        return self._exact(quant.dequantize_tokens8(self.codes.values, self.scales.values, self.dtype), "v")

    @property
    def start(self) -> list[int]:
        return self.codes.start

    @property
    def length(self) -> int:
        return self.codes.length

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def split_path_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decode ``update`` returns on the split path, where attention reads the store, not these: the int8
        codes (views), so that the part is dequantized once per step, by the attention that reads it."""
        return self.codes.keys, self.codes.values

    def append(self, k: torch.Tensor, v: torch.Tensor, rotation: tuple | None = None) -> None:
        """Quantize and append ``(B, H_kv, L_new, D)`` new tokens for every sequence. Unchecked (no device sync per
        step, as the 16-bit part): a non-finite state or a scale beyond its dtype gives NaN keys/values, which
        the attention output shows. With :attr:`write8` set, one call of the fused writer writes the same codes and
        scales into the buffers; else the PyTorch reference.

        ``rotation``: ``(key matrices, value matrices)`` of a :class:`~hf_cocktail.storage.rotation.Rotation` (each
        ``(H_kv, D, D)`` or None), for the fused writer to rotate ``k`` and ``v`` first, with the bits of
        ``Rotation.rotate_pair`` (:meth:`LayerStore.append <hf_cocktail.storage.store.LayerStore.append>` passes it
        where :attr:`write8` is set; the reference path takes tokens already rotated)."""
        write8, basis = self.write8, self.key_basis
        if write8 is None:
            if rotation is not None:
                raise ValueError("Int8FullPart.append: rotation= needs the fused writer (write8); rotate k, v first")
            if basis is not None:
                k = per_head(k, basis, out_dtype=v.dtype)
            codes, scales = quant.quantize_tokens8(torch.stack([k, v]), self.scales.keys.dtype, check=False)
            self.codes.append(codes[0], codes[1])
            self.scales.append(scales[0], scales[1])
            return
        n = k.shape[2]
        if basis is not None:  # the layer's keys are unrotated (their matrices None): the keys' own basis instead
            rotation = (basis, None if rotation is None else rotation[1])
        if k.stride(-1) != 1 or v.stride(-1) != 1:  # the writer reads rows of D
            k, v = k.contiguous(), v.contiguous()
        views = write8(k, v, self.codes.reserve(n), self.scales.reserve(n), self.codes.length, rotation)
        self.codes.advance(n, (views[0], views[1]))
        self.scales.advance(n, (views[2], views[3]))

    def truncate(self, n: int) -> None:
        self.codes.truncate(n)
        self.scales.truncate(n)
        if self.head is not None:
            self.head = self.head.truncated(self.length - max(self.start))

    def tokens(self, at: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[at, at + n)`` of every sequence dequantized to ``dtype``, ``(B, H_kv, n, D)`` keys and values."""
        (kc, vc), (ks, vs) = self.codes.tokens(at, n), self.scales.tokens(at, n)
        keys, values = self._keys(kc, ks), quant.dequantize_tokens8(vc, vs, self.dtype)
        return self._exact(keys, "k", at), self._exact(values, "v", at)

    def remove(self, at: int, n: int) -> None:
        """:meth:`FullPart.remove` of the codes and their scales (never of :attr:`head` tokens: the oldest ones)."""
        if self.head is not None and n and at < max(self.start) + self.head.count:
            raise ValueError(f"tokens from {at} include exact head tokens (up to {max(self.start) + self.head.count})")
        self.codes.remove(at, n)
        self.scales.remove(at, n)

    def start_tensor(self) -> torch.Tensor:
        return self.codes.start_tensor()

    def valid_tokens(self) -> int:
        return self.codes.valid_tokens()

    def nbytes(self) -> int:
        return self.codes.nbytes() + self.scales.nbytes() + (0 if self.head is None else self.head.nbytes())

    def deployed_bytes(self) -> int:
        """The codes and scales as held (scales in their storage dtype, 2 bytes for the default float16), the
        :attr:`head` at 2 bytes per element."""
        head = 0 if self.head is None else self.head.deployed_bytes()
        return self.codes.nbytes() + self.scales.nbytes() + head

    def reserved_bytes(self) -> int:
        return self.codes.reserved_bytes() + self.scales.reserved_bytes()

    def reserved_deployed_bytes(self) -> int:
        """The room as held (codes are 1 byte, scales in their storage dtype)."""
        return self.reserved_bytes()

    def index_bytes(self) -> int:
        return self.codes.index_bytes() + self.scales.index_bytes()

    @property
    def rotates_appends(self) -> bool:
        """Whether :meth:`append` takes the storage rotation and rotates the new tokens itself (a fused writer set)."""
        return self.write8 is not None

    def select(self, indices: list[int]) -> Int8FullPart:
        head = None if self.head is None else self.head.select(indices)
        return Int8FullPart(
            self.codes.select(indices), self.scales.select(indices), self.dtype, self.write8, self.key_basis, head
        )


def full_part_from_sequences(
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    bits: int,
    scale_dtype: torch.dtype,
    key_basis: torch.Tensor | None = None,
    exact_tokens: int = 0,
) -> FullPart | Int8FullPart:
    """The full part of ``ks[b]``, ``vs[b]`` (``(H_kv, R_b, D)``) at ``bits`` (:data:`quant.FULL_PART_BITS`);
    ``key_basis``, ``exact_tokens``: an 8-bit part's keys' own basis and exact first tokens (:class:`Int8FullPart`)."""
    if bits not in quant.FULL_PART_BITS:
        raise ValueError(f"full_part_bits must be one of {quant.FULL_PART_BITS}, got {bits!r}")
    if bits == 16:
        return FullPart.from_sequences(ks, vs)
    return Int8FullPart.from_sequences(ks, vs, scale_dtype, key_basis, exact_tokens)
