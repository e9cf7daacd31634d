"""Triton kernels of hf-cocktail: fused quantize + pack, and split-precision decode attention.

A leaf package: it imports nothing from ``hf_cocktail``. The launchers take tensors (codes, scales, zeros, offsets),
check them and launch; their PyTorch references are ``hf_cocktail.storage.quant`` and
``hf_cocktail.decode.split_attention.split_precision_attention_torch``. On CPU they run under ``TRITON_INTERPRET=1``.
"""

TRITON_INSTALL_HINT = "pip install 'hf-cocktail[triton]' (or: pip install triton)"

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without triton
    raise ImportError(f"triton_ops needs the triton package, which is not installed: {TRITON_INSTALL_HINT}") from e

from .attention import SUPPORTED_HEAD_DIMS, plan_split_attention, split_precision_attention  # noqa: E402
from .quantize import quantize_pack_keys, quantize_pack_values  # noqa: E402

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "plan_split_attention",
    "quantize_pack_keys",
    "quantize_pack_values",
    "split_precision_attention",
]
