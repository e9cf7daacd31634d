"""One kernel launch as data: the kernel, its grid, its positional arguments, its compile-time constants and its
``num_warps`` / ``num_stages``. The launchers (:mod:`triton_ops.attention`, :mod:`triton_ops.quantize`) build a
:class:`Launch` and run it; the ahead-of-time compile report (:mod:`triton_ops.aot`) builds the same :class:`Launch`
for a case and compiles it for a GPU target with the signature Triton's own launcher would derive
(:meth:`Launch.compile_inputs`), so the report sees exactly what a real launch compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class Launch:
    """``kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **options)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. enable_fp_fusion

    def run(self, device: torch.device) -> None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self.kernel[self.grid](
                *self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages, **self.options
            )

    def compile_inputs(self, target) -> tuple[Any, dict[str, str], dict, dict, dict[str, Any]]:
        """``(kernel, signature, constexprs, attrs, options)`` for ``triton.compile(ASTSource(kernel, signature,
        constexprs, attrs), target=target, options=options)``, derived by Triton's launcher code (its binder and
        argument packing: pointer dtypes, ints of value 1 made constant, 16-divisible pointers and ints marked) for
        a ``target`` (``triton.backends.compiler.GPUTarget``), with no GPU needed."""
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        fn = self.kernel
        backend = make_backend(target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        kwargs = {**self.constexprs, "num_warps": self.num_warps, "num_stages": self.num_stages, **self.options}
        bound, specialization, options = binder(*self.args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        return fn, signature, constexprs, attrs, options.__dict__
