"""Lazy, quiet, process-safe JIT build of the C++ extension (``torch.utils.cpp_extension.load``).

The extension is compiled on first use into the torch extensions directory (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``) under a name that hashes the sources, the flags and the torch / Python versions, so a
changed source or another torch never reuses a stale build. Builds are serialised across processes by an ``flock``
(released by the kernel even when a builder is killed, unlike the lock file torch's own baton leaves behind).

Flags are portable (``-O3``, no ``-march``): the AVX2 + FMA + F16C and the AVX-512 VNNI variants of the kernel are
compiled through ``#pragma GCC target`` and chosen at run time, so a build runs on any x86-64 CPU. The quantizers
(``csrc/quantize.cpp``), the 8-bit scales' decoder (``csrc/params8.cpp``) and the 8-bit full part's append
(``csrc/tokens8.cpp``) have the baseline build only, without floating-point contraction (the files' pragmas): their
codes, scales and zeros are bit for bit those of the PyTorch reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings

import torch

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ("split_attention.cpp", "quantize.cpp", "params8.cpp", "tokens8.cpp")
_HEADERS = ("kernel.h", "kernel_simd.h", "kernel_unpack.h", "kernel_int16.h", "quantize.h", "float_types.h")
# -fopenmp: at::parallel_for's OpenMP region (the libgomp loaded at run time is torch's: same soname);
# -Wno-psabi: the baseline build passes 8-float vectors between (inlined) helpers, which GCC would note
_CFLAGS = ("-O3", "-fopenmp", "-Wno-psabi")
_LDFLAGS = ("-fopenmp",)

FIX_HINT = (
    "cpu_ops needs a C++ compiler (g++ or clang++; `apt-get install g++`, or set CXX) and ninja "
    "(`pip install ninja`, a dependency of hf-cocktail)"
)

_lock = threading.Lock()
_module = None
_reason: str | None = None


def _extension_name() -> str:
    h = hashlib.sha256()
    for f in _SOURCES + _HEADERS:
        with open(os.path.join(_DIR, f), "rb") as fh:
            h.update(fh.read())
    h.update(repr((_CFLAGS, _LDFLAGS, torch.__version__, sys.version_info[:2], platform.machine())).encode())
    return f"hf_cocktail_cpu_ops_{h.hexdigest()[:16]}"


def _ensure_ninja(cpp_extension) -> None:
    """``python -m ...`` from a venv that is not activated has no ``.venv/bin`` on PATH: use the ninja package's."""
    if cpp_extension.is_ninja_available():
        return
    with contextlib.suppress(ImportError):
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed")


@contextlib.contextmanager
def _build_lock(build_dir: str):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: torch's own file baton only
        yield
        return
    with open(os.path.join(build_dir, "cpu_ops.flock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            # every builder holds this flock, so a torch baton file present now was left by a killed build
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(build_dir, "lock"))
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build():
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH")
    _ensure_ninja(cpp_extension)
    name = _extension_name()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = os.path.join(root, name)
    os.makedirs(build_dir, exist_ok=True)
    with _build_lock(build_dir), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. torch's compiler-version notice; a failure still raises
        return cpp_extension.load(
            name,
            [os.path.join(_DIR, f) for f in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            build_directory=build_dir,
            verbose=False,
        )


def extension():
    """The compiled module (built on first call); raises :class:`ImportError` naming why it is unavailable."""
    global _module, _reason
    with _lock:
        if _module is None and _reason is None:
            try:
                _module = _build()
            except Exception as e:  # noqa: BLE001 - any build failure makes the extension unavailable
                msg = str(e).strip()
                if len(msg) > 2000:  # a compiler log: its end says what failed
                    msg = "..." + msg[-2000:]
                _reason = f"the cpu_ops C++ extension could not be built ({type(e).__name__}: {msg}). {FIX_HINT}"
    if _module is None:
        raise ImportError(_reason)
    return _module


def available() -> bool:
    """True when the extension is built (or builds now, on first call: about a minute) and loads."""
    try:
        extension()
    except ImportError:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (the build error and how to fix it); None when it is available."""
    return None if available() else _reason
