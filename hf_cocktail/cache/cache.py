"""`CocktailCache`: a transformers `Cache` whose context chunks are stored at FP16, INT4 or INT2.

Orchestration only: inputs are planned by :mod:`.planning`, chunks scored by :mod:`.scoring`, layers
(:mod:`.layer`) own their storage. Shapes: B batch, H_kv key/value heads, L prompt length (after left padding),
D head dim, C chunk size.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from transformers.cache_utils import Cache

from hf_cocktail.cache import layout, reports
from hf_cocktail.cache.inputs import Shared, plan_watched_prefill, prepare_plans
from hf_cocktail.cache.layer import CocktailLayer, LayerState
from hf_cocktail.cache.layout import HybridStates
from hf_cocktail.cache.lifecycles import CacheLifecycles
from hf_cocktail.cache.prefill_watch import (
    PrefillWatch,
    check_attention_reader,
    check_head_dims,
    check_layer_fields,
    check_prefill_ids,
)
from hf_cocktail.planning import plans as planning
from hf_cocktail.planning.plans import PlanView, SequencePlan
from hf_cocktail.planning.salient import keeps_salient, record_layer_mass, with_salient
from hf_cocktail.planning.scoring import TextEncoder
from hf_cocktail.planning.search import add_query_attention, search_plan
from hf_cocktail.presets.config import CocktailConfig
from hf_cocktail.storage.layer_bits import capped_positions, layer_pair

logger = logging.getLogger(__name__)


class CocktailCache(CacheLifecycles, HybridStates, Cache):
    """A KV cache that stores each context chunk at FP16, INT4 or INT2 by its relevance to the query.

    Usage, as any transformers cache (left-padded batches, and ``generate`` again on the grown conversation)::

        cache = CocktailCache(CocktailConfig.recommended())
        out = model.generate(**tokenizer(prompt, return_tensors="pt"), **cache_kwargs(model, cache))

    The prefill's tokens after ``sink_tokens`` and before the last ``residual_tokens`` are packed as context.
    :meth:`prepare_inputs` gives a searching setting (the paper's ``CocktailConfig()``) an explicit document and
    question; without it the search's query is the prompt's tail (for the encoder and BM25, pass ``tokenizer=``).
    (``cache_kwargs`` from :mod:`hf_cocktail.integration.compat` passes ``cache=`` or ``past_key_values=``, whichever
    the installed transformers prefers.) The chunk search runs once per prompt, at prefill, before any layer
    quantizes. Decode attention reads the packed codes when the model uses ``attn_implementation="cocktail"``;
    under plain ``"sdpa"``/``"eager"`` each step dequantizes the cache (correct, slower, with one warning).

    Args:
        config: the :class:`CocktailConfig` (default: paper settings).
        encoder: optional object with ``encode(list[str]) -> Tensor (n, E)`` used instead of ``config.encoder``.
        model_config: the model's config, for models with several layer kinds (sliding-window, hybrid): only
            full-attention layers become Cocktail layers, the others are the model's default cache layers (see
            :mod:`hf_cocktail.cache.layout`). Optional: the cache also reads it from the model at the first prefill
            after ``prepare_inputs``.
        tokenizer: optional, for a searching setting by ``"encoder"`` or ``"bm25"`` without ``prepare_inputs``: it
            decodes the chunks and the query (the prompt's tail) from the ids embedded.
    """

    def __init__(
        self,
        config: CocktailConfig | None = None,
        encoder: TextEncoder | None = None,
        model_config: Any = None,
        tokenizer: Any = None,
    ):
        super().__init__(layers=[])
        self.config = config if config is not None else CocktailConfig()
        if not isinstance(self.config, CocktailConfig):
            raise TypeError(f"config must be a CocktailConfig, got {type(self.config).__name__}")
        if encoder is not None and not callable(getattr(encoder, "encode", None)):
            raise TypeError(f"encoder must have an encode(list[str]) -> Tensor method, got {type(encoder).__name__}")
        self._encoder = encoder
        self._tokenizer = Shared(tokenizer)
        self._plans: list[SequencePlan] | None = None
        self._input_ids: torch.Tensor | None = None  # (B, L) the prepared prompt(s)
        self.prompt_len = 0
        self.prefill_len = -1
        self._searched = False
        self._warned_fallback = False
        # chunked prefill: per layer, the prompt's keys/values so far (full precision) until the prepared prompt is in
        self._partial: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._watch = PrefillWatch(self)  # what the prefill embeds (armed until it: prepare_inputs, or planned from it)
        self._watch.arm()
        self._model_config = model_config  # else the config the watch sees at the first prefill (layout.py)
        self._num_layers: int | None = None  # the model's layer count, once seen

    # ----------------------------------------------------------------- inputs
    def prepare_inputs(self, tokenizer, prompts, contexts=None, queries=None, device=None, **tokenizer_kwargs):
        """Tokenize ``prompts`` (left padding for batches), locate each context's token span and cut it into chunks:
        the precise way to give the search its document and question. Returns the tokenizer's ``BatchEncoding``
        (``input_ids``, ``attention_mask``, on ``device`` if given) to pass to ``generate``.
        Args:
            tokenizer: a fast tokenizer (offsets are needed to locate the context).
            prompts: ``str`` or list of ``B`` strings, the full prompts (chat template already applied).
            contexts: ``str`` or list of ``B`` strings: the document inside each prompt ('' or None: no context).
            queries: ``str`` or list of ``B`` strings: the question the search uses (None with ``uniform_bits``).
        """
        check_attention_reader(self.config, self._model_config, self.scores_from_attention())
        enc, plans = prepare_plans(tokenizer, prompts, contexts, queries, self.config, tokenizer_kwargs)
        self.reset()
        self._plans = plans
        self._input_ids = enc["input_ids"].to(planning.INDEX_DTYPE, copy=True)
        self.prompt_len = enc["input_ids"].shape[1]  # (reset armed the watch)
        return enc.to(device) if device is not None else enc

    @property
    def plans(self) -> tuple[PlanView, ...]:
        """Read-only views of the prepared plans, one per sequence (empty before :meth:`prepare_inputs`)."""
        return tuple(PlanView.of(p) for p in self._plans or [])

    def _require_plans(self) -> list[SequencePlan]:
        """The plans (of ``prepare_inputs``, or of the prefill); a RuntimeError before either."""
        if self._plans is None:
            raise RuntimeError("CocktailCache has no prompt yet: call cache.prepare_inputs(...) or generate first")
        return self._plans

    # ----------------------------------------------------------------- search
    def scores_from_attention(self) -> bool:
        """True while the chunk scores still have to come from the prefill attention (scorer="attention")."""
        return self.config.scorer == "attention" and self.config.uniform_bits is None and not self._searched

    def waits_for_prefill_attention(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` quantizes only after its prefill attention was seen (scorer="attention"
        or salient_tokens)."""
        cfg = self.config
        return keeps_salient(cfg.salient_tokens, cfg.full_precision_layers, layer_idx) or self.scores_from_attention()

    def accumulate_attention(self, query: torch.Tensor, key: torch.Tensor, scaling: float, layer_idx: int) -> None:
        """Record one layer's prefill attention: scorer="attention" adds the mass that the query's tokens give each
        context token to the chunk scores; salient_tokens keeps the layer's mass from the prompt's tokens after the
        context (never from tokens past the prepared prompt, e.g. assisted decoding's candidates in the same
        forward). ``query (B, H_q, L_q, D)`` (the forward's last ``L_q`` tokens), ``key (B, H_kv, L, D)``."""
        if self.scores_from_attention():
            add_query_attention(self._require_plans(), query, key, scaling)
        if keeps_salient(self.config.salient_tokens, self.config.full_precision_layers, layer_idx):
            end = max(self.prompt_len, *(p.query_span[1] for p in self._require_plans()))  # plain: the prefill's end
            record_layer_mass(self._require_plans(), query, key, scaling, layer_idx, end)

    def plans_for_prefill(self, k: torch.Tensor, search: bool = True) -> list[SequencePlan]:
        """The plans for a prefill of keys ``k (B, H_kv, L, D)``: runs the search once, follows generate's batch
        expansion (beams / return sequences), and builds each plan's positions for ``L``."""
        B, _, L, _ = k.shape
        if self._plans is None:  # no prepare_inputs: the prompt is what this prefill embeds
            self._plans, self._input_ids = plan_watched_prefill(self._watch, B, L, self.config, self._tokenizer.obj)
            self.prompt_len = max(p.ctx_end for p in self._plans)  # crop may remove what follows (assisted decoding)
        n = len(self._plans)
        if search and not self._searched:
            self.run_search()
        if B != n and B % n == 0 and self.prefill_len == -1:
            # generate expanded the prompts (num_beams / num_return_sequences): rows repeated consecutively
            self._plans = [dataclasses.replace(p) for p in self._plans for _ in range(B // n)]
        if B != len(self._plans):
            raise RuntimeError(
                f"CocktailCache was prepared for {len(self._plans)} prompt(s) but the model's prefill "
                f"has batch {B}; pass the output of prepare_inputs to generate unchanged"
            )
        # L may exceed the prompt (assisted decoding prefills its first candidates too): those tokens are cropable
        if search and self.prefill_len != L:
            for plan in self._plans:
                plan.build_positions(L, self.config.chunk_size, self.config.packed_bits)
            self.prefill_len = L
        return self._plans

    def layer_positions(self, layer_idx: int, all_full: bool = False) -> list[dict]:
        """Per sequence, the prompt positions of each part of layer ``layer_idx``'s store (see
        :meth:`SequencePlan.build_positions`; with ``layer_bits`` the parts above the layer's key width merge into
        it); ``all_full``: a layer kept entirely at full precision."""
        plans = self._require_plans()
        if all_full:
            return [plan.all_full_positions(self.prefill_len, self.config.packed_bits) for plan in plans]
        pair = self.layer_bits_pair(layer_idx)
        out = [capped_positions(plan.positions, pair and pair[0]) for plan in plans]
        if self.config.salient_tokens > 0:
            f = self.config.salient_tokens
            out = [with_salient(pos, plan, layer_idx, f) for pos, plan in zip(out, plans)]
        return out

    def layer_bits_pair(self, layer_idx: int) -> tuple[int, int] | None:
        """Layer ``layer_idx``'s ``layer_bits`` cap (one entry per model layer, or per Cocktail layer)."""
        rank = sum(isinstance(layer, CocktailLayer) for layer in self.layers[:layer_idx])
        return layer_pair(self.config.layer_bits, layer_idx, self._num_layers, rank)

    def run_search(self) -> None:
        """Score every chunk and assign its precision (done automatically at prefill, once per ``generate``)."""
        for plan in self._require_plans():
            search_plan(plan, self.config, self._encoder)
        self._searched = True
        self.prefill_len = -1  # positions are built at prefill, for its length

    def plan_bits_per_element(self) -> list[float]:
        """Per sequence, the storage bits per context K/V element of the precision plan (scales and zeros included,
        FP16 chunks at ``full_part_bits``): what ``target_bits`` budgets. Needs the search (or set_precisions)."""
        if not self._plans or not self._searched:
            raise RuntimeError("plan_bits_per_element() needs run_search() or set_precisions() first")
        cost = planning.bits_cost(self.config.packed_bits_per_element, self.config.full_part_bits)
        return [planning.plan_bits_per_element(p, self.config.chunk_size, cost) for p in self._plans]

    def set_precisions(self, bits: list[list[int]]) -> None:
        """Impose the precision of every context chunk (per sequence, original order) instead of the search; call
        after :meth:`prepare_inputs` and before ``generate`` (used by ablations and custom policies)."""
        if self._plans is None:
            raise RuntimeError("set_precisions() needs prepare_inputs() first")
        allowed = (16, *self.config.packed_bits)
        for plan, row in zip(self._plans, planning.check_bits_rows(bits, self._plans, allowed)):
            plan.bits = row
        self._searched = True
        self.prefill_len = -1

    # ----------------------------------------------------------------- Cache API
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        check_head_dims(key_states, value_states, self._watch.model_type)
        layer = self._layer(layer_idx)
        if not isinstance(layer, CocktailLayer):  # sliding-window / hybrid layers: the model's own cache layer
            return layer.update(key_states, value_states, *args, **kwargs)
        watch = self._watch  # (the first layer's checks; a decode step after a watched prefill has none)
        if (watch.armed or watch.num_layers is None) and layer_idx == self._first_cocktail_idx():
            if watch.armed:
                self._check_forward(key_states)
                if layer.state is LayerState.EMPTY:  # this forward is the prefill: the attention must be seen
                    check_attention_reader(self.config, watch.last_config, self.scores_from_attention())
            elif self.layers:  # no model config seen: count the layers filled
                self._check_layer_count(len(self.layers))
        if self._is_prefill_chunk(layer, key_states):
            return self._prefill_chunk(layer, key_states, value_states)
        return layer.update(key_states, value_states, *args, **kwargs)

    def _layer(self, layer_idx: int) -> Any:
        """The cache layer of model layer ``layer_idx`` (the per-layer-type layout is built on first use when the
        model's config is known; otherwise Cocktail layers are added as layers appear)."""
        if not self.layers:
            model_config = self._model_config or self._watch.model_config
            if model_config is not None:
                self.layers = layout.model_layers(self, model_config)
                if self.layers and not self._cocktail_layers():
                    logger.warning(
                        "CocktailCache: this model has no full-attention layer (every layer is sliding-window, "
                        "linear or shared), so nothing is quantized: the cache holds what the model's own cache holds"
                    )
        while len(self.layers) <= layer_idx:
            self.layers.append(CocktailLayer(self, len(self.layers)))
        return self.layers[layer_idx]

    def _cocktail_layers(self) -> list[CocktailLayer]:
        return [layer for layer in self.layers if isinstance(layer, CocktailLayer)]

    def _first_cocktail_idx(self) -> int:
        return next((i for i, layer in enumerate(self.layers) if isinstance(layer, CocktailLayer)), 0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx in self._partial:
            return self._partial[layer_idx][0].shape[2]
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx in self._partial:
            return self._partial[layer_idx][0].shape[2] + query_length, 0
        return super().get_mask_sizes(query_length, layer_idx)

    # ----------------------------------------------------------------- prefill checks and chunked prefill
    def _check_forward(self, k: torch.Tensor) -> None:
        """At the first layer of each forward until the prepared prompt is complete: the batch, the model's layer
        count and the token ids the model embedded (as far as :class:`PrefillWatch` saw them) must be the prepared
        prompt's. A forward may cover a part of the prompt (chunked prefill, a prefix first) or go beyond it
        (assisted decoding's first candidates)."""
        if self._watch.num_layers is not None:
            self._check_layer_count(self._watch.num_layers)
        if self._plans is None:  # no prepare_inputs: plans_for_prefill plans this prefill and disarms the watch
            return
        if self._input_ids is None:
            self._watch.disarm()
            return
        past = self.get_seq_length(self._first_cocktail_idx())
        check_prefill_ids(self._watch, self._input_ids, k, past, self.prompt_len)

    def _check_layer_count(self, num_layers: int, cocktail_layers: list[int] | None = None) -> None:
        """The fields that name layers against the model's ``num_layers`` (``cocktail_layers``: the indices of its
        full-attention layers, default: those of the layout built, else every layer)."""
        if cocktail_layers is None:
            built = [layer.layer_idx for layer in self._cocktail_layers()]
            cocktail_layers = built if len(self.layers) == num_layers else list(range(num_layers))
        check_layer_fields(self.config, num_layers, cocktail_layers)
        self._num_layers = num_layers

    def reset(self):
        """Empty the cache and forget the prepared prompts (the next prefill is planned from what it embeds, or from
        a new ``prepare_inputs``)."""
        self.layers = []
        self._plans = None
        self._input_ids = None
        self.prompt_len = 0
        self._partial = {}
        self._searched = False
        self.prefill_len = -1
        self._watch.arm()
        self._num_layers = None

    def _select(self, indices: list[int]) -> None:
        plans = self._plans or []
        same = len(indices) == len(plans) and all(
            plans[j] is plans[i] or plans[j].origin == plans[i].origin for i, j in enumerate(indices)
        )
        for layer in self.layers:
            if isinstance(layer, CocktailLayer):
                layer.select_sequences(indices, same_packed=same)
            else:
                layer.reorder_cache(torch.tensor(indices, dtype=torch.long))
        if self._plans is not None:
            self._plans = [self._plans[i] for i in indices]

    def crop(self, max_length: int) -> None:
        super().crop(int(max_length))  # some transformers versions pass a 0-d tensor
        # tokens removed from the prefill itself (assisted decoding's first candidates): positions shrink too
        new_len = self.get_seq_length()
        if self._plans and 0 <= new_len < self.prefill_len:
            for plan in self._plans:
                plan.build_positions(new_len, self.config.chunk_size, self.config.packed_bits)
            self.prefill_len = new_len

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

    def warn_dequantize_fallback(self) -> None:
        if not self._warned_fallback:
            logger.warning(
                "CocktailCache is used with an attention implementation other than 'cocktail': every decode step "
                "dequantizes the whole cache (correct but slow). Load the model with attn_implementation='cocktail' "
                "to read the packed codes directly."
            )
            self._warned_fallback = True

    # ----------------------------------------------------------------- reports
    def precision_map(self) -> list[list[int]]:
        """Per sequence of the cache's batch, the bits (16, 4 or 2) of each context chunk in original order, then of
        each appended chunk packed since (generated, later turns). Rows follow generate's batch: ``num_beams=k`` or
        ``num_return_sequences=k`` gives k rows per prompt (prompt i's rows are ``i*k`` to ``i*k+k-1``, alike)."""
        self._flush_deferred()
        if not self._plans or not self._searched:
            raise RuntimeError("precision_map() is available after the prefill of generate (the search runs there)")
        appended = max((la.appended_chunk_bits() for la in self._cocktail_layers()), key=len, default=[])
        return [[*p.decided_bits(), *appended] for p in self._plans]

    def chunk_scores(self) -> list[list[float] | None]:
        """Per sequence, each context chunk's similarity score (None with ``uniform_bits``); rows as in
        :meth:`precision_map`."""
        self._flush_deferred()
        if not self._plans or not self._searched:
            raise RuntimeError("chunk_scores() is available after the prefill of generate")
        return [p.scores for p in self._plans]

    def _flush_deferred(self) -> None:
        for layer in self._cocktail_layers():
            layer.flush_deferred()

    def _stores(self):
        self._flush_deferred()
        return [layer.store for layer in self._cocktail_layers() if layer.store is not None]

    def nbytes(self) -> int:
        """Bytes really held by the cache: every tensor of its layers (packed codes, scales/zeros, the full part and
        its room for appended tokens, the rotation matrices counted once (though shared with other caches), offsets
        cached on the device, the model's own sliding-window / hybrid layers) and of its plans (token positions,
        attention masses, salient positions, the prompt's ids); ``keep_context_copy``'s CPU copy is apart."""
        return self.memory_report()["total_bytes"]

    def memory_report(self) -> dict[str, Any]:
        """Breakdown of :meth:`nbytes` plus what the same tokens would take in a FP16 cache (see
        :func:`hf_cocktail.cache.reports.memory_report`)."""
        copies = [layer.context_copy for layer in self._cocktail_layers() if layer.context_copy is not None]
        natives = [layer for layer in self.layers if not isinstance(layer, CocktailLayer)]
        native = [t for n in natives for t in reports.object_tensors(n)] + layout.hybrid_state_tensors(self.layers)
        stores = self._stores()
        rep = reports.memory_report(
            stores,
            copies,
            [p.bits for p in self._plans or []],
            native_bytes=reports.storage_bytes(native),
            native_fp16_bytes=sum(layout.native_nbytes(layer, fp16=True) for layer in natives),
            native_deployed_bytes=reports.storage_bytes(native, fp16=True),
            plan_bytes=reports.storage_bytes(reports.plan_tensors(self._plans, self._input_ids)),
        )
        rep["value_group_sizes"] = sorted({seg.group_size for st in stores for seg in st.segments})
        return rep
