"""Fused CPU kernels of hf-cocktail: split-precision decode attention straight from the packed INT4 / INT3 / INT2 codes,
and the prefill's group quantization + bit packing (bit for bit ``hf_cocktail.storage.quant``'s, in one fused pass).

A leaf package (it imports nothing from ``hf_cocktail``). The C++ extension is compiled on first use with
``torch.utils.cpp_extension`` (about a minute, once per machine and source version; later processes load the cached
build). Where it cannot be built, :func:`available` is False, :func:`unavailable_reason` says why and how to fix it,
and the kernels raise :class:`ImportError` with that reason.
"""

from ._build import available, unavailable_reason
from .attention import kernel_target, split_precision_attention
from .quantize import append_tokens, append_tokens8, decode_params8, quantize_pack_keys, quantize_pack_values

__all__ = [
    "append_tokens",
    "append_tokens8",
    "available",
    "decode_params8",
    "kernel_target",
    "quantize_pack_keys",
    "quantize_pack_values",
    "split_precision_attention",
    "unavailable_reason",
]
