"""Fused CPU kernels of hf-cocktail: split-precision decode attention straight from the packed INT4 / INT2 codes.

A leaf package (it imports nothing from ``hf_cocktail``). The C++ extension is compiled on first use with
``torch.utils.cpp_extension`` (about a minute, once per machine and source version; later processes load the cached
build). Where it cannot be built, :func:`available` is False, :func:`unavailable_reason` says why and how to fix it,
and :func:`split_precision_attention` raises :class:`ImportError` with that reason.
"""

from ._build import available, unavailable_reason
from .attention import split_precision_attention

__all__ = ["available", "split_precision_attention", "unavailable_reason"]
