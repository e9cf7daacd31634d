"""One small class per kind of KV-cache method, and :func:`build_cache`, the one place a method's cache is made.

A method makes an empty cache (``new_cache``), may prepare it for a prompt (``prepare``: the Cocktail kinds locate
the context and set their precision plan), and fills it from a full-precision prefill (``load_prefill``). Kinds:

* ``dynamic``: ``DynamicCache`` (the model's own precision; its bytes are counted at FP16 size).
* ``cocktail``: :class:`hf_cocktail.CocktailCache` with ``CocktailConfig`` overrides (paper search, uniform bits,
  BM25 scores, neighbours, sinks...). Only the context chunks are quantized.
* ``nosearch``: the paper search's precision counts, assigned to random chunks (seeded by the example id).
* ``matched``: budget mode at exactly paper-Cocktail's bits per element for the example, with the method's own
  config (e.g. ``beta=0``: INT4 first).
* ``kivi``: the KIVI-like cache of :mod:`eval.methods.kivi` (every token quantized outside a residual window).
* ``quantized``: ``transformers.QuantizedCache`` (hqq / optimum-quanto backend) at transformers' defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import BatchEncoding, DynamicCache, QuantizedCache
from transformers.cache_utils import Cache

from hf_cocktail import CocktailCache, CocktailConfig, offline_encoder_path

from .kivi import KIVI_GROUP, KiviCache


@dataclass
class Request:
    """What a cache is built for: the prompt, the context inside it (verbatim), the search query, the example's id
    (seeds the ``nosearch`` shuffle) and the keyword arguments the prompt is tokenized with."""

    prompt: str
    context: str | None = None
    query: str | None = None
    example_id: str = "x"
    tokenizer_kwargs: dict = field(default_factory=dict)


def example_seed(example_id: str) -> int:
    return zlib.crc32(str(example_id).encode("utf-8"))


def is_sliding_layer(item: Any) -> bool:
    """A sliding-window layer of the model's own cache (``DynamicSlidingWindowLayer``), as :func:`prefill_items`
    hands it over."""
    return getattr(item, "is_sliding", False) is True


def prefill_items(dyn: DynamicCache) -> list:
    """What every kind's ``load_prefill`` takes from a full-precision prefill ``DynamicCache(config=...)``: per
    layer the ``(keys, values)`` pair of a full-attention layer, or the sliding-window layer itself (it holds only
    its window and knows how many tokens it has seen, which a bare pair cannot say)."""
    return [layer if is_sliding_layer(layer) else (layer.keys, layer.values) for layer in dyn.layers]


def _num_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


@dataclass(frozen=True)
class Method:
    """A named KV-cache method of the evaluation (base class: subclasses make the cache)."""

    name: str
    description: str
    kind: ClassVar[str] = ""

    def new_cache(self, model, encoder: str | None = None) -> Cache:
        raise NotImplementedError

    def prepare(self, cache: Cache, tokenizer, request: Request) -> BatchEncoding | None:
        """Work on the prompt before the cache is filled; returns the model inputs it tokenized, or None when the
        prompt's plain tokenization is the input."""
        return None

    @property
    def reads_prefill_queries(self) -> bool:
        """True when ``load_prefill`` needs the prefill's attention queries (``prefill_queries``)."""
        return False

    def load_prefill(self, cache: Cache, pairs: list, split_attention: bool = True, prefill_queries=None) -> None:
        """Fill ``cache`` with a full-precision prefill: per layer a ``(keys, values)`` pair or a sliding-window
        layer (:func:`prefill_items`; ``prefill_queries``: per layer the queries of the prompt's last tokens, for
        the methods that read them). A ``DynamicCache`` takes a copy of each sliding layer (later steps replace
        its tensors, never write into them); other caches refuse sliding-window models."""
        for i, item in enumerate(pairs):
            if is_sliding_layer(item):
                if not isinstance(cache, DynamicCache) or len(cache.layers) <= i:
                    raise ValueError(
                        f"method {self.name!r} ({self.kind}) does not support sliding-window layers (layer {i}); "
                        "use fp16 or a Cocktail method"
                    )
                cache.layers[i] = copy.copy(item)
            else:
                cache.update(item[0], item[1], i)

    def precision_map(self, cache: Cache) -> list[int] | None:
        """Bits of each context chunk of sequence 0 (Cocktail kinds), else None."""
        return None

    def config_dict(self, encoder: str | None = None) -> dict[str, Any]:
        return {"kind": self.kind, "description": self.description}


@dataclass(frozen=True)
class DynamicMethod(Method):
    kind: ClassVar[str] = "dynamic"

    def new_cache(self, model, encoder=None) -> Cache:
        return DynamicCache(config=model.config)


@dataclass(frozen=True)
class QuantizedCacheMethod(Method):
    """``transformers.QuantizedCache`` with its defaults (``q_group_size=64``, ``residual_length=128``, axis 0)."""

    bits: int = 2
    backend: str = "hqq"
    kind: ClassVar[str] = "quantized"

    def new_cache(self, model, encoder=None) -> Cache:
        return QuantizedCache(backend=self.backend, config=model.config, nbits=self.bits)

    def load_prefill(self, cache, pairs, split_attention=True, prefill_queries=None) -> None:
        for i, item in enumerate(pairs):
            if is_sliding_layer(item):
                raise ValueError(f"method {self.name!r} ({self.kind}) does not support sliding-window layers")
            cache.update(item[0].clone(), item[1].clone(), i)  # it may quantize in place: the prefill stays intact

    def config_dict(self, encoder=None) -> dict[str, Any]:
        return {
            **super().config_dict(encoder),
            "backend": self.backend,
            "nbits": self.bits,
            "q_group_size": 64,
            "residual_length": 128,
            "axis_key": 0,
            "axis_value": 0,
        }


