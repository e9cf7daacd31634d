"""Input checks of the launchers (the kernels only compute). Messages match the PyTorch reference's."""

from __future__ import annotations

import os

import torch

READS_KEY_OUTLIERS = True  # segments with outlier key channels (a 12th item (n_out, channels)): read
SUPPORTED_BITS = (2, 3, 4)  # packed code widths; INT3 as a 2-bit plane then a 1-bit plane (the reference's layout)


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def channel_multiple(bits: int) -> int:
    """The head dim must be a multiple of this to pack ``bits``-bit codes into whole bytes (8 for INT3: its 1-bit
    plane holds 8 channels per byte)."""
    return 8 if bits == 3 else 8 // bits


def check_head_dim(D: int, bits: int, group_size: int | None = None) -> None:
    per = channel_multiple(bits)
    if D % per:
        raise ValueError(f"head dim D={D} must be a multiple of {per} to pack {bits}-bit codes into bytes")
    if group_size is not None and D % group_size:
        raise ValueError(f"group_size={group_size} must divide the head dim D={D}")


def check_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"{what} contain NaN or inf; hf-cocktail refuses to quantize non-finite key/value states "
            "(the model produced them: check its dtype, e.g. use bfloat16 or float32 instead of float16)"
        )


def check_device(x: torch.Tensor) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got device {x.device}); on CPU set TRITON_INTERPRET=1 "
            "(slow, for testing) or use backend='torch'"
        )
