"""Rotated storage: a fixed orthonormal per-head transform applied to keys and/or values before quantization.

An orthonormal ``R`` keeps attention exact: ``q·k = (qR)·(kR)`` and ``Σ p·v = (Σ p·vR)·Rᵀ``, while spreading channel
outliers so low-bit codes lose far less (QuaRot, RotateKV, llama.cpp's KV rotation). ``"hadamard"``: ``R_h =
diag(s_h)·H/√D`` with ``H`` the Sylvester Hadamard matrix and ``s_h`` random signs seeded per KV head ``h``. Head
dims that are not a power of two get a seeded random orthogonal matrix instead (QR of a Gaussian).

Shapes: B batch, H_q query heads, H_kv key/value heads (``H_q = n_rep * H_kv``), T tokens, D head dim.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

ROTATIONS = (None, "hadamard", "hadamard_keys", "hadamard_values")


def hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (entries ±1), fp64; ``n`` a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def orthonormal_matrices(num_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """``(H_kv, D, D)`` fp32 orthonormal matrices, one per KV head, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    if head_dim & (head_dim - 1) == 0:
        signs = torch.randint(0, 2, (num_heads, head_dim, 1), generator=g, dtype=torch.float64) * 2 - 1
        mats = signs * hadamard(head_dim) / head_dim**0.5
    else:  # fallback: random orthogonal (QR of a Gaussian, signs fixed so the result is unique)
        q, r = torch.linalg.qr(torch.randn(num_heads, head_dim, head_dim, generator=g, dtype=torch.float64))
        mats = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return mats.float()


_SHARED: dict[tuple, torch.Tensor] = {}
_SHARED_LOCK = threading.Lock()


def shared_matrices(
    num_heads: int, head_dim: int, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """:func:`orthonormal_matrices` built once per ``(num_heads, head_dim, seed, device, dtype)`` in the process and
    shared by every layer and cache that asks for them: ``(H_kv, D, D)``, never modified in place."""
    key = (num_heads, head_dim, seed, str(torch.device(device)), dtype)
    with _SHARED_LOCK:
        mats = _SHARED.get(key)
        if mats is None:
            mats = _SHARED[key] = orthonormal_matrices(num_heads, head_dim, seed).to(device=device, dtype=dtype)
        return mats


def per_head(
    x: torch.Tensor, mats: torch.Tensor | None, transpose: bool = False, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x (B, H, T, D)`` times ``mats (H_kv, D, D)`` (``transpose``: their transposes), ``H`` a multiple of ``H_kv``
    (head ``h`` uses matrix ``h // (H // H_kv)``); computed in fp32, returned in ``out_dtype`` (default
    ``x.dtype``); ``x`` as is without ``mats``."""
    out_dtype = out_dtype or x.dtype
    if mats is None:
        return x.to(out_dtype)
    m = mats.to(x.device)
    if transpose:
        m = m.transpose(-1, -2)
    B, H, T, D = x.shape
    n_rep = H // m.shape[0]
    y = x.float().reshape(B, m.shape[0], n_rep * T, D) @ m
    return y.reshape(B, H, T, D).to(out_dtype)


@dataclass
class Rotation:
    """The rotation a layer's store was written with (recorded with the data). ``keys``/``values``: ``(H_kv, D, D)``
    fp32 matrices, or None where that side is stored unrotated; from :meth:`make`, one tensor shared by every layer
    and cache of the same head count, head dim, seed and device (:func:`shared_matrices`)."""

    kind: str
    seed: int
    keys: torch.Tensor | None
    values: torch.Tensor | None

    @classmethod
    def make(
        cls, kind: str | None, num_heads: int, head_dim: int, seed: int, device: torch.device | str = "cpu"
    ) -> Rotation | None:
        if kind is None:
            return None
        if kind not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {kind!r}")
        mats = shared_matrices(num_heads, head_dim, seed, device)
        return cls(kind, seed, None if kind == "hadamard_values" else mats, None if kind == "hadamard_keys" else mats)

    _apply = staticmethod(per_head)

    def __deepcopy__(self, memo: dict) -> Rotation:
        """The matrices are shared and never modified: a copied cache keeps sharing them."""
        return self

    def tensors(self) -> list[torch.Tensor]:
        """The matrices held (one where keys and values share it)."""
        mats = [m for m in (self.keys, self.values) if m is not None]
        return mats[:1] if len(mats) == 2 and mats[0] is mats[1] else mats

    def rotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        return self._apply(k, self.keys)

    def rotate_values(self, v: torch.Tensor) -> torch.Tensor:
        return self._apply(v, self.values)

    def rotate_pair(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rotate_keys(k), rotate_values(v))``; one batched matmul where keys and values share their matrices
        (``"hadamard"``: a decode step's new tokens of a layer in one call)."""
        if self.keys is None or self.keys is not self.values or k.shape != v.shape:
            return self.rotate_keys(k), self.rotate_values(v)
        n = k.shape[2]
        kv = self._apply(torch.cat([k, v], dim=2), self.keys)
        return kv[:, :, :n], kv[:, :, n:]

    def unrotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        return self._apply(k, self.keys, transpose=True)

    def unrotate_values(self, v: torch.Tensor) -> torch.Tensor:
        return self._apply(v, self.values, transpose=True)

    def rotate_query(self, query: torch.Tensor) -> torch.Tensor:
        """``(B, H_q, L_q, D)`` -> fp32 ``q·R_k`` per query head (its KV head's matrix): ``(qR)·(kR) = q·k``."""
        return self._apply(query, self.keys, out_dtype=torch.float32)

    def unrotate_output(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(B, H_q, L_q, D)``: attention output over rotated values, rotated back (``·R_vᵀ``), in ``dtype``."""
        return self._apply(out, self.values, transpose=True, out_dtype=dtype)

    def to(self, device: torch.device | str) -> Rotation:
        move = lambda m: None if m is None else m.to(device)
        return Rotation(self.kind, self.seed, move(self.keys), move(self.values))


def full_part_key_basis(bits: int, rotation: Rotation | None) -> torch.Tensor | None:
    """The keys' own basis of a full part at ``bits`` in a layer stored with ``rotation``: where an 8-bit part's
    keys would be stored unrotated beside rotated values (``"hadamard_values"``, ``rotation="auto"``'s layers with
    unrotated keys), the values' ``(H_kv, D, D)`` matrices, which the layer holds anyway: the basis costs no byte.
    Else None: a 16-bit part, keys rotated with the layer's packed keys, or no rotation at all (a matrix held for the
    part alone would cost Gemma 3 270M's three global layers 0.011x of their FP16 bytes at 8K tokens, 0.04x at 2K)."""
    if bits == 16 or rotation is None or rotation.keys is not None:
        return None
    return rotation.values
