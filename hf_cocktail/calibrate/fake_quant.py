"""What a layer's packed store gives back, without building one: a context's keys and values rotated, quantized with
the package's own quantizers (the PyTorch reference, which the fused ones equal bit for bit), dequantized and
rotated back. Feeding these into a ``DynamicCache`` scores one layer's code widths in a plain forward.

Shapes: ``(H_kv, N, D)`` for one sequence's context tokens (N: the chunk-aligned context, chunks of C tokens; the
last may be partial).
"""

from __future__ import annotations

import torch

from hf_cocktail.presets.config import CocktailConfig
from hf_cocktail.storage import params8, quant
from hf_cocktail.storage.key_centering import centered, context_key_mean, uncentered
from hf_cocktail.storage.rotation import orthonormal_matrices


class FakeQuantizer:
    """Quantize-dequantize context keys/values as a ``config``'s store would (its rotation, C, G, scales)."""

    def __init__(self, config: CocktailConfig, num_heads: int, head_dim: int, model_dtype: torch.dtype):
        self.config = config
        self.scale_dtype = config.torch_scale_dtype(model_dtype)
        rotated = config.rotation is not None
        self.R = orthonormal_matrices(num_heads, head_dim, config.rotation_seed) if rotated else None
        self.rotate_k = config.rotation in ("hadamard", "hadamard_keys")
        self.rotate_v = config.rotation in ("hadamard", "hadamard_values")

    def _rotate(self, x: torch.Tensor, on: bool, back: bool = False) -> torch.Tensor:
        if not on or self.R is None:
            return x
        return x @ (self.R.transpose(-1, -2) if back else self.R)

    def keys(self, k: torch.Tensor, bits: int) -> torch.Tensor:
        """``k (H_kv, N, D)`` -> its ``bits``-bit store round trip, fp32 (with ``center_keys``, centred on the
        context's mean key as the store centres them, :mod:`hf_cocktail.storage.key_centering`)."""
        C = self.config.chunk_size
        mean = context_key_mean(k[None], [(0, k.shape[1])], self.scale_dtype)[0] if self.config.center_keys else None
        y = self._rotate(centered(k.float(), mean), self.rotate_k)
        back = params8.round_trip_keys(y, bits, C, self.config.scale_bits, self.scale_dtype)
        return uncentered(self._rotate(back, self.rotate_k, back=True), mean)

    def values(self, v: torch.Tensor, bits: int) -> torch.Tensor:
        """``v (H_kv, N, D)`` -> its ``bits``-bit store round trip, fp32."""
        C, G = self.config.chunk_size, self.config.group_size
        y = self._rotate(v.float(), self.rotate_v)
        if self.config.scale_bits == 8:
            codes, sc, zc, block = params8.quantize_pack_values8(y, bits, G, self.scale_dtype, chunk_size=C)
            scale, zero = params8.decode_params8(sc, zc, block, torch.arange(y.shape[1]) // C)
        else:
            codes, scale, zero = quant.quantize_pack_values(y, bits, G, self.scale_dtype)
        return self._rotate(quant.dequantize_values(codes, scale, zero, bits, G), self.rotate_v, back=True)