@dataclass(frozen=True)
class KiviMethod(Method):
    bits: int = 2
    residual: int = 128
    kind: ClassVar[str] = "kivi"

    def new_cache(self, model, encoder=None) -> Cache:
        return KiviCache(_num_layers(model), self.bits, self.residual)

    def config_dict(self, encoder=None) -> dict[str, Any]:
        return {
            **super().config_dict(encoder),
            "bits": self.bits,
            "residual_length": self.residual,
            "key_group_tokens": KIVI_GROUP,
            "value_group_channels": KIVI_GROUP,
            "scale_dtype": "float16",
        }


@dataclass(frozen=True)
class CocktailMethod(Method):
    """A CocktailCache; ``overrides`` are ``CocktailConfig`` fields (the encoder defaults to the evaluation's)."""

    overrides: dict = field(default_factory=dict)
    kind: ClassVar[str] = "cocktail"

    def cocktail_config(self, encoder: str | None = None) -> CocktailConfig:
        kw = dict(self.overrides)
        kw.setdefault("encoder", encoder or offline_encoder_path())
        kw.setdefault("backend", "auto")
        return CocktailConfig(**kw)

    def new_cache(self, model, encoder=None) -> Cache:
        return CocktailCache(self.cocktail_config(encoder))

    def prepare(self, cache, tokenizer, request) -> BatchEncoding:
        inputs = cache.prepare_inputs(
            tokenizer,
            request.prompt,
            contexts=request.context or None,
            queries=request.query,
            **request.tokenizer_kwargs,
        )
        self.plan(cache, request.example_id)
        return inputs

    @torch.no_grad()
    def plan(self, cache: CocktailCache, example_id: str) -> None:
        """Impose a precision plan before the cache is filled (the plain kind lets the search run at prefill)."""

    @property
    def reads_prefill_queries(self) -> bool:
        fields = dict(self.overrides)  # salient tokens and rotation="auto" read the prefill's queries
        return fields.get("salient_tokens", 0) > 0 or fields.get("rotation") == "auto"

    def load_prefill(self, cache, pairs, split_attention=True, prefill_queries=None) -> None:
        # detached aliases: load_prefill tags the key tensors it is given, which must not leak into the shared prefill;
        # sliding-window layers are copied by the cache
        pairs = [item if is_sliding_layer(item) else (item[0].detach(), item[1].detach()) for item in pairs]
        cache.load_prefill(pairs, split_attention=split_attention, prefill_queries=prefill_queries)

    def precision_map(self, cache) -> list[int]:
        return cache.precision_map()[0]

    def config_dict(self, encoder=None) -> dict[str, Any]:
        return {**super().config_dict(encoder), "cocktail_config": self.cocktail_config(encoder).to_dict()}


@dataclass(frozen=True)
class ShuffledPlanMethod(CocktailMethod):
    """Ablation: the paper search's precision counts, shuffled over the chunks (seeded by the example id)."""

    kind: ClassVar[str] = "nosearch"

    @torch.no_grad()
    def plan(self, cache, example_id) -> None:
        cache.run_search()
        bits = [list(row) for row in cache.precision_map()]
        rng = random.Random(example_seed(example_id))
        for row in bits:
            rng.shuffle(row)
        cache.set_precisions(bits)


@dataclass(frozen=True)
class BudgetMatchedMethod(CocktailMethod):
    """The paper search (alpha .6, beta .1, encoder scores) fixes the example's bits per element; the method's own
    config (e.g. ``beta=0``, another scorer) then runs in budget mode at exactly that budget."""

    kind: ClassVar[str] = "matched"

    @torch.no_grad()
    def plan(self, cache, example_id) -> None:
        own = cache.config
        cache.config = dataclasses.replace(own, beta=0.1, alpha=0.6, scorer="encoder", target_bits=None)
        cache.run_search()
        target = cache.plan_bits_per_element()[0]
        cache.config = dataclasses.replace(own, target_bits=max(target, own.packed_bits_per_element(2)))
        cache.run_search()


def build_cache(
    method: Method, model, tokenizer=None, request: Request | None = None, encoder: str | None = None
) -> tuple[Cache, BatchEncoding | None]:
    """``method``'s empty cache for ``request``, and the model inputs its preparation tokenized (None for the kinds
    that need no preparation: the prompt's plain tokenization is the input)."""
    cache = method.new_cache(model, encoder)
    inputs = method.prepare(cache, tokenizer, request) if request is not None else None
    return cache, inputs


def cache_and_inputs(
    method: Method, model, tokenizer, request: Request, encoder: str | None = None
) -> tuple[Cache, BatchEncoding]:
    """The cache and the inputs of a plain ``model.generate(**inputs, **cache_kwargs(model, cache))``."""
    cache, inputs = build_cache(method, model, tokenizer, request, encoder)
    if inputs is None:
        inputs = tokenizer(request.prompt, return_tensors="pt", **request.tokenizer_kwargs)
    return cache, inputs
