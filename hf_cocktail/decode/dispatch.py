"""Backend choice: the PyTorch reference, the Triton kernels (``triton_ops``) or the fused CPU kernel
(``cpu_ops``). The only module that imports the kernel packages; it turns a :class:`LayerStore` into their tensor
arguments and falls back to the reference (one warning) where a kernel cannot run.

Shapes: B batch, H_q query heads, L_q query tokens, D head dim.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from hf_cocktail.decode.split_attention import attend_in_store_basis, split_precision_attention_torch, with_rotation
from hf_cocktail.storage import params8, quant
from hf_cocktail.storage.full_part import Int8FullPart
from hf_cocktail.storage.store import LayerStore

BACKENDS = ("auto", "torch", "triton", "cpu")
TRITON_INSTALL_HINT = "pip install 'hf-cocktail[triton]' (or: pip install triton)"
_warned: set[str] = set()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def require_triton() -> None:
    if not triton_available():
        raise ImportError(f"backend='triton' needs the triton package, which is not installed: {TRITON_INSTALL_HINT}")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cpu_kernel_available() -> bool:
    """True when the fused CPU kernel (``cpu_ops``, compiled on first use) can run here; else one warning saying
    why (the PyTorch path is used instead)."""
    import cpu_ops

    if cpu_ops.available():
        return True
    _warn_once(
        "cpu-ops",
        f"the fused CPU kernels (attention, quantization) are unavailable ({cpu_ops.unavailable_reason()}): "
        "using the slower PyTorch path",
    )
    return False


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA tensors when triton is installed; on CPU ``"cpu"`` (the fused kernel)
    when it can be built, else ``"torch"`` (one warning).

    ``"triton"`` is honoured on CUDA, or on CPU under ``TRITON_INTERPRET=1``; ``"cpu"`` needs CPU tensors and the
    built kernel; otherwise they raise. ``"torch"`` is the plain PyTorch reference everywhere.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if device.type == "cpu" and cpu_kernel_available() else "torch"
    if backend == "cpu":
        import cpu_ops

        if device.type != "cpu":
            raise RuntimeError(f"backend='cpu' needs CPU tensors, got device {device}; use backend='auto'")
        if not cpu_ops.available():
            raise ImportError(f"backend='cpu': the fused CPU kernel cannot be built: {cpu_ops.unavailable_reason()}")
        return "cpu"
    if backend == "triton":
        require_triton()
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"backend='triton' needs CUDA tensors (got device {device}); on CPU set TRITON_INTERPRET=1 "
                "(slow, for testing) or use backend='torch'"
            )
        return "triton"
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def quantizers(backend: str, device: torch.device) -> tuple[Callable, Callable]:
    """``(quantize_pack_keys, quantize_pack_values)`` of the backend (same signatures as :mod:`.quant`, same
    codes, scales and zeros): the Triton kernels, the fused CPU quantizers of ``cpu_ops`` (``"auto"`` on CPU where
    the extension builds, as for attention) or the PyTorch reference."""
    chosen = resolve_backend(backend, device)
    if chosen == "triton":
        import triton_ops

        fast = triton_ops.quantize_pack_keys, triton_ops.quantize_pack_values
    elif chosen == "cpu":
        import cpu_ops

        fast = cpu_ops.quantize_pack_keys, cpu_ops.quantize_pack_values
    else:
        return quant.quantize_pack_keys, quant.quantize_pack_values
    reference = quant.quantize_pack_keys, quant.quantize_pack_values
    return _by_bits(fast[0], reference[0], chosen), _by_bits(fast[1], reference[1], chosen)


def attach_fused_writer(store: LayerStore, backend: str) -> None:
    """A full part whose backend resolves to the fused CPU kernels appends new tokens with one C++ call: an 8-bit
    part with ``cpu_ops.append_tokens8`` (the codes and scales of the PyTorch reference, written into its buffers),
    one at the model's precision with ``cpu_ops.append_tokens`` (the reference's rotation and copies)."""
    full = store.full
    device = full.codes.keys.device if isinstance(full, Int8FullPart) else full.keys.device
    if resolve_backend(backend, device) != "cpu":
        return
    import cpu_ops

    if isinstance(full, Int8FullPart):
        full.write8 = cpu_ops.append_tokens8
    else:
        full.write = cpu_ops.append_tokens


def _by_bits(fast: Callable, reference: Callable, chosen: str) -> Callable:
    """``fast`` for the bit widths its kernel package quantizes, ``reference`` for the others (same signature; one
    warning)."""

    def quantize(x: torch.Tensor, bits: int, *args):
        if _kernel_reads(chosen, "quantize", bits):
            return fast(x, bits, *args)
        _warn_once(
            f"{chosen}-quantize-{bits}",
            f"the {chosen} quantizer does not write {bits}-bit codes yet: using the PyTorch implementation",
        )
        return reference(x, bits, *args)

    return quantize


def _triton_attention(
    query: torch.Tensor, store: LayerStore, scaling: float, out_dtype: torch.dtype, **extras
) -> torch.Tensor:
    import triton_ops

    D = query.shape[-1]
    if D not in triton_ops.SUPPORTED_HEAD_DIMS:
        _warn_once(
            f"triton-dim-{D}",
            f"triton split-precision attention supports head dims "
            f"{triton_ops.SUPPORTED_HEAD_DIMS}, got {D}: using the PyTorch implementation",
        )
        return attend_in_store_basis(query, store, scaling, out_dtype, **extras)
    full = store.full
    kw: dict[str, object] = dict(extras)  # sinks / softcap, then the stored formats' extra arguments
    if any(s.scale_bits == 8 for s in store.segments):
        kw["scale_table"] = params8.scale_table(query.device)
    keys, values = full.split_path_tensors()  # an 8-bit full part: its int8 codes, read with their scales
    if isinstance(full, Int8FullPart):
        kw["full_scales"] = (full.scales.keys, full.scales.values)
        kw["full_query"] = full.key_query(query)  # its keys in a basis of their own (None: the query serves)
        if full.head is not None:
            kw["full_head"] = (full.head.keys, full.head.values)
    return triton_ops.split_precision_attention(
        query,
        keys,
        values,
        full.start_tensor(),
        [_kernel_segment(s) for s in store.segments],
        scaling,
        max_tokens=[s.max_sequence_tokens() for s in store.segments],
        min_full_start=min(full.start),
        **kw,
    ).to(out_dtype)


def _cpu_attention(query: torch.Tensor, store: LayerStore, scaling: float, **extras) -> torch.Tensor:
    """The fused CPU kernel straight from the store: 8-bit scale / zero codes, an 8-bit full part's codes and the
    rotation's matrices go to the kernel as they are stored (decoded and applied inside it). The arguments that do
    not change between decode steps (segments, rotation, scale table) are checked once per store
    (:func:`_cpu_prepared`); each step passes the full part's current views."""
    import cpu_ops.attention

    full = store.full
    keys, values = full.split_path_tensors()  # an 8-bit full part: its int8 codes, read with their scales
    full_scales = (full.scales.keys, full.scales.values) if isinstance(full, Int8FullPart) else None
    head = getattr(full, "head", None)  # an 8-bit part's exact head (or None)
    prepared = _cpu_prepared(store)
    return cpu_ops.attention.split_precision_attention_prepared(
        query,
        keys,
        values,
        full.start_tensor(),
        prepared,
        scaling,
        full_scales=full_scales,
        scale_table=_cpu_scale_table() if prepared.needs_table else None,
        full_head=None if head is None else (head.keys, head.values),
        **extras,
    )


