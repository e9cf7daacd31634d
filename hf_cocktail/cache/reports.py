"""What a Cocktail cache holds, in bytes: the numbers behind ``nbytes`` and ``memory_report``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hf_cocktail.storage.store import LayerStore


def memory_report(
    stores: Sequence[LayerStore],
    context_copies: Iterable[tuple[torch.Tensor, ...]],
    plan_bits: Iterable[Sequence[int] | None],
    native_bytes: int = 0,
    native_fp16_bytes: int = 0,
) -> dict[str, Any]:
    """Breakdown of the stores' bytes plus what the model's default cache would hold in FP16 for the same tokens.
    ``ratio_to_fp16`` counts full-precision tensors at 2 bytes per element (an FP16 deployment) even for fp32
    models (an 8-bit full part as its codes and scales). ``native_bytes`` / ``native_fp16_bytes``: the keys/values
    of the model's own (sliding-window) layers, held as they are: in ``total_bytes`` and, at 2 bytes per element, on
    both sides of the ratio."""
    rep: dict[str, Any] = {"codes_bytes": 0, "scales_zeros_bytes": 0, "full_precision_bytes": 0, "layers": len(stores)}
    fp16_equiv = full_deployed = 0
    for st in stores:
        H, D = st.full.shape[1], st.full.shape[3]
        rep["full_precision_bytes"] += st.full.nbytes()
        full_deployed += st.full.deployed_bytes()
        rep["codes_bytes"] += sum(s.nbytes_codes() for s in st.segments)
        rep["scales_zeros_bytes"] += sum(s.nbytes_params() for s in st.segments)
        tokens = st.full.valid_tokens() + sum(s.num_tokens for s in st.segments)
        fp16_equiv += tokens * H * D * 2 * 2
    rep["native_layers_bytes"] = native_bytes
    rep["total_bytes"] = rep["codes_bytes"] + rep["scales_zeros_bytes"] + rep["full_precision_bytes"] + native_bytes
    # keep_context_copy: the CPU copy for requery() is reported apart (it is not part of the working cache)
    rep["context_copy_bytes"] = sum(sum(t.numel() * t.element_size() for t in copy) for copy in context_copies)
    fp16_equiv += native_fp16_bytes
    rep["fp16_equivalent_bytes"] = fp16_equiv
    fp16_total = rep["codes_bytes"] + rep["scales_zeros_bytes"] + full_deployed + native_fp16_bytes
    rep["ratio_to_fp16"] = fp16_total / fp16_equiv if fp16_equiv else float("nan")
    counts = {16: 0, 4: 0, 3: 0, 2: 0}
    for bits in plan_bits:
        for b in bits or []:
            counts[b] += 1
    rep["chunks"] = {"fp16": counts[16], "int4": counts[4], "int2": counts[2]}
    if counts[3]:  # low_bits=3 (INT3 chunks) only: the usual report keeps its three keys
        rep["chunks"]["int3"] = counts[3]
    return rep
