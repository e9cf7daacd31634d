"""What differs across the supported transformers versions (5.17 ... newest 5.x), in one place."""

from __future__ import annotations

import inspect
from typing import Any


def cache_kwarg(model: Any) -> str:
    """The keyword ``model.forward`` / ``model.generate`` takes the cache by: ``"cache"`` where transformers has
    renamed it (5.24 deprecates ``past_key_values``, removal announced for 5.40), else ``"past_key_values"``."""
    # the class's forward: an instance-level wrapper (a test's counting forward, a hook) may hide the keywords
    params = inspect.signature(getattr(type(model), "forward", model.forward)).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model.generate(**inputs, **cache_kwargs(model, cache))`` or a forward call, with the
    keyword the installed transformers prefers (no deprecation warning on the supported range)."""
    return {cache_kwarg(model): cache}
