"""A Cocktail cache's lifecycles beyond one ``generate``: branching a shared full-precision prefill
(``load_prefill``), a new question about the same document (``requery``), independent copies (``deepcopy``).

A mixin of :class:`~hf_cocktail.CocktailCache` (it uses the cache's plans, layers and prefill watch).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from hf_cocktail.cache import layout
from hf_cocktail.cache.layer import CocktailLayer, LayerState
from hf_cocktail.cache.prefill_watch import check_head_dims
from hf_cocktail.planning.plans import INDEX_DTYPE


def _views_more(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view into a larger storage (a sliding layer's window sliced from the whole prefill)."""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


def _detached_copy(layer: Any) -> Any:
    """A deep copy of one of the model's own cache layers, its tensors detached (a prefill run with autograd on
    leaves tensors with a graph, which ``copy.deepcopy`` refuses) and each holding only its own elements: after a
    prefill a sliding layer's window is a view of the whole prompt's keys/values, which ``copy.deepcopy`` would copy
    whole (on Gemma 3 270M at 2K tokens, 4x the window)."""
    tensors = [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    memo = {id(t): t.detach().clone() for t in tensors if t.requires_grad or _views_more(t)}
    return copy.deepcopy(layer, memo)


class CacheLifecycles:
    """``load_prefill``, ``requery``, ``__deepcopy__`` and chunked prefill of :class:`~hf_cocktail.CocktailCache`."""

    # provided by CocktailCache
    config: Any
    layers: list
    prompt_len: int
    _plans: list | None
    _encoder: Any
    _input_ids: torch.Tensor | None
    _partial: dict[int, tuple[torch.Tensor, torch.Tensor]]
    _watch: Any
    run_search: Any
    _check_layer_count: Any
    _cocktail_layers: Any
    scores_from_attention: Any

    def load_prefill(
        self,
        past_key_values,
        split_attention: bool | None = None,
        prefill_queries: list[torch.Tensor] | None = None,
        scaling: float | None = None,
    ) -> None:
        """Fill the cache from an already computed full-precision prefill, e.g. a ``DynamicCache`` (one ``(keys,
        values)`` pair of ``(B, H_kv, L', D)`` per layer, ``L'`` <= the prepared prompt length and covering the
        context). Lets one prefill be branched into several caches. ``split_attention=None`` (default) detects the
        attention implementation at the first decode step; ``True`` asserts ``attn_implementation="cocktail"``
        (saves that step's dequantization; wrong results under another implementation), ``False`` forces the
        dequantizing path. ``prefill_queries``: per layer, the attention's queries ``(B, H_q, L_q, D)`` of the
        prefill's last ``L_q`` tokens (after RoPE, as the attention function received them), for what reads the
        prefill attention (``salient_tokens``, ``scorer="attention"``); ``scaling``: the softmax scale (default
        ``D ** -0.5``)."""
        self.layers: list = []
        self._partial = {}
        source = list(past_key_values.layers) if hasattr(past_key_values, "layers") else list(past_key_values)
        pairs = [(layer.keys, layer.values) if hasattr(layer, "keys") else tuple(layer[:2]) for layer in source]
        for k, v in pairs:
            if k is not None:
                check_head_dims(k, v, None)
        self._check_layer_count(len(pairs))
        if prefill_queries is not None and len(prefill_queries) != len(pairs):
            raise ValueError(
                f"prefill_queries must hold one query tensor per layer ({len(pairs)}), got {len(prefill_queries)}"
            )
        for i, (src, (k, v)) in enumerate(zip(source, pairs)):
            if hasattr(src, "keys") and not layout.is_full_attention(src):  # sliding / hybrid / shared: as it is
                self.layers.append(_detached_copy(src))
                continue
            layer = CocktailLayer(self, i)  # type: ignore[arg-type]  # the cache this mixin is part of
            self.layers.append(layer)
            layer.update(k.detach(), v.detach())  # aliases: the caller's tensors are not tagged
            if prefill_queries is not None:
                q = prefill_queries[i]
                layer.observe_prefill_attention(q, k, q.shape[-1] ** -0.5 if scaling is None else scaling)
            layer.after_load_prefill(split_attention)

    def requery(self, tokenizer, prompt: str, query: str, device=None):
        """Answer a new question about the same document without a new prefill (needs ``keep_context_copy``).

        ``prompt`` must start with the same tokens as the previous prompt up to the end of the context. The cache
        drops the old question and answer, re-runs the search for ``query``, and re-packs every chunk from the
        full-precision CPU copy; the next ``generate`` computes only the tokens after the context (at full
        precision, as a prefill would) and gives what a fresh run on ``prompt`` gives.

        Returns:
            the ``BatchEncoding`` of ``prompt`` to pass to ``generate``.
        """
        self._check_requery(query)
        assert self._plans is not None and self._input_ids is not None  # checked above; prepare_inputs set both
        plan = self._plans[0]
        enc = tokenizer(prompt, return_tensors="pt")
        ids = enc["input_ids"]
        end = self._cocktail_layers()[0].context_copy[0].shape[2]
        old = self._input_ids[0, plan.pad : end]
        if ids.shape[1] <= old.shape[0] or not torch.equal(ids[0, : old.shape[0]], old):
            raise ValueError(
                "the new prompt must repeat the previous prompt's tokens up to the end of the context "
                f"({old.shape[0]} tokens) and add the new question after them"
            )
        if plan.pad:
            raise ValueError("requery() needs an unpadded prompt")
        plan.query = query
        plan.layer_mass, plan.layer_salient = {}, {}  # salient_tokens: the new question's prefill attention decides
        self.run_search()
        self._input_ids = ids.to(INDEX_DTYPE, copy=True)
        self.prompt_len = ids.shape[1]
        for layer in self._cocktail_layers():
            layer.prepare_requery(end)
        self._watch.arm()
        return enc.to(device) if device is not None else enc

    def can_requery(self) -> bool:
        """True when :meth:`requery` can answer a new question from this cache: a finished generate on one
        document with ``keep_context_copy`` and only Cocktail layers (sliding-window / hybrid layers cannot be
        rewound)."""
        return (
            bool(self.config.keep_context_copy)
            and bool(self.layers)
            and all(isinstance(layer, CocktailLayer) and layer.context_copy is not None for layer in self.layers)
            and self._plans is not None
            and len(self._plans) == 1
        )

    def _check_requery(self, query: str) -> None:
        if not self.config.keep_context_copy:
            raise RuntimeError("requery() needs CocktailConfig(keep_context_copy=True) when the document is prefilled")
        if any(not isinstance(layer, CocktailLayer) for layer in self.layers):
            raise ValueError(
                "requery() needs every attention layer to be a Cocktail layer; this model also has sliding-window, "
                "linear-attention or shared layers, whose state cannot be rewound to the end of the document (use a "
                "new prepare_inputs instead)"
            )
        if not self.layers or any(layer.context_copy is None for layer in self.layers):
            raise RuntimeError("requery() needs a finished generate on the document first")
        if self._plans is None or len(self._plans) != 1:
            raise ValueError(f"requery() supports one sequence (batch 1), this cache holds {len(self._plans or [])}")
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")

    def __deepcopy__(self, memo: dict) -> Any:
        """``copy.deepcopy(cache)``: an independent cache (its layers belong to the copy), e.g. one shared prefill
        copied per prompt. The encoder, a stateless scorer that may be a whole model, is shared, not copied."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        if self._encoder is not None:
            memo[id(self._encoder)] = self._encoder
        for name, value in self.__dict__.items():
            new.__dict__[name] = copy.deepcopy(value, memo)
        return new

    # ----------------------------------------------------------------- chunked prefill
    def _is_prefill_chunk(self, layer: CocktailLayer, k: torch.Tensor) -> bool:
        """A forward that starts filling an empty layer with fewer tokens than the prepared prompt (chunked
        prefill, or a prefix first), or a later piece of such a prefill."""
        if self._plans is None:
            return False
        if layer.layer_idx in self._partial:
            return True
        return layer.state is LayerState.EMPTY and layer.pending is None and k.shape[2] < self.prompt_len

    def _prefill_chunk(
        self, layer: CocktailLayer, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunked prefill (generate's ``prefill_chunk_size``): keep the prompt's keys/values at full precision
        until the prepared prompt is complete, then hand the whole prompt to the layer at once, so the precision
        plan applies exactly as after a prefill in one forward."""
        if self.scores_from_attention():
            raise ValueError(
                "scorer='attention' needs the whole prompt in one prefill forward; generation's "
                "prefill_chunk_size (chunked prefill) is not supported with it"
            )
        if layer.layer_idx in self._partial:
            pk, pv = self._partial.pop(layer.layer_idx)
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        if k.shape[2] < self.prompt_len:
            self._partial[layer.layer_idx] = (k, v)
            return k, v
        return layer.update(k, v)
