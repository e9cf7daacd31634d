"""What a prefill really was, seen from a cache: the token ids the model embedded and the model's config.

A transformers cache receives key/value states only. To check that a prefill runs on the prompt that
``CocktailCache.prepare_inputs`` planned, a cache *arms* its :class:`PrefillWatch` from ``prepare_inputs`` until its
prefill is complete. While at least one watch is armed, one process-wide forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``) records, for every armed watch, the integer inputs of
``nn.Embedding`` calls (the token ids a model embeds) and the text config of the transformers modules called. The
hook is removed as soon as no watch is armed, so nothing runs outside those windows.

What it cannot see (``inputs_embeds`` instead of ids, a token embedding that is not an ``nn.Embedding``) it does not
judge: :meth:`PrefillWatch.ids_match` then answers ``None``.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import torch
from torch import nn

_ARMED: weakref.WeakSet[PrefillWatch] = weakref.WeakSet()
_LOCK = threading.Lock()
_HANDLE: Any = None
_KEEP_IDS = 8  # embedding calls remembered per watch (the prefill's own comes right before its first cache update)


def _hook(module: nn.Module, args: tuple) -> None:
    watches = list(_ARMED)
    if not watches:
        _remove_hook()
        return
    if isinstance(module, nn.Embedding):
        ids = args[0] if args else None
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() == 2:
            for watch in watches:
                watch.ids.append(ids)
        return
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "model_type") and hasattr(config, "get_text_config"):
        for watch in watches:
            watch.note_config(config)


def _remove_hook() -> None:
    global _HANDLE
    with _LOCK:
        if _HANDLE is not None and not len(_ARMED):
            _HANDLE.remove()
            _HANDLE = None


class PrefillWatch:
    """One cache's view of the forwards that fill it (see the module docstring)."""

    def __init__(self) -> None:
        self.ids: collections.deque[torch.Tensor] = collections.deque(maxlen=_KEEP_IDS)
        self.model_type: str | None = None
        self.num_layers: int | None = None
        self.model_config: Any = None  # the transformers config of the model seen (for the per-layer-type layout)

    @property
    def armed(self) -> bool:
        return self in _ARMED

    def arm(self) -> None:
        global _HANDLE
        self.ids.clear()
        with _LOCK:
            _ARMED.add(self)
            if _HANDLE is None:
                _HANDLE = nn.modules.module.register_module_forward_pre_hook(_hook)

    def disarm(self) -> None:
        self.ids.clear()
        _ARMED.discard(self)
        _remove_hook()

    def note_config(self, config: Any) -> None:
        if self.model_config is None:
            self.model_config = config  # the outermost module's (seen first): the one DynamicCache(config=) takes
        try:
            text = config.get_text_config(decoder=True)
        except Exception:  # any config object: keep what can be read
            text = config
        self.model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
        n = getattr(text, "num_hidden_layers", None)
        self.num_layers = n if isinstance(n, int) else None

    def check_ids(self, expected: torch.Tensor, length: int) -> tuple[bool, torch.Tensor] | None:
        """Compare the ids embedded since the last check with ``expected (B, n)``, the prepared prompt's tokens of a
        forward of ``length`` >= n tokens (tokens past the prompt, e.g. assisted decoding's candidates, are free).

        Returns ``None`` when no embedding call of shape ``(B, length)`` was seen (nothing to judge), else
        ``(matched, ids)``: whether one of them begins with ``expected``, and the most recent one."""
        B, n = expected.shape
        seen = [ids for ids in self.ids if tuple(ids.shape) == (B, length)]
        self.ids.clear()
        if not seen:
            return None
        matched = any(torch.equal(ids[:, :n], expected.to(ids.device)) for ids in seen)
        return matched, seen[-1]

    def __deepcopy__(self, memo: dict) -> PrefillWatch:
        new = PrefillWatch()
        new.model_type, new.num_layers, new.model_config = self.model_type, self.num_layers, self.model_config
        if self.armed:
            new.arm()
        new.ids.extend(self.ids)  # never modified in place: shared
        return new


def check_prefill_ids(watch: PrefillWatch, prepared: torch.Tensor, k: torch.Tensor, past: int, prompt_len: int) -> None:
    """At the first Cocktail layer of each forward until the prepared prompt is complete: the batch and the token ids
    the model embedded (as far as ``watch`` saw them) must be the prepared prompt's ``prepared (n, L)``; ``k (B,
    H_kv, L_new, D)`` are the forward's keys, ``past`` the tokens already cached. A forward may cover a part of the
    prompt (chunked prefill, a prefix first) or go beyond it (assisted decoding's first candidates)."""
    B, L, n = k.shape[0], k.shape[2], prepared.shape[0]
    if B % n:
        raise RuntimeError(
            f"CocktailCache was prepared for {n} prompt(s) but the model's prefill has batch {B}; pass the "
            "output of prepare_inputs to generate unchanged"
        )
    if past >= prompt_len:
        watch.disarm()
        return
    expected = prepared.repeat_interleave(B // n, dim=0)[:, past : past + L]
    seen = watch.check_ids(expected, L)
    if seen is not None and not seen[0]:
        got = seen[1][:, : expected.shape[1]].to(expected.device)
        b, t = (got != expected).nonzero()[0].tolist()
        raise ValueError(
            "CocktailCache: the prefill's input_ids differ from the prompt prepared by prepare_inputs (sequence "
            f"{b}, token {past + t}: id {int(got[b, t])} where the prepared prompt has {int(expected[b, t])}); "
            "pass the output of prepare_inputs to generate unchanged, or call prepare_inputs again for this "
            "prompt"
        )
    if past + L >= prompt_len:
        watch.disarm()


def check_head_dims(k: torch.Tensor, v: torch.Tensor, model_type: str | None) -> None:
    """Refuse keys and values of different head dims: multi-head latent attention (DeepSeek-V2/V3, MiniCPM3)
    caches a compressed latent and a shared rotary key instead of per-head keys and values."""
    if k.shape[-1] != v.shape[-1]:
        model = f"{model_type} models" if model_type else "this model"
        raise ValueError(
            f"CocktailCache does not support {model}: keys and values have different head dims: K {k.shape[-1]}, "
            f"V {v.shape[-1]} (multi-head latent attention, as in DeepSeek-V2/V3 or MiniCPM3, caches a compressed "
            "latent rather than per-head keys and values); use the model's own cache, e.g. DynamicCache()"
        )
