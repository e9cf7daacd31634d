"""Temporary wrappers around library functions for ``bench_prefill``'s timers.

A function is replaced wherever a loaded module of the given packages holds it (``from .x import f`` copies the
name into the importing module), so the wrapping survives the library moving code between its modules; methods are
replaced on their class. Everything is restored when the block ends; nothing in the library is edited.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

PACKAGES = ("hf_cocktail", "cpu_ops")


class Patcher:
    def __init__(self, packages: tuple[str, ...] = PACKAGES):
        self.packages = packages
        self._saved: list[tuple[object, str, object]] = []

    def function(self, func: Callable, wrap: Callable[[Callable], Callable]) -> int:
        """Replace ``func`` by ``wrap(func)`` in every loaded module of the packages; returns how many names."""
        new = wrap(func)
        n = 0
        for name, mod in list(sys.modules.items()):
            if mod is None or name.split(".")[0] not in self.packages:
                continue
            for attr, val in list(vars(mod).items()):
                if val is func:
                    setattr(mod, attr, new)
                    self._saved.append((mod, attr, val))
                    n += 1
        return n

    def method(self, cls: type, name: str, wrap: Callable[[Callable], Callable]) -> None:
        """Replace ``cls.name`` (a plain, static or class method defined on ``cls``) by its wrapped version."""
        old = cls.__dict__[name]
        if isinstance(old, staticmethod):
            new = staticmethod(wrap(old.__func__))
        elif isinstance(old, classmethod):
            new = classmethod(wrap(old.__func__))
        else:
            new = wrap(old)
        setattr(cls, name, new)
        self._saved.append((cls, name, old))

    def attribute(self, owner: object, name: str, value: object) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()


@contextlib.contextmanager
def patching(packages: tuple[str, ...] = PACKAGES) -> Iterator[Patcher]:
    p = Patcher(packages)
    try:
        yield p
    finally:
        p.restore()
