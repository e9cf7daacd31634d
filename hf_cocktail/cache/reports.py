"""What a Cocktail cache holds, in bytes: the numbers behind ``nbytes`` and ``memory_report``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hf_cocktail.storage.store import LayerStore


def storage_bytes(tensors: Iterable[Any], fp16: bool = False) -> int:
    """Bytes of the storages behind ``tensors`` (non-tensors skipped), each storage once however many tensors view
    it; ``fp16``: floating-point storages at 2 bytes per element (an FP16 deployment)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        n = storage.nbytes()
        total += n // t.element_size() * 2 if fp16 and t.is_floating_point() else n
    return total


def object_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors among an object's attributes, directly or in lists, tuples and dicts one level down (the
    key/value and state tensors of a transformers cache layer)."""
    out: list[torch.Tensor] = []
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        out += [t for t in items if isinstance(t, torch.Tensor)]
    return out


def plan_tensors(plans: Sequence[Any] | None, input_ids: torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors a cache's plans hold (token positions, attention masses, salient positions) and the prompt's ids."""
    out: list[torch.Tensor | None] = [input_ids]
    for plan in plans or []:
        out += [*plan.positions.values(), *plan.layer_mass.values(), *plan.layer_salient.values(), plan.attn_mass]
    return [t for t in out if t is not None]


def matrices(store: LayerStore) -> list[torch.Tensor]:
    """The ``(H_kv, D, D)`` matrices a store reads with: its rotation's and its 8-bit full part's key basis (often
    one of the rotation's; :func:`storage_bytes` counts a storage once)."""
    mats = [] if store.rotation is None else store.rotation.tensors()
    return mats if store.full.key_basis is None else [*mats, store.full.key_basis]


def memory_report(
    stores: Sequence[LayerStore],
    context_copies: Iterable[tuple[torch.Tensor, ...]],
    plan_bits: Iterable[Sequence[int] | None],
    native_bytes: int = 0,
    native_fp16_bytes: int = 0,
    native_deployed_bytes: int | None = None,
    plan_bytes: int = 0,
) -> dict[str, Any]:
    """Breakdown of every byte the cache holds plus what the model's default cache would hold in FP16 for the same
    tokens. ``total_bytes``: packed codes, scales and zeros, the full part's tokens (``full_precision_bytes``) and
    its room for the next appended tokens (``headroom_bytes``), the rotation matrices and 8-bit full parts' key bases
    (``rotation_bytes``, each storage once), the index tensors
    (offsets cached on the device, the plans' token positions, attention masses and salient positions, the
    prompt's ids: ``index_bytes``, from ``plan_bytes`` and the stores) and the model's own (sliding-window) layers
    (``native_bytes``: every tensor they hold). ``ratio_to_fp16`` divides the same total, with full-precision
    tensors at 2 bytes per element (an FP16 deployment, even for fp32 models; ``native_deployed_bytes``: the native
    layers so counted), by the FP16 key/value bytes of the tokens held (``native_fp16_bytes`` for the native
    layers).

    Two ratios: ``ratio_to_fp16`` is the whole cache's (the Cocktail layers and the model's own layers) against the
    model's default cache in FP16; ``quantized_layers_ratio_to_fp16`` is the Cocktail (full-attention) layers' alone
    (their codes, scales, full part and its room, rotation and index tensors) against the same layers in FP16
    (``quantized_layers_fp16_equivalent_bytes``). On a sliding + global model (Gemma 3) the whole cache's ratio is
    nearer 1.

    ``scales_zeros_bytes`` includes the key means of centred keys (``center_keys``).

    ``appended_packed_tokens``: per sequence, the tokens appended after the prefill (generated tokens, later turns)
    that were packed (:mod:`hf_cocktail.storage.generated`); their codes and scales are in ``codes_bytes`` and
    ``scales_zeros_bytes``, and the tokens in the FP16 equivalent."""
    rep: dict[str, Any] = {"codes_bytes": 0, "scales_zeros_bytes": 0, "full_precision_bytes": 0, "layers": len(stores)}
    rep["headroom_bytes"] = 0
    # tokens appended after the prefill (generated tokens, later turns) now held packed: per sequence, in the
    # Cocktail layer that packed the most (layers kept at full precision pack none)
    rep["appended_packed_tokens"] = max((st.packed_appended for st in stores), default=0)
    fp16_equiv = full_deployed = headroom_deployed = index = 0
    for st in stores:
        H, D = st.full.shape[1], st.full.shape[3]
        rep["full_precision_bytes"] += st.full.nbytes()
        full_deployed += st.full.deployed_bytes()
        rep["headroom_bytes"] += st.full.reserved_bytes()
        headroom_deployed += st.full.reserved_deployed_bytes()
        rep["codes_bytes"] += sum(s.nbytes_codes() for s in st.segments)
        rep["scales_zeros_bytes"] += sum(s.nbytes_params() for s in st.segments) + st.key_mean_bytes()
        index += st.index_bytes()
        tokens = st.full.valid_tokens() + sum(s.num_tokens for s in st.segments)
        fp16_equiv += tokens * H * D * 2 * 2
    rep["rotation_bytes"] = storage_bytes(t for st in stores for t in matrices(st))
    rep["index_bytes"] = index + plan_bytes
    rep["native_layers_bytes"] = native_bytes
    rep["native_layers_fp16_bytes"] = native_fp16_bytes
    quantized_deployed = rep["codes_bytes"] + rep["scales_zeros_bytes"] + full_deployed + headroom_deployed
    quantized_deployed += rep["rotation_bytes"] + rep["index_bytes"]
    rep["quantized_layers_fp16_equivalent_bytes"] = fp16_equiv
    rep["quantized_layers_ratio_to_fp16"] = quantized_deployed / fp16_equiv if fp16_equiv else float("nan")
    held = ("codes_bytes", "scales_zeros_bytes", "full_precision_bytes", "headroom_bytes", "rotation_bytes")
    rep["total_bytes"] = sum(rep[k] for k in held) + rep["index_bytes"] + native_bytes
    # keep_context_copy: the CPU copy for requery() is reported apart (it is not part of the working cache)
    rep["context_copy_bytes"] = sum(sum(t.numel() * t.element_size() for t in copy) for copy in context_copies)
    fp16_equiv += native_fp16_bytes
    rep["fp16_equivalent_bytes"] = fp16_equiv
    native_deployed = native_fp16_bytes if native_deployed_bytes is None else native_deployed_bytes
    fp16_total = rep["codes_bytes"] + rep["scales_zeros_bytes"] + full_deployed + headroom_deployed
    fp16_total += rep["rotation_bytes"] + rep["index_bytes"] + native_deployed
    rep["ratio_to_fp16"] = fp16_total / fp16_equiv if fp16_equiv else float("nan")
    counts = {16: 0, 4: 0, 3: 0, 2: 0}
    for bits in plan_bits:
        for b in bits or []:
            counts[b] += 1
    rep["chunks"] = {"fp16": counts[16], "int4": counts[4], "int2": counts[2]}
    if counts[3]:  # low_bits=3 (INT3 chunks) only: the usual report keeps its three keys
        rep["chunks"]["int3"] = counts[3]
    return rep
