"""`CocktailCache`: a transformers `Cache` whose context chunks are stored at FP16, INT4 or INT2.

Shapes: B batch, H_kv key/value heads, L prompt length (after left padding), D head dim, C chunk size.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import quant
from .config import CocktailConfig
from .search import (TextEncoder, assign_budget, assign_precisions, bm25_scores, get_encoder, promote_neighbors,
                     score_chunks)
from .store import FullPart, LayerStore, PackedSegment, _offsets

logger = logging.getLogger(__name__)
PACKED_BITS = (4, 2)


@dataclass
class SequencePlan:
    """What the search needs and decides for one sequence of the batch (positions in padded coordinates)."""

    pad: int  # left padding tokens
    ctx_start: int  # context token span [ctx_start, ctx_end)
    ctx_end: int
    chunk_texts: list[str]
    query: str | None
    scores: list[float] | None = None
    bits: list[int] | None = None  # one per chunk, original order
    positions: dict = field(default_factory=dict)  # part ("full", 4, 2) -> LongTensor of prompt positions
    origin: int = 0  # index of the prepared prompt this row comes from (beams / return sequences repeat it)
    query_span: tuple[int, int] = (0, 0)  # token span of the query inside the prompt (scorer="attention")
    attn_mass: torch.Tensor | None = None  # (ctx_end - ctx_start,) attention mass from the query tokens

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_texts)

    def chunk_range(self, i: int, chunk_size: int) -> tuple[int, int]:
        a = self.ctx_start + i * chunk_size
        return a, min(a + chunk_size, self.ctx_end)

    def build_positions(self, prefill_len: int, chunk_size: int) -> None:
        """Positions of each part among the first ``prefill_len`` prompt tokens (later ones are appended as new
        tokens to the full-precision part)."""
        if prefill_len < self.ctx_end:
            raise RuntimeError(f"the prefill covers {prefill_len} tokens but the context ends at token "
                               f"{self.ctx_end}: the whole context must be in the prefill")
        parts: dict = {16: [], 4: [], 2: []}
        for i, bits in enumerate(self.bits):
            parts[bits].extend(range(*self.chunk_range(i, chunk_size)))
        full = list(range(self.pad, self.ctx_start)) + parts[16] + list(range(self.ctx_end, prefill_len))
        self.positions = {"full": torch.tensor(full, dtype=torch.long),
                          4: torch.tensor(parts[4], dtype=torch.long), 2: torch.tensor(parts[2], dtype=torch.long)}


class CocktailLayer(CacheLayerMixin):
    """One layer of a :class:`CocktailCache`. Prefill stores the prompt's keys/values into a :class:`LayerStore`
    (context chunks quantized by the precision plan); later tokens are appended to the full-precision part."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: "CocktailCache", layer_idx: int = 0):
        super().__init__()
        self._cache = weakref.ref(cache)  # the cache owns its layers: no reference cycle
        self.layer_idx = layer_idx
        self.all_full = layer_idx in cache.config.full_precision_layers
        self.config = cache.config
        self.store: LayerStore | None = None
        self.in_prefill = False
        self.uses_split_attention = False
        self.seq_len = 0
        self.context_copy = None  # (keys, values) (B, H_kv, ctx_end, D) on CPU, with keep_context_copy
        self.pending = None  # the copy, moved back, waiting to be re-prefilled with a new question (requery)
        self.deferred = None  # scorer="attention": the prefill's keys/values, quantized at the first decode step
        self.forbid_split = False  # load_prefill(split_attention=False): always dequantize
        self.fallback_steps = 0

    @property
    def cache(self) -> "CocktailCache":
        return self._cache()

    # ----------------------------------------------------------------- CacheLayerMixin
    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``, ``value_states``: ``(B, H_kv, L_new, D)``."""
        if self.store is None and self.deferred is None:
            if self.pending is not None:  # after requery: prompt prefix + context at full precision, then the rest
                pk, pv = self.pending
                key_states = torch.cat([pk.to(key_states.device, key_states.dtype), key_states], dim=2)
                value_states = torch.cat([pv.to(value_states.device, value_states.dtype), value_states], dim=2)
                self.pending = None
            self.lazy_initialization(key_states, value_states)
            if self.cache._scores_from_attention():
                self.cache._plans_for_prefill(key_states, search=False)
                self.deferred = (key_states, value_states)
                self.seq_len, self.in_prefill = key_states.shape[2], True
            else:
                self._prefill(key_states, value_states)
            _tag(key_states, self)
            return key_states, value_states
        if self.deferred is not None:  # first decode step after an attention-scored prefill: quantize now
            self._prefill(*self.deferred)
            self.deferred = None
        self.in_prefill = False
        self.store.full.append(key_states, value_states)
        self.seq_len += key_states.shape[2]
        if self.uses_split_attention:
            keys = self.store.full.keys
            _tag(keys, self)
            return keys, self.store.full.values
        # under attn "cocktail" the attention function reads the store instead and switches this path off; still
        # here at a second decode step means another attention implementation consumes the dequantized cache
        self.fallback_steps += 1
        if self.fallback_steps == 2 and not self.forbid_split:
            self.cache._warn_dequantize_fallback()
        keys, values = self.dequantized()
        _tag(keys, self)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.in_prefill = False
        self.uses_split_attention = False
        self.seq_len = 0
        self.deferred = None
        self.is_initialized = False

    # ----------------------------------------------------------------- storage
    def _prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        plans = self.cache._plans_for_prefill(k)
        cfg = self.config
        quantize_k, quantize_v = _quantizers(cfg.backend, k.device)
        fulls_k, fulls_v = [], []
        segs = {bits: ([], []) for bits in PACKED_BITS}
        for b, plan in enumerate(plans):
            pos = {p: t.to(k.device) for p, t in self._positions(plan).items()}
            fulls_k.append(k[b].index_select(1, pos["full"]))
            fulls_v.append(v[b].index_select(1, pos["full"]))
            for bits in PACKED_BITS:
                segs[bits][0].append(k[b].index_select(1, pos[bits]))
                segs[bits][1].append(v[b].index_select(1, pos[bits]))
        packed = [PackedSegment.from_sequences(*segs[bits], bits, cfg.chunk_size, cfg.group_size,
                                               cfg.torch_scale_dtype(k.dtype),
                                               quantize_k, quantize_v) for bits in PACKED_BITS]
        self.store = LayerStore(FullPart.from_sequences(fulls_k, fulls_v), packed)
        if cfg.keep_context_copy and self.context_copy is None:
            end = max(p.ctx_end for p in plans)
            self.context_copy = (k[:, :, :end].to("cpu", copy=True), v[:, :, :end].to("cpu", copy=True))
        self.seq_len = k.shape[2]
        self.in_prefill = True

    def _positions(self, plan: SequencePlan) -> dict:
        if not self.all_full:
            return plan.positions
        empty = plan.positions[4][:0]
        return {"full": torch.arange(plan.pad, self.cache._prefill_len), 4: empty, 2: empty}

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache at the model's precision in original token order, ``(B, H_kv, seq_len, D)`` each, left
        padding as zeros (masked by the attention mask). Used by the plain sdpa/eager fallback."""
        st = self.store
        full = st.full
        B, H, _, D = full.keys.shape
        keys = full.keys.new_zeros((B, H, self.seq_len, D))
        values = torch.zeros_like(keys)
        p0 = self.cache._prefill_len
        for b, plan in enumerate(self.cache._plans):
            dev = keys.device
            positions = self._positions(plan)
            fpos = torch.cat([positions["full"].to(dev), torch.arange(p0, self.seq_len, device=dev)])
            keys[b, :, fpos] = full.keys[b, :, full.start[b]:]
            values[b, :, fpos] = full.values[b, :, full.start[b]:]
            for seg in st.segments:
                k_b, v_b = seg.sequence(b, keys.dtype)
                p = positions[seg.bits].to(dev)
                keys[b, :, p] = k_b
                values[b, :, p] = v_b
        return keys, values

    # ----------------------------------------------------------------- batch manipulation
    def select_sequences(self, indices: list[int], same_packed: bool = False) -> None:
        """Keep (and reorder / repeat) sequences ``indices`` of the batch. ``same_packed``: every new row comes from
        the same prompt as the old row at its place (beams of one prompt), so only the full-precision part moves."""
        if self.deferred is not None:
            idx = torch.tensor(indices, dtype=torch.long, device=self.deferred[0].device)
            self.deferred = tuple(t.index_select(0, idx) for t in self.deferred)
        if self.store is None:
            return
        st = self.store
        dev = st.full.keys.device
        idx = torch.tensor(indices, dtype=torch.long, device=dev)
        full = FullPart(st.full.keys.index_select(0, idx), st.full.values.index_select(0, idx),
                        [st.full.start[i] for i in indices])
        if same_packed:
            self.store = LayerStore(full, st.segments)
            return
        segs = []
        for seg in st.segments:
            tok = [slice(seg.tok_off[i], seg.tok_off[i + 1]) for i in indices]
            chk = [slice(seg.chunk_off[i], seg.chunk_off[i + 1]) for i in indices]

            def cat(t, sl):
                return torch.cat([t[:, s] for s in sl], dim=1) if sl else t[:, :0]

            segs.append(PackedSegment(
                seg.bits, seg.chunk_size, seg.group_size, cat(seg.k_codes, tok), cat(seg.k_scale, chk),
                cat(seg.k_zero, chk), cat(seg.v_codes, tok), cat(seg.v_scale, tok), cat(seg.v_zero, tok),
                _offsets([s.stop - s.start for s in tok]), _offsets([s.stop - s.start for s in chk])))
        self.store = LayerStore(full, segs)

    def crop(self, tokens_to_remove: int) -> None:
        tokens_to_remove = int(tokens_to_remove)  # some transformers versions pass a 0-d tensor
        if tokens_to_remove > 0:
            raise ValueError(f"crop expects a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or (self.store is None and self.deferred is None):
            return
        generated = self.seq_len - self.cache._prompt_len
        if n > generated:
            raise ValueError(f"CocktailCache can only crop tokens added after the prompt ({max(generated, 0)} "
                             f"here); asked to remove {n}")
        if self.deferred is not None:
            self.deferred = tuple(t[:, :, :-n] for t in self.deferred)
        else:
            full = self.store.full
            full.keys, full.values = full.keys[:, :, :-n], full.values[:, :, :-n]
        self.seq_len -= n


def _tag(keys: torch.Tensor, layer: "CocktailLayer") -> None:
    """Let the attention function find the layer behind the key tensor it receives. A weak reference: the layer
    holds these tensors, and a strong one would make a reference cycle that keeps whole caches alive until the
    garbage collector runs."""
    keys._cocktail_layer = weakref.ref(layer)


def layer_of(keys: torch.Tensor) -> "CocktailLayer | None":
    ref = getattr(keys, "_cocktail_layer", None)
    return ref() if ref is not None else None


def _quantizers(backend: str, device: torch.device):
    from .backend import resolve_backend

    if resolve_backend(backend, device) == "triton":
        from triton_ops import quantize_pack_keys, quantize_pack_values

        return quantize_pack_keys, quantize_pack_values
    return quant.quantize_pack_keys, quant.quantize_pack_values


class CocktailCache(Cache):
    """A KV cache that stores each context chunk at FP16, INT4 or INT2 by its relevance to the query.

    Usage::

        cache = CocktailCache(CocktailConfig(encoder=hf_cocktail.offline_encoder_path()))
        inputs = cache.prepare_inputs(tokenizer, prompt, contexts=document, queries=question)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

    The chunk search runs once per ``generate``, at prefill, before any layer quantizes. Decode attention reads the
    packed codes when the model uses ``attn_implementation="cocktail"``; under plain ``"sdpa"``/``"eager"`` each step
    dequantizes the cache (correct, slower, with one warning).

    Args:
        config: the :class:`CocktailConfig` (default: paper settings).
        encoder: optional object with ``encode(list[str]) -> Tensor (n, E)`` used instead of ``config.encoder``.
    """

    def __init__(self, config: CocktailConfig | None = None, encoder: TextEncoder | None = None):
        super().__init__(layers=[])
        self.config = config if config is not None else CocktailConfig()
        if not isinstance(self.config, CocktailConfig):
            raise TypeError(f"config must be a CocktailConfig, got {type(self.config).__name__}")
        if encoder is not None and not callable(getattr(encoder, "encode", None)):
            raise TypeError(f"encoder must have an encode(list[str]) -> Tensor method, got {type(encoder).__name__}")
        self._encoder = encoder
        self._plans: list[SequencePlan] | None = None
        self._prompt_len = 0
        self._prefill_len = -1
        self._searched = False
        self._warned_fallback = False

    # ----------------------------------------------------------------- inputs
    def prepare_inputs(self, tokenizer, prompts, contexts=None, queries=None, device=None, **tokenizer_kwargs):
        """Tokenize ``prompts`` (left padding for batches), locate each context's token span and cut it into chunks.

        Args:
            tokenizer: a fast tokenizer (offsets are needed to locate the context).
            prompts: ``str`` or list of ``B`` strings, the full prompts (chat template already applied).
            contexts: ``str`` or list of ``B`` strings: the document inside each prompt ('' or None: no context).
            queries: ``str`` or list of ``B`` strings: the question used by the search (may be None with
                ``uniform_bits``).
            device: where to put the returned tensors.

        Returns:
            the tokenizer's ``BatchEncoding`` (``input_ids``, ``attention_mask``) to pass to ``generate``.
        """
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"prompts must be a non-empty str or list of str, got "
                            f"{[type(p).__name__ for p in prompts] or 'an empty list'}")
        B = len(prompts)
        contexts = self._per_sequence("contexts", contexts, B)
        queries = self._per_sequence("queries", queries, B)
        if self.config.uniform_bits is None:
            for b, (c, q) in enumerate(zip(contexts, queries)):
                if c and q is None:
                    raise ValueError(f"queries[{b}] is None but the search needs a query (or set uniform_bits)")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("prepare_inputs needs a fast tokenizer (offset mapping), got a slow one: "
                             "load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
        old_side, old_pad = tokenizer.padding_side, tokenizer.pad_token
        tokenizer.padding_side = "left"
        if B > 1 and old_pad is None:  # left padding is masked and never stored: any token id will do
            if tokenizer.eos_token is None:
                raise ValueError("a batch of prompts needs padding: set tokenizer.pad_token")
            tokenizer.pad_token = tokenizer.eos_token
        try:
            enc = tokenizer(prompts, return_tensors="pt", padding=B > 1, return_offsets_mapping=True,
                            **tokenizer_kwargs)
        finally:
            tokenizer.padding_side = old_side
            if B > 1 and old_pad is None:
                tokenizer.pad_token = old_pad
        offsets = enc.pop("offset_mapping")
        L = enc["input_ids"].shape[1]
        C = self.config.chunk_size
        plans = []
        for b in range(B):
            mask = enc["attention_mask"][b]
            pad = int(L - mask.sum())
            cs = ce = pad
            ctx = contexts[b]
            if ctx:
                c0 = prompts[b].find(ctx)
                if c0 < 0:
                    raise ValueError(f"contexts[{b}] was not found in prompts[{b}]: the context must appear verbatim "
                                     f"in its prompt (got a context of {len(ctx)} characters)")
                c1 = c0 + len(ctx)
                inside = [t for t in range(pad, L) if mask[t] and offsets[b, t, 1] > offsets[b, t, 0]
                          and offsets[b, t, 0] >= c0 and offsets[b, t, 1] <= c1]
                if inside:
                    cs, ce = inside[0], inside[-1] + 1
                    # protected tokens stay at full precision: attention sinks and the most recent context tokens
                    cs = min(max(cs, pad + self.config.sink_tokens), ce)
                    ce = max(cs, ce - self.config.recent_tokens)
            ids = enc["input_ids"][b]
            texts = [tokenizer.decode(ids[a:min(a + C, ce)]) for a in range(cs, ce, C)]
            plan = SequencePlan(pad, cs, ce, texts, queries[b], origin=b)
            if self.config.scorer == "attention" and self.config.uniform_bits is None and ce > cs:
                plan.query_span = self._find_span(prompts[b], queries[b] or "", offsets[b], mask, pad, L, ce,
                                                  f"queries[{b}]")
            plans.append(plan)
        self.reset()
        self._plans = plans
        self._input_ids = enc["input_ids"].clone()
        self._prompt_len = L
        self._searched = False
        if device is not None:
            enc = enc.to(device)
        return enc

    @staticmethod
    def _find_span(prompt, text, offsets, mask, pad, L, after, name):
        """Token span of the last occurrence of ``text`` in ``prompt`` at or after token ``after``."""
        c0 = prompt.rfind(text) if text else -1
        toks = [t for t in range(max(pad, after), L) if c0 >= 0 and mask[t] and offsets[t, 1] > offsets[t, 0]
                and offsets[t, 0] >= c0 and offsets[t, 1] <= c0 + len(text)]
        if not toks:
            raise ValueError(f"{name} must appear verbatim in its prompt after the context for scorer='attention' "
                             f"(its tokens are the ones whose attention scores the chunks); got {text!r}")
        return toks[0], toks[-1] + 1

    @staticmethod
    def _per_sequence(name, value, B):
        if value is None or isinstance(value, str):
            return [value] * B
        value = list(value)
        if len(value) != B:
            raise ValueError(f"{name} must be a str or a list of {B} (one per prompt), got a list of {len(value)}")
        for v in value:
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{name} must hold str or None, got {type(v).__name__}")
        return value

    # ----------------------------------------------------------------- search
    def _scores_from_attention(self) -> bool:
        return self.config.scorer == "attention" and self.config.uniform_bits is None and not self._searched

    def accumulate_attention(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """scorer="attention": add the attention mass that the query's tokens give each context token in one layer's
        prefill. ``query (B, H_q, L, D)``, ``key (B, H_kv, L, D)``."""
        if query.shape[2] != key.shape[2] or any(p.query_span[1] > key.shape[2] for p in self._plans):
            raise ValueError("scorer='attention' needs the whole prompt in one prefill forward; generation's "
                             "prefill_chunk_size (chunked prefill) is not supported with it")
        H_kv = key.shape[1]
        n_rep = query.shape[1] // H_kv
        for b, plan in enumerate(self._plans):
            qs, qe = plan.query_span
            n_ctx = plan.ctx_end - plan.ctx_start
            if plan.attn_mass is None:
                plan.attn_mass = torch.zeros(n_ctx, dtype=torch.float32, device=key.device)
            if qe <= qs or n_ctx == 0:
                continue
            nq = qe - qs
            q = query[b, :, qs:qe].float().reshape(H_kv, n_rep * nq, -1)  # rows ordered (rep, i)
            k = key[b, :, plan.pad:qe].float()
            logits = (q @ k.transpose(1, 2)) * scaling  # (H_kv, n_rep*n_q, T)
            j = torch.arange(k.shape[1], device=q.device) + plan.pad
            i = torch.arange(qs, qe, device=q.device).repeat(n_rep)
            p = torch.softmax(logits.masked_fill(j[None, None, :] > i[None, :, None], float("-inf")), dim=-1)
            plan.attn_mass += p[..., plan.ctx_start - plan.pad:plan.ctx_end - plan.pad].sum((0, 1)).to(
                plan.attn_mass.device)

    def _plans_for_prefill(self, k: torch.Tensor, search: bool = True) -> list[SequencePlan]:
        if self._plans is None:
            raise RuntimeError("CocktailCache: call cache.prepare_inputs(tokenizer, prompts, contexts=..., "
                               "queries=...) and pass its output to generate before the first forward")
        B, _, L, D = k.shape
        n = len(self._plans)
        if search and not self._searched:
            self.run_search()
        if B != n and B % n == 0 and self._prefill_len == -1:
            # generate expanded the prompts (num_beams / num_return_sequences): rows repeated consecutively
            self._plans = [dataclasses.replace(p) for p in self._plans for _ in range(B // n)]
        if B != len(self._plans):
            raise RuntimeError(f"CocktailCache was prepared for {len(self._plans)} prompt(s) but the model's prefill "
                               f"has batch {B}; pass the output of prepare_inputs to generate unchanged")
        # L may exceed the prompt (assisted decoding prefills its first candidates too): those tokens are cropable
        if not search:
            return self._plans
        if self._prefill_len != L:
            for plan in self._plans:
                plan.build_positions(L, self.config.chunk_size)
            self._prefill_len = L
        return self._plans

    def run_search(self) -> None:
        """Score every chunk and assign its precision (done automatically at prefill, once per ``generate``)."""
        cfg = self.config
        for plan in self._plans:
            n = plan.num_chunks
            if cfg.uniform_bits is not None:
                plan.scores, plan.bits = None, [cfg.uniform_bits] * n
                continue
            if cfg.scorer == "bm25":
                scores = bm25_scores(plan.query or "", plan.chunk_texts)
            elif cfg.scorer == "attention":
                if plan.attn_mass is None:
                    raise RuntimeError("scorer='attention' takes its scores from the prefill attention: load the model "
                                       "with attn_implementation='cocktail' (and do not use load_prefill)")
                mass = plan.attn_mass.cpu()
                scores = torch.stack([mass[a - plan.ctx_start:b - plan.ctx_start].mean()
                                      for a, b in (plan.chunk_range(i, cfg.chunk_size) for i in range(n))]) \
                    if n else torch.zeros(0)
            else:
                encoder = self._encoder or get_encoder(cfg.encoder, cfg.encoder_device, cfg.encoder_batch_size)
                scores = score_chunks(encoder, plan.query or "", plan.chunk_texts)
            if cfg.target_bits is None:
                bits = promote_neighbors(assign_precisions(scores, cfg.alpha, cfg.beta), cfg.neighbors)
            else:
                sizes = [b - a for a, b in (plan.chunk_range(i, cfg.chunk_size) for i in range(n))]
                cost = {16: 16.0, 4: cfg.packed_bits_per_element(4), 2: cfg.packed_bits_per_element(2)}
                bits = assign_budget(scores, sizes, cfg.target_bits, cfg.beta, cost)
            plan.scores, plan.bits = scores.tolist(), bits
        self._searched = True
        self._prefill_len = -1  # positions are built at prefill, for its length

    def plan_bits_per_element(self) -> list[float]:
        """Per sequence, the storage bits per context K/V element of the current precision plan (scales and zeros
        included, FP16 chunks at 16 bits): what ``target_bits`` budgets. Needs the search (or set_precisions)."""
        if not self._plans or not self._searched:
            raise RuntimeError("plan_bits_per_element() needs run_search() or set_precisions() first")
        cfg = self.config
        cost = {16: 16.0, 4: cfg.packed_bits_per_element(4), 2: cfg.packed_bits_per_element(2)}
        out = []
        for plan in self._plans:
            sizes = [b - a for a, b in (plan.chunk_range(i, cfg.chunk_size) for i in range(plan.num_chunks))]
            total = sum(sizes)
            out.append(sum(cost[x] * n for x, n in zip(plan.bits, sizes)) / total if total else 0.0)
        return out

    def set_precisions(self, bits: list[list[int]]) -> None:
        """Impose the precision of every context chunk (per sequence, original order) instead of the search; call
        after :meth:`prepare_inputs` and before ``generate`` (used by ablations and custom policies)."""
        if self._plans is None:
            raise RuntimeError("set_precisions() needs prepare_inputs() first")
        if len(bits) != len(self._plans):
            raise ValueError(f"bits must have one list per sequence ({len(self._plans)}), got {len(bits)}")
        for b, (plan, row) in enumerate(zip(self._plans, bits)):
            row = [int(x) for x in row]
            if len(row) != plan.num_chunks:
                raise ValueError(f"bits[{b}] must have {plan.num_chunks} entries (one per chunk), got {len(row)}")
            bad = sorted({x for x in row if x not in (16, 4, 2)})
            if bad:
                raise ValueError(f"bits[{b}] values must be 16, 4 or 2, got {bad}")
            plan.bits = row
        self._searched = True
        self._prefill_len = -1

    def load_prefill(self, past_key_values, split_attention: bool | None = None) -> None:
        """Fill the cache from an already computed full-precision prefill, e.g. a ``DynamicCache`` (one ``(keys,
        values)`` pair of ``(B, H_kv, L', D)`` per layer, ``L'`` <= the prepared prompt length and covering the
        context). Lets one prefill be branched into several caches. ``split_attention=None`` (default) detects the
        attention implementation at the first decode step; ``True`` asserts ``attn_implementation="cocktail"``
        (saves that step's dequantization; wrong results under another implementation), ``False`` forces the
        dequantizing path."""
        self.layers = []
        pairs = [(layer.keys, layer.values) for layer in past_key_values.layers] \
            if hasattr(past_key_values, "layers") else list(past_key_values)
        for i, (k, v) in enumerate(pairs):
            self.update(k.detach(), v.detach(), i)  # aliases: the caller's tensors are not tagged
            self.layers[i].uses_split_attention = bool(split_attention)
            self.layers[i].in_prefill = False
            self.layers[i].forbid_split = split_attention is False

    def requery(self, tokenizer, prompt: str, query: str, device=None):
        """Answer a new question about the same document without a new prefill (needs ``keep_context_copy``).

        ``prompt`` must start with the same tokens as the previous prompt up to the end of the context. The cache
        drops the old question and answer, re-runs the search for ``query``, and re-packs every chunk from the
        full-precision CPU copy; the next ``generate(**inputs, past_key_values=cache)`` computes only the tokens
        after the context (at full precision, as a prefill would) and gives what a fresh run on ``prompt`` gives.

        Returns:
            the ``BatchEncoding`` of ``prompt`` to pass to ``generate``.
        """
        if not self.config.keep_context_copy:
            raise RuntimeError("requery() needs CocktailConfig(keep_context_copy=True) when the document is prefilled")
        if not self.layers or any(layer.context_copy is None for layer in self.layers):
            raise RuntimeError("requery() needs a finished generate on the document first")
        if self._plans is None or len(self._plans) != 1:
            raise ValueError(f"requery() supports one sequence (batch 1), this cache holds "
                             f"{len(self._plans or [])}")
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        if self.config.scorer == "attention":
            raise ValueError("requery() supports scorer='encoder' or 'bm25'; scorer='attention' would need the new "
                             "question's prefill attention over the old context (use a new prepare_inputs instead)")
        plan = self._plans[0]
        enc = tokenizer(prompt, return_tensors="pt")
        ids = enc["input_ids"]
        end = self.layers[0].context_copy[0].shape[2]
        old = self._input_ids[0, plan.pad:end]
        if ids.shape[1] <= old.shape[0] or not torch.equal(ids[0, :old.shape[0]], old):
            raise ValueError("the new prompt must repeat the previous prompt's tokens up to the end of the context "
                             f"({old.shape[0]} tokens) and add the new question after them")
        if plan.pad:
            raise ValueError("requery() needs an unpadded prompt")
        plan.query = query
        self.run_search()
        self._input_ids = ids.clone()
        self._prompt_len = ids.shape[1]
        for layer in self.layers:
            layer.pending, layer.store, layer.in_prefill = layer.context_copy, None, False
            layer.seq_len = end
        return enc.to(device) if device is not None else enc

    # ----------------------------------------------------------------- Cache API
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(CocktailLayer(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def _refuse_linear(self, *args, **kwargs):
        raise ValueError("CocktailCache stores attention keys and values only: this model has linear-attention, "
                         "convolution or state-space layers (a hybrid model), which it does not support; use the "
                         "model's own cache (e.g. DynamicCache(config=model.config))")

    update_conv_state = update_recurrent_state = get_conv_state = get_recurrent_state = _refuse_linear

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        self._refuse_linear()

    def reset(self):
        self.layers = []
        self._searched = False
        self._prefill_len = -1

    def _select(self, indices: list[int]) -> None:
        plans = self._plans or []
        same = len(indices) == len(plans) and all(plans[j] is plans[i] or plans[j].origin == plans[i].origin
                                                  for i, j in enumerate(indices))
        for layer in self.layers:
            layer.select_sequences(indices, same_packed=same)
        if self._plans is not None:
            self._plans = [self._plans[i] for i in indices]

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(int(tokens_to_remove))  # some transformers versions pass a 0-d tensor
        # tokens removed from the prefill itself (assisted decoding's first candidates): positions shrink too
        new_len = self.get_seq_length()
        if self._plans and 0 <= new_len < self._prefill_len:
            for plan in self._plans:
                plan.build_positions(new_len, self.config.chunk_size)
            self._prefill_len = new_len

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._select([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int):
        B = len(self._plans or [])
        self._select([b for b in range(B) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor):
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        self._select([int(i) for i in idx.tolist()])

    def _warn_dequantize_fallback(self):
        if not self._warned_fallback:
            logger.warning("CocktailCache is used with an attention implementation other than 'cocktail': every "
                           "decode step dequantizes the whole cache (correct but slow). Load the model with "
                           "attn_implementation='cocktail' to read the packed codes directly.")
            self._warned_fallback = True

    # ----------------------------------------------------------------- reports
    def precision_map(self) -> list[list[int]]:
        """Per sequence, the bits (16, 4 or 2) of each context chunk in original order."""
        self._flush_deferred()
        if not self._plans or not self._searched:
            raise RuntimeError("precision_map() is available after the prefill of generate (the search runs there)")
        return [list(p.bits) for p in self._plans]

    def chunk_scores(self) -> list[list[float] | None]:
        """Per sequence, each context chunk's similarity score (None with ``uniform_bits``)."""
        self._flush_deferred()
        if not self._plans or not self._searched:
            raise RuntimeError("chunk_scores() is available after the prefill of generate")
        return [p.scores for p in self._plans]

    def _flush_deferred(self) -> None:
        """scorer="attention" and generation ended at prefill: run the search and quantize now."""
        for layer in self.layers:
            if isinstance(layer, CocktailLayer) and layer.deferred is not None:
                layer._prefill(*layer.deferred)
                layer.deferred = None

    def _stores(self):
        self._flush_deferred()
        return [layer.store for layer in self.layers if isinstance(layer, CocktailLayer) and layer.store is not None]

    def nbytes(self) -> int:
        """Bytes really held by the cache's working tensors (codes, scales/zeros and full-precision part; the
        optional CPU context copy of ``keep_context_copy`` is reported apart by :meth:`memory_report`)."""
        return sum(st.nbytes() for st in self._stores())

    def memory_report(self) -> dict:
        """Breakdown of :meth:`nbytes` plus what the same tokens would take in a FP16 cache. ``ratio_to_fp16``
        counts the full-precision part at 2 bytes per element (an FP16 deployment) even for fp32 models."""
        stores = self._stores()
        rep = {"codes_bytes": 0, "scales_zeros_bytes": 0, "full_precision_bytes": 0, "layers": len(stores)}
        fp16_equiv = full_elements = 0
        for st in stores:
            H, D = st.full.keys.shape[1], st.full.keys.shape[3]
            rep["full_precision_bytes"] += st.full.nbytes()
            full_elements += st.full.keys.numel() + st.full.values.numel()
            rep["codes_bytes"] += sum(s.nbytes_codes() for s in st.segments)
            rep["scales_zeros_bytes"] += sum(s.nbytes_params() for s in st.segments)
            tokens = st.full.valid_tokens() + sum(s.num_tokens for s in st.segments)
            fp16_equiv += tokens * H * D * 2 * 2
        rep["total_bytes"] = rep["codes_bytes"] + rep["scales_zeros_bytes"] + rep["full_precision_bytes"]
        # keep_context_copy: the CPU copy for requery() is reported apart (it is not part of the working cache)
        rep["context_copy_bytes"] = sum(sum(t.numel() * t.element_size() for t in layer.context_copy)
                                        for layer in self.layers if layer.context_copy is not None)
        rep["fp16_equivalent_bytes"] = fp16_equiv
        # as deployed in FP16: the full-precision part at 2 bytes per element whatever the model's dtype
        fp16_total = rep["codes_bytes"] + rep["scales_zeros_bytes"] + 2 * full_elements
        rep["ratio_to_fp16"] = fp16_total / fp16_equiv if fp16_equiv else float("nan")
        counts = {16: 0, 4: 0, 2: 0}
        for p in self._plans or []:
            for bits in p.bits or []:
                counts[bits] += 1
        rep["chunks"] = {"fp16": counts[16], "int4": counts[4], "int2": counts[2]}
        return rep
