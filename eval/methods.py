"""The KV-cache methods compared by the evaluation scripts, and how each is built from one shared prefill.

Every method is evaluated from the same full-precision prefill: :func:`prefill` runs the model once over the whole
prompt into a ``DynamicCache`` and keeps the last token's logits; :func:`branch` turns that prefill into the method's
cache, the first new token is the argmax of the shared logits and the method's cache generates the rest (greedy).
This is exactly what a plain ``model.generate`` with the method's cache does, because every cache here attends at
full precision during its own prefill and quantizes only what later steps read (tested in
``tests/test_eval_harness.py`` for fp16, cocktail and kivi). Branching the prefill of all tokens but the last and
running the last prompt token as a decode step would NOT be equivalent for the quantized caches: that token's keys,
values and the first new token would then come from attention over the quantized context.

Methods (``METHODS``):

* ``fp16``: ``DynamicCache`` (the model's own precision; its bytes are counted at FP16 size).
* ``cocktail``: :class:`hf_cocktail.CocktailCache`, paper defaults (chunk 32, alpha 0.6, beta 0.1), retrieval encoder
  all-MiniLM-L6-v2 (offline). Only the context chunks are quantized; template, question and generated tokens stay
  at full precision.
* ``int4`` / ``int2``: CocktailCache with ``uniform_bits`` (every context chunk INT4 / INT2, same quantizer).
* ``nosearch``: ablation: the same number of FP16 / INT4 / INT2 chunks as ``cocktail`` for that example, assigned to
  random chunks (seeded by the example id) with ``set_precisions``.
* ``kivi2`` / ``kivi4`` (R=128) and ``kivi2_r32`` / ``kivi4_r32``: a KIVI-like cache (:class:`KiviCache`): keys
  quantized per channel in groups of 32 tokens, values per token in groups of 32 channels (the quantizer of
  ``hf_cocktail.quant``), the most recent tokens kept at full precision (keys: the ``len % R`` newest, quantized R at a
  time as in KIVI's code; values: the R newest). Unlike Cocktail, *every* token (template, question, generated) is
  quantized once it leaves the residual window. This is not expressible as a CocktailCache precision plan (Cocktail
  never quantizes non-context tokens), hence the separate Cache subclass.
* ``hqq2`` / ``hqq4`` / ``quanto2`` / ``quanto4``: ``transformers.QuantizedCache`` with the hqq / optimum-quanto
  backend at its defaults (``q_group_size=64``, ``residual_length=128``, ``axis_key=axis_value=0``).
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_cocktail import CocktailCache, CocktailConfig, offline_encoder_path
from hf_cocktail import quant

from .common import UsageError


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "dynamic" | "cocktail" | "nosearch" | "matched" | "kivi" | "quantized"
    description: str
    cocktail: dict = field(default_factory=dict)  # CocktailConfig overrides (cocktail / nosearch kinds)
    bits: int | None = None
    residual: int | None = None
    backend: str | None = None

    def cocktail_config(self, encoder: str | None = None) -> CocktailConfig:
        kw = dict(self.cocktail)
        kw.setdefault("encoder", encoder or offline_encoder_path())
        kw.setdefault("backend", "auto")
        return CocktailConfig(**kw)

    def config_dict(self, encoder: str | None = None) -> dict:
        d: dict[str, Any] = {"kind": self.kind, "description": self.description}
        if self.kind in ("cocktail", "nosearch", "matched"):
            d["cocktail_config"] = self.cocktail_config(encoder).to_dict()
        if self.kind == "kivi":
            d.update(bits=self.bits, residual_length=self.residual, key_group_tokens=KIVI_GROUP,
                     value_group_channels=KIVI_GROUP, scale_dtype="float16")
        if self.kind == "quantized":
            d.update(backend=self.backend, nbits=self.bits, q_group_size=64, residual_length=128, axis_key=0,
                     axis_value=0)
        return d


KIVI_GROUP = 32

METHODS: dict[str, Method] = {m.name: m for m in [
    Method("fp16", "dynamic", "DynamicCache, full precision (bytes counted at FP16)"),
    Method("cocktail", "cocktail", "Cocktail: chunk search, FP16/INT4/INT2 context chunks (alpha .6, beta .1)"),
    Method("int4", "cocktail", "every context chunk INT4 (CocktailCache uniform_bits=4)", {"uniform_bits": 4}),
    Method("int2", "cocktail", "every context chunk INT2 (CocktailCache uniform_bits=2)", {"uniform_bits": 2}),
    Method("nosearch", "nosearch", "ablation: Cocktail's precision counts, random chunk assignment"),
    # beyond the paper (issue 7): same retrieval encoder unless said otherwise
    Method("int4first", "matched", "budget mode at paper-Cocktail's bits for the example, INT4 first (no FP16 "
           "unless all INT4 fits): target_bits=paper's, beta=0", {"beta": 0.0}),
    Method("bm25", "cocktail", "paper thresholds, chunks scored by BM25 (no encoder)", {"scorer": "bm25"}),
    Method("bm25_int4first", "matched", "BM25 scores, budget at paper-Cocktail's bits, INT4 first",
           {"beta": 0.0, "scorer": "bm25"}),
    Method("cocktail_nb1", "cocktail", "paper Cocktail + the chunks next to each FP16 chunk at FP16 (neighbors=1)",
           {"neighbors": 1}),
    Method("cocktail_a02", "cocktail", "paper search with alpha=0.2 (more INT4; more bytes)", {"alpha": 0.2}),
    Method("int2_nosink", "cocktail", "every context chunk INT2, no attention-sink protection (sink_tokens=0)",
           {"uniform_bits": 2, "sink_tokens": 0}),
    Method("cocktail_nosink", "cocktail", "paper Cocktail without attention-sink protection (sink_tokens=0)",
           {"sink_tokens": 0}),
    Method("kivi2", "kivi", "KIVI-like 2-bit, K per-channel / V per-token, FP residual R=128", bits=2, residual=128),
    Method("kivi4", "kivi", "KIVI-like 4-bit, K per-channel / V per-token, FP residual R=128", bits=4, residual=128),
    Method("kivi2_r32", "kivi", "KIVI-like 2-bit, FP residual R=32", bits=2, residual=32),
    Method("kivi4_r32", "kivi", "KIVI-like 4-bit, FP residual R=32", bits=4, residual=32),
    Method("hqq2", "quantized", "transformers QuantizedCache, hqq backend, 2 bits", bits=2, backend="hqq"),
    Method("hqq4", "quantized", "transformers QuantizedCache, hqq backend, 4 bits", bits=4, backend="hqq"),
    Method("quanto2", "quantized", "transformers QuantizedCache, quanto backend, 2 bits", bits=2, backend="quanto"),
    Method("quanto4", "quantized", "transformers QuantizedCache, quanto backend, 4 bits", bits=4, backend="quanto"),
]}


def register_preset(name_or_path: str) -> Method:
    """Add the method ``preset``: a CocktailCache with ``CocktailConfig.from_pretrained(name_or_path)``."""
    try:
        cfg = CocktailConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--preset {name_or_path!r}: {e}") from e
    fields = cfg.to_dict()
    fields.pop("format_version", None)
    fields.pop("encoder", None)  # the evaluation's encoder (offline MiniLM unless --encoder)
    METHODS["preset"] = Method("preset", "cocktail", f"CocktailConfig.from_pretrained({name_or_path!r})", fields)
    return METHODS["preset"]


def parse_methods(spec: str) -> list[Method]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UsageError("--methods is empty")
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise UsageError(f"unknown method(s) {bad}; known: {sorted(METHODS)}")
    if len(set(names)) != len(names):
        raise UsageError(f"--methods lists a method twice: {names}")
    return [METHODS[n] for n in names]


def example_seed(example_id: str) -> int:
    return zlib.crc32(str(example_id).encode("utf-8"))


# ---------------------------------------------------------------------------------------------- KIVI-like cache
class KiviLayer(CacheLayerMixin):
    """One layer of :class:`KiviCache` (batch size 1 or more; every sequence has the same length)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, bits: int, residual: int, group: int = KIVI_GROUP, scale_dtype=torch.float16):
        super().__init__()
        if residual % group:
            raise ValueError(f"KIVI residual length {residual} must be a multiple of the key group size {group}")
        self.bits, self.residual, self.group, self.scale_dtype = bits, residual, group, scale_dtype
        self.kq: list | None = None  # per sequence: (codes, scale, zero), keys of quantized tokens
        self.vq: list | None = None
        self.kf = self.vf = None  # full-precision residual (B, H, n, D)
        self.seq_len = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        empty_k = quant.quantize_pack_keys(key_states.new_zeros((H, 0, D)), self.bits, self.group, self.scale_dtype)
        empty_v = quant.quantize_pack_values(value_states.new_zeros((H, 0, D)), self.bits, self.group,
                                             self.scale_dtype)
        self.kq = [empty_k for _ in range(B)]
        self.vq = [empty_v for _ in range(B)]
        self.kf = key_states[:, :, :0]
        self.vf = value_states[:, :, :0]
        self.is_initialized = True

    @staticmethod
    def _cat3(a, b):
        return tuple(torch.cat([x, y], dim=1) for x, y in zip(a, b))

    def update(self, key_states, value_states, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        self.seq_len += key_states.shape[2]
        self.kf = torch.cat([self.kf, key_states], dim=2)
        self.vf = torch.cat([self.vf, value_states], dim=2)
        nk = (self.kf.shape[2] // self.residual) * self.residual  # keys: quantize whole residual blocks
        if nk:
            for b in range(self.kf.shape[0]):
                self.kq[b] = self._cat3(self.kq[b], quant.quantize_pack_keys(self.kf[b, :, :nk], self.bits,
                                                                              self.group, self.scale_dtype))
            self.kf = self.kf[:, :, nk:]
        nv = self.vf.shape[2] - self.residual  # values: keep the R newest at full precision
        if nv > 0:
            for b in range(self.vf.shape[0]):
                self.vq[b] = self._cat3(self.vq[b], quant.quantize_pack_values(self.vf[b, :, :nv], self.bits,
                                                                                self.group, self.scale_dtype))
            self.vf = self.vf[:, :, nv:]
        if first:  # the prefill attends at full precision, as in KIVI (quantization only affects later steps)
            return key_states, value_states
        return self.dequantized()

    def dequantized(self):
        ks = [quant.dequantize_keys(*self.kq[b], self.bits, self.group, self.dtype) for b in range(len(self.kq))]
        vs = [quant.dequantize_values(*self.vq[b], self.bits, self.group, self.dtype) for b in range(len(self.vq))]
        keys = torch.cat([torch.stack(ks), self.kf], dim=2)
        values = torch.cat([torch.stack(vs), self.vf], dim=2)
        return keys, values

    def get_mask_sizes(self, query_length: int):
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kq = self.vq = self.kf = self.vf = None
        self.seq_len = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("KiviCache does not support beam search")

    def kv_nbytes(self, deployed: bool = True) -> int:
        """Deployed bytes: packed codes, FP16 scales/zeros, full-precision residual at 2 bytes/element
        (``deployed=False``: the bytes really held)."""
        from .common import deployed_tensor_bytes

        if not self.is_initialized:
            return 0
        total = deployed_tensor_bytes(self.kf, deployed) + deployed_tensor_bytes(self.vf, deployed)
        for parts in (self.kq, self.vq):
            for triple in parts:
                total += sum(deployed_tensor_bytes(t, deployed) for t in triple)
        return total

    def quantized_tokens(self) -> tuple[int, int]:
        return self.seq_len - self.kf.shape[2], self.seq_len - self.vf.shape[2]


class KiviCache(Cache):
    """KIVI-like quantized KV cache (simulated: the quantized part is dequantized at each step for attention)."""

    def __init__(self, num_layers: int, bits: int = 2, residual: int = 128, group: int = KIVI_GROUP,
                 scale_dtype=torch.float16):
        if bits not in (2, 4):
            raise ValueError(f"KiviCache bits must be 2 or 4, got {bits}")
        super().__init__(layers=[KiviLayer(bits, residual, group, scale_dtype) for _ in range(num_layers)])

    def kv_nbytes(self, deployed: bool = True) -> int:
        return sum(layer.kv_nbytes(deployed) for layer in self.layers)


# ---------------------------------------------------------------------------------------------- prefill + branch
@torch.no_grad()
def apply_plan(method: Method, cache: CocktailCache, example_id: str) -> None:
    """The precision plan of the plan-imposing kinds, before the cache is filled.

    * ``nosearch``: the paper search's precision counts, shuffled over the chunks (seeded by the example id).
    * ``matched``: the paper search (alpha .6, beta .1, encoder scores) fixes the example's bits per element; the
      method's own config (e.g. ``beta=0``, another scorer) then runs in budget mode at exactly that budget.
    """
    if method.kind == "nosearch":
        cache.run_search()
        bits = [list(row) for row in cache.precision_map()]
        rng = random.Random(example_seed(example_id))
        for row in bits:
            rng.shuffle(row)
        cache.set_precisions(bits)
    elif method.kind == "matched":
        own = cache.config
        cache.config = dataclasses.replace(own, beta=0.1, alpha=0.6, scorer="encoder", target_bits=None)
        cache.run_search()
        target = cache.plan_bits_per_element()[0]
        cache.config = dataclasses.replace(own, target_bits=max(target, own.packed_bits_per_element(2)))
        cache.run_search()


def prefill(model, input_ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Run the model over the whole prompt into a ``DynamicCache`` (the shared full-precision prefill).

    Returns the cache and the logits of the last prompt token ``(1, vocab)``: the first new token comes from them
    for every method, as in a plain ``generate`` (every cache here attends at full precision during its own
    prefill and quantizes afterwards)."""
    if input_ids.shape[1] < 1:
        raise ValueError("the prompt is empty")
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].float()


def _pairs(dyn: DynamicCache):
    return [(layer.keys, layer.values) for layer in dyn.layers]


@dataclass
class Branch:
    cache: Cache
    setup_s: float  # time to build this cache from the shared prefill (search + quantization)
    precision_counts: dict | None = None  # {"fp16": n, "int4": n, "int2": n} context chunks (cocktail kinds)
    precision_map: list | None = None


def branch(method: Method, model, tokenizer, dyn: DynamicCache, input_ids: torch.Tensor, prompt: str,
           context: str | None, query: str | None, example_id: str, tokenizer_kwargs: dict | None = None,
           encoder: str | None = None, split_attention: bool = True) -> Branch:
    """Build ``method``'s cache holding the shared prefill ``dyn`` (all prompt tokens).

    ``input_ids`` (1, L) must be ``tokenizer(prompt, **tokenizer_kwargs)``; ``context`` must appear verbatim in
    ``prompt`` (the Cocktail kinds search over its chunks with ``query``)."""
    import time

    t0 = time.perf_counter()
    tokenizer_kwargs = tokenizer_kwargs or {}
    L = input_ids.shape[1]
    if dyn.get_seq_length() != L:
        raise ValueError(f"the prefill holds {dyn.get_seq_length()} tokens, expected the {L} prompt tokens")
    if method.kind == "dynamic":
        cache = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(_pairs(dyn)):
            cache.update(k, v, i)
        return Branch(cache, time.perf_counter() - t0)
    if method.kind == "quantized":
        from transformers import QuantizedCache

        cache = QuantizedCache(backend=method.backend, config=model.config, nbits=method.bits)
        for i, (k, v) in enumerate(_pairs(dyn)):
            cache.update(k.clone(), v.clone(), i)
        return Branch(cache, time.perf_counter() - t0)
    if method.kind == "kivi":
        cache = KiviCache(model.config.get_text_config(decoder=True).num_hidden_layers, method.bits,
                          method.residual)
        for i, (k, v) in enumerate(_pairs(dyn)):
            cache.update(k, v, i)
        return Branch(cache, time.perf_counter() - t0)
    # Cocktail kinds
    cache = CocktailCache(method.cocktail_config(encoder))
    enc = cache.prepare_inputs(tokenizer, prompt, contexts=context or None, queries=query,
                               **tokenizer_kwargs)
    if not torch.equal(enc["input_ids"].to(input_ids.device), input_ids):
        raise RuntimeError("CocktailCache.prepare_inputs tokenized the prompt differently from the shared prefill")
    apply_plan(method, cache, example_id)
    # detached aliases: load_prefill tags the key tensors it is given, which must not leak into the shared prefill
    cache.load_prefill([(k.detach(), v.detach()) for k, v in _pairs(dyn)], split_attention=split_attention)
    pmap = cache.precision_map()
    counts = {"fp16": sum(b == 16 for b in pmap[0]), "int4": sum(b == 4 for b in pmap[0]),
              "int2": sum(b == 2 for b in pmap[0])}
    return Branch(cache, time.perf_counter() - t0, counts, pmap[0])


@torch.no_grad()
def generate_from_branch(model, cache, input_ids: torch.Tensor, first_logits: torch.Tensor, max_new_tokens: int,
                         eos_token_id: list[int] | None = None, min_new_tokens: int = 0) -> torch.Tensor:
    """Greedy generation continuing a cache that holds the whole prompt: the first new token is the argmax of the
    prefill's ``first_logits`` (stop tokens masked when ``min_new_tokens`` >= 1), the rest comes from
    ``model.generate`` on the method's cache. Returns the new tokens ``(1, n)``."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    eos = list(eos_token_id or [])
    logits = first_logits.clone()
    if min_new_tokens >= 1 and eos:
        logits[:, eos] = float("-inf")
    first = logits.argmax(-1, keepdim=True).to(input_ids.device)  # (1, 1)
    if max_new_tokens == 1 or int(first) in eos:
        return first
    ids = torch.cat([input_ids, first], dim=1)
    kwargs: dict[str, Any] = {}
    if eos:
        kwargs["eos_token_id"] = eos
        kwargs["pad_token_id"] = eos[0]
    if min_new_tokens > 1:
        kwargs["min_new_tokens"] = min_new_tokens - 1
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=max_new_tokens - 1, do_sample=False, temperature=None, top_p=None,
                         top_k=None, num_beams=1, **kwargs)
    return out[:, input_ids.shape[1]:]


def plain_cache(method: Method, model, tokenizer, prompt: str, context: str | None, query: str | None,
                example_id: str = "x", tokenizer_kwargs: dict | None = None, encoder: str | None = None):
    """The method's cache and the ``generate`` inputs for a normal (non-branched) ``model.generate`` call.

    Returns ``(cache, inputs)``; ``cache`` is None for ``fp16`` (generate makes its own ``DynamicCache``)."""
    tokenizer_kwargs = tokenizer_kwargs or {}
    if method.kind in ("cocktail", "nosearch", "matched"):
        cache = CocktailCache(method.cocktail_config(encoder))
        inputs = cache.prepare_inputs(tokenizer, prompt, contexts=context or None, queries=query,
                                      **tokenizer_kwargs)
        apply_plan(method, cache, example_id)
        return cache, inputs
    inputs = tokenizer(prompt, return_tensors="pt", **tokenizer_kwargs)
    if method.kind == "dynamic":
        return None, inputs
    if method.kind == "kivi":
        return KiviCache(model.config.get_text_config(decoder=True).num_hidden_layers, method.bits,
                         method.residual), inputs
    from transformers import QuantizedCache

    return QuantizedCache(backend=method.backend, config=model.config, nbits=method.bits), inputs
