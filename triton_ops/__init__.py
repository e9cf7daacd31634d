"""Triton kernels of hf-cocktail: fused quantize + pack, and split-precision decode attention.

The launchers have the signatures of their PyTorch references (:mod:`hf_cocktail.quant`,
:func:`hf_cocktail.attention.split_precision_attention_torch`). On CPU they run under ``TRITON_INTERPRET=1``.
"""

from hf_cocktail.backend import TRITON_INSTALL_HINT

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without triton
    raise ImportError(f"triton_ops needs the triton package, which is not installed: {TRITON_INSTALL_HINT}") from e

from .attention import split_precision_attention
from .quantize import quantize_pack_keys, quantize_pack_values

__all__ = ["quantize_pack_keys", "quantize_pack_values", "split_precision_attention"]