@functools.cache
def _cpu_scale_table() -> torch.Tensor:
    return params8.scale_table("cpu")


def _cpu_prepared(store: LayerStore):
    """``cpu_ops.attention.prepare`` of the store's segments, rotation and scale table, made at the first decode step
    and kept in ``store.kernel_cache`` while the store holds the same segments and rotation."""
    import cpu_ops.attention

    segments, rotation = store.segments, store.rotation
    entry = store.kernel_cache.get("cpu")
    if entry is not None and entry[0] is rotation and _same_segments(entry[1], store):
        return entry[2]
    kw: dict[str, object] = {}
    if any(s.scale_bits == 8 for s in segments):
        kw["scale_table"] = _cpu_scale_table()
    full_basis = store.full.key_basis  # an 8-bit full part's keys in a basis of their own (or None)
    if rotation is not None or full_basis is not None:
        kw["rotation"] = (
            None if rotation is None else rotation.keys,
            None if rotation is None else rotation.values,
            full_basis,
        )
    B, H_kv, _, D = store.full.shape
    prepared = cpu_ops.attention.prepare(B, H_kv, D, [_kernel_segment(s) for s in segments], **kw)
    store.kernel_cache["cpu"] = (rotation, tuple(segments), prepared)
    return prepared


def _kernel_segment(seg) -> tuple:
    """A segment as ``cpu_ops`` and ``triton_ops`` take it: :meth:`PackedSegment.coded_kernel_args`, with outlier
    key channels one more item ``(n_out, channels)``."""
    o = seg.key_outliers
    return seg.coded_kernel_args() if o is None else (*seg.coded_kernel_args(), (o.count, o.channels))


