"""What a prefill really was, seen from a cache: the token ids the model embedded and the model's config.

A transformers cache receives key/value states only. To check that a prefill runs on the prompt that
``CocktailCache.prepare_inputs`` planned, a cache *arms* its :class:`PrefillWatch` from ``prepare_inputs`` until its
prefill is complete. While at least one watch is armed, one process-wide forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``) records, for every armed watch, the integer inputs of
``nn.Embedding`` calls (the token ids a model embeds) and the text config of the transformers modules called. The
hook is removed as soon as no watch is armed, so nothing runs outside those windows.

A cache used without ``prepare_inputs`` plans its prompt from the prefill itself, so its watch is armed from the
cache's construction (and after ``reset``) until its first prefill. The padding of a batch is only in the attention
mask, which no module-wide hook sees (arguments by keyword); so, on the first call of a transformers model seen
while armed, a keyword pre-hook goes on its base model (``model.base_model``, which the outer model calls with
``input_ids=``, ``attention_mask=`` and the cache by keyword): a watch records the 2D mask and the ids of the forward
that passes its own cache. Those hooks are removed with the module-wide one.

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

from hf_cocktail.planning.salient import check_salient_layers
from hf_cocktail.storage.layer_bits import check_layer_count

_ARMED: weakref.WeakSet[PrefillWatch] = weakref.WeakSet()
_LOCK = threading.RLock()  # re-entered when a watch collected inside a locked block removes the hooks
_HANDLE: Any = None
_KEEP_IDS = 8  # embedding calls remembered per watch (the prefill's own comes right before its first cache update)
_BASE_HOOKS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()  # base model -> its handle
_CACHE_KEYWORDS = ("cache", "past_key_values")  # the cache's keyword, renamed in transformers 5.24


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
        _hook_base_model(module, config)


def _hook_base_model(module: nn.Module, config: Any) -> None:
    """Put the keyword pre-hook on ``module``'s base model (once), remembering the outer model's ``config``."""
    base = getattr(module, "base_model", None)
    if not isinstance(base, nn.Module) or base is module or base in _BASE_HOOKS:
        return
    outer = weakref.ref(config)

    def keyword_hook(_m: nn.Module, _args: tuple, kwargs: dict) -> None:
        cache = next((kwargs[k] for k in _CACHE_KEYWORDS if kwargs.get(k) is not None), None)
        if cache is None:
            return
        for watch in list(_ARMED):
            if watch.owner is cache:
                watch.note_forward(kwargs.get("input_ids"), kwargs.get("attention_mask"), outer())

    with _LOCK:
        _BASE_HOOKS[base] = base.register_forward_pre_hook(keyword_hook, with_kwargs=True)


def _remove_hook() -> None:
    global _HANDLE
    with _LOCK:
        if _HANDLE is not None and not len(_ARMED):
            _HANDLE.remove()
            _HANDLE = None
            for handle in list(_BASE_HOOKS.values()):
                handle.remove()
            _BASE_HOOKS.clear()


class PrefillWatch:
    """One cache's view of the forwards that fill it (see the module docstring)."""

    def __init__(self, owner: Any = None) -> None:
        self.ids: collections.deque[torch.Tensor] = collections.deque(maxlen=_KEEP_IDS)
        self._owner = weakref.ref(owner) if owner is not None else None  # the cache whose forwards are recorded
        self.forward_ids: torch.Tensor | None = None  # (B, L) the ids of the last forward passing the owner
        self.forward_mask: torch.Tensor | None = None  # (B, past + L) its 2D attention mask (None: none passed)
        weakref.finalize(self, _remove_hook)  # a watch collected while armed: the hooks go if it was the last
        self.model_type: str | None = None
        self.num_layers: int | None = None
        self.model_config: Any = None  # the transformers config of the model seen (for the per-layer-type layout)
        self.last_config: Any = None  # the config of the module called last: the model whose forward fills the cache

    @property
    def armed(self) -> bool:
        return self in _ARMED

    @property
    def owner(self) -> Any:
        return self._owner() if self._owner is not None else None

    def arm(self) -> None:
        global _HANDLE
        self.ids.clear()
        self.forward_ids = self.forward_mask = None
        with _LOCK:
            _ARMED.add(self)
            if _HANDLE is None:
                _HANDLE = nn.modules.module.register_module_forward_pre_hook(_hook)

    def disarm(self) -> None:
        self.ids.clear()
        self.forward_ids = self.forward_mask = None
        _ARMED.discard(self)
        _remove_hook()

    def note_forward(self, ids: Any, mask: Any, outer_config: Any) -> None:
        """A forward of a model whose base model got this watch's cache: its ids and 2D mask; its outer model's
        config is the model that fills the cache (it wins over a config another model's forward showed first)."""
        self.forward_ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        self.forward_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        if outer_config is not None:
            self.model_config = outer_config

    def note_config(self, config: Any) -> None:
        if self.model_config is None:
            self.model_config = config  # the outermost module's (seen first): the one DynamicCache(config=) takes
        self.last_config = config  # an assistant model runs first: the attention calling the cache is the model's
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
        owner = self.owner
        new = PrefillWatch(memo.get(id(owner), owner))
        new.model_type, new.num_layers, new.model_config = self.model_type, self.num_layers, self.model_config
        new.last_config = self.last_config
        if self.armed:
            new.arm()
        new.forward_ids, new.forward_mask = self.forward_ids, self.forward_mask
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
        if watch.model_type == "cpmant":
            raise ValueError(
                "CocktailCache does not support CPM-Ant: its forward puts its own prompt tokens (config.prompt_length "
                "of them) before input_ids, so the tokens it caches are not the prompt prepare_inputs planned; use "
                "the model's own cache (DynamicCache)"
            )
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


