"""The fused CPU kernel's checks of a segment's outlier key channels (``hf_cocktail.storage.key_outliers``): a
segment tuple's optional last item ``(n_out, channels)``."""

from __future__ import annotations

import torch


def outlier_item(seg, i: int, H_kv: int, D: int) -> tuple[int, torch.Tensor]:
    """``(n_out, channels)`` of segment ``i``'s last item: ``n_out`` an int in ``[1, D)``, ``channels`` int32
    ``(H_kv, D)``, each row a permutation of ``range(D)`` (the stored channel order), checked; contiguous."""
    item = seg[-1]
    if not (isinstance(item, (list, tuple)) and len(item) == 2):
        raise ValueError(f"segments[{i}]'s outlier key channels must be a pair (n_out, channels), got {item!r}")
    n_out, channels = item
    if not (type(n_out) is int and 0 < n_out < D):
        raise ValueError(f"segments[{i}]'s n_out must be an int in [1, {D}), got {n_out!r}")
    if not (isinstance(channels, torch.Tensor) and channels.is_cpu and channels.dtype == torch.int32):
        raise ValueError(f"segments[{i}]'s outlier channels must be an int32 CPU tensor, got {channels!r}")
    if tuple(channels.shape) != (H_kv, D):
        raise ValueError(
            f"segments[{i}]'s outlier channels must be of shape ({H_kv}, {D}), got {tuple(channels.shape)}"
        )
    want = torch.arange(D, dtype=torch.int32).expand(H_kv, D)
    if not torch.equal(channels.sort(dim=1).values, want):
        raise ValueError(f"segments[{i}]'s outlier channels must hold a permutation of range({D}) per head")
    return n_out, channels.contiguous()