@functools.cache  # asked at every decode step: the import and lookup once per (backend, op)
def _kernel_formats(chosen: str, op: str = "attention") -> tuple[int, ...]:
    """The packed bit widths the chosen kernel package reads (``op="attention"``) or writes (``"quantize"``)."""
    if chosen == "triton":
        from triton_ops import checks as module
    else:
        import cpu_ops

        module = getattr(cpu_ops, op)
    return module.SUPPORTED_BITS


@functools.cache
def _reads_key_outliers(chosen: str) -> bool:
    """Whether the chosen kernel package reads segments with outlier key channels (``READS_KEY_OUTLIERS``)."""
    if chosen == "triton":
        from triton_ops import checks as module
    else:
        import cpu_ops.attention as module
    return getattr(module, "READS_KEY_OUTLIERS", False)


def _kernel_reads(chosen: str, op: str, bits: int) -> bool:
    """Whether the chosen kernel package handles ``bits``-bit codes for ``op``."""
    return bits in _kernel_formats(chosen, op)


def _same_segments(kept: tuple, store: LayerStore) -> bool:
    """Whether ``store`` still holds the segment objects ``kept`` (what a ``kernel_cache`` entry was made from)."""
    segments = store.segments
    return len(kept) == len(segments) and all(a is b for a, b in zip(kept, segments))


def split_precision_attention(
    query: torch.Tensor,
    store: LayerStore,
    scaling: float,
    backend: str,
    *,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention of ``query (B, H_q, L_q, D)`` over ``store`` with the chosen backend; ``(B, H_q, L_q, D)``.
    A store holding a bit width the chosen kernel does not read takes the PyTorch path (one warning). The choice
    depends only on the backend, the device, the head dim and the store's segments: it is made once per store and
    kept in ``store.kernel_cache``. ``sinks`` ``(H_q,)`` (attention sinks) and ``softcap`` (logit soft-capping): as
    :func:`~hf_cocktail.decode.split_attention.split_precision_attention_torch`, on every backend (centred keys, whose
    scores they make shift-sensitive, on the PyTorch path: the kernels do not add the shift back)."""
    if store.key_mean is not None and (sinks is not None or softcap is not None):
        _warn_once(
            "centred",
            "center_keys=True on a model with logit soft-capping or attention sinks, with keys quantized before its "
            "attention was seen: decode runs the PyTorch split attention; center_keys=False keeps the fused kernels",
        )
        return split_precision_attention_torch(query, store, scaling, sinks=sinks, softcap=softcap)
    key = ("route", backend, query.device, query.shape[-1])
    entry = store.kernel_cache.get(key)
    if entry is None or not _same_segments(entry[0], store):
        entry = store.kernel_cache[key] = (tuple(store.segments), _route(query, store, backend))
    chosen = entry[1]
    extras: dict[str, Any] = {} if sinks is None and softcap is None else {"sinks": sinks, "softcap": softcap}
    if chosen == "triton":
        return with_rotation(_triton_attention, query, store, scaling, **extras)
    if chosen == "cpu":
        return _cpu_attention(query, store, scaling, **extras)
    return split_precision_attention_torch(query, store, scaling, sinks=sinks, softcap=softcap)


def _route(query: torch.Tensor, store: LayerStore, backend: str) -> str:
    """``"triton"``, ``"cpu"`` or ``"torch"``: the backend that reads ``store`` for ``query`` (one warning where a
    kernel cannot)."""
    chosen = resolve_backend(backend, query.device)
    if chosen != "torch":
        missing = [
            s.code_bits if s.key_outliers is None or _reads_key_outliers(chosen) else "outlier key channels"
            for s in store.segments
            if not _kernel_reads(chosen, "attention", s.bits)
            or not _kernel_reads(chosen, "attention", s.value_width)
            or (s.key_outliers is not None and not _reads_key_outliers(chosen))
        ]
        if missing:
            _warn_once(
                f"{chosen}-read-{missing}",
                f"the {chosen} kernel does not read these segments' bit widths yet: {missing}; "
                "using the PyTorch implementation",
            )
            return "torch"
    if chosen == "cpu":
        D = query.shape[-1]
        if D % 8 == 0:
            return "cpu"
        _warn_once(
            f"cpu-dim-{D}",
            f"the fused CPU kernel needs a head dim that is a multiple of 8, got {D}: using the PyTorch implementation",
        )
        return "torch"
    return chosen
