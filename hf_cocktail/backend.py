"""Choosing the decode-attention backend and reporting missing optional dependencies."""

from __future__ import annotations

import importlib.util
import os

import torch

TRITON_INSTALL_HINT = "pip install 'hf-cocktail[triton]' (or: pip install triton)"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def require_triton() -> None:
    if not triton_available():
        raise ImportError(f"backend='triton' needs the triton package, which is not installed: {TRITON_INSTALL_HINT}")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA tensors when triton is installed, else ``"torch"``.

    ``"triton"`` is honoured on CUDA, or on CPU under ``TRITON_INTERPRET=1``; otherwise it raises.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        require_triton()
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"backend='triton' needs CUDA tensors (got device {device}); on CPU set TRITON_INTERPRET=1 "
                "(slow, for testing) or use backend='torch'")
        return "triton"
    raise ValueError(f"backend must be one of ('auto', 'torch', 'triton'), got {backend!r}")