def attn_implementation(model_config: Any) -> str | None:
    """The attention implementation a transformers config names for its text model (``None`` where it names none)."""
    if model_config is None:
        return None
    try:
        text = model_config.get_text_config(decoder=True)
    except Exception:  # any config object: read what is there
        text = model_config
    impl = getattr(text, "_attn_implementation", None) or getattr(model_config, "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def check_attention_reader(config: Any, model_config: Any, scores_from_attention: bool) -> None:
    """``salient_tokens`` and ``scorer="attention"`` read the prefill attention, which only
    ``attn_implementation="cocktail"`` hands to the cache: refuse another implementation as soon as the model's config
    says which it is (before the prefill does any work)."""
    impl = attn_implementation(model_config)
    if impl is None or impl == "cocktail":
        return
    readers = [f"salient_tokens={config.salient_tokens!r}"] if config.salient_tokens > 0 else []
    readers += ["scorer='attention'"] if scores_from_attention else []
    if readers:
        raise ValueError(
            f"{' and '.join(readers)} read(s) the prefill attention, which only attn_implementation='cocktail' "
            f"records, but the model uses attn_implementation={impl!r}: load it with attn_implementation='cocktail' "
            "(or fill the cache with load_prefill(..., prefill_queries=...))"
        )


def check_layer_fields(config: Any, num_layers: int, cocktail_layers: list[int]) -> None:
    """The fields of ``config`` that name layers (``layer_bits``, ``full_precision_layers``, ``salient_tokens``)
    against the model's ``num_layers``; ``cocktail_layers``: the indices of its full-attention layers."""
    check_layer_count(config.layer_bits, num_layers, cocktail_layers)
    layers = config.full_precision_layers
    if layers and layers[-1] >= num_layers:
        raise ValueError(
            f"full_precision_layers {layers} names layer(s) {[i for i in layers if i >= num_layers]} but the "
            f"model has {num_layers} layers (indices 0..{num_layers - 1})"
        )
    check_salient_layers(config.salient_tokens, layers, cocktail_layers)
