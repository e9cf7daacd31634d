"""`CocktailLayer`: one layer of a Cocktail cache, a transformers ``CacheLayerMixin`` that owns its storage.

A layer moves through explicit states (:class:`LayerState`); how its decode attention is computed is one explicit
choice (:class:`AttentionPath`). The attention function asks the layer (``reads_packed_store``,
``claim_split_attention``, ``observe_prefill_attention``) instead of reading its fields.

Shapes: B batch, H_kv key/value heads, L tokens of one update, D head dim.
"""

from __future__ import annotations

import copy
import enum
import weakref
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

from hf_cocktail.decode.dispatch import attach_fused_writer, quantizers
from hf_cocktail.planning.key_rotation import layer_rotation, tail_query_moment
from hf_cocktail.storage.generated import AppendedPacking, crop_appended, pack_appended
from hf_cocktail.storage.key_centering import centered, context_key_mean
from hf_cocktail.storage.layer_bits import code_widths
from hf_cocktail.storage.rotation import Rotation, full_part_key_basis
from hf_cocktail.storage.store import LayerStore


class LayerOwner(Protocol):
    """What a layer asks of the cache that owns it (:class:`~hf_cocktail.CocktailCache`)."""

    config: Any
    prompt_len: int
    prefill_len: int

    def plans_for_prefill(self, k: torch.Tensor, search: bool = True) -> list: ...

    @property
    def plans(self) -> tuple: ...

    def layer_positions(self, layer_idx: int, all_full: bool = False) -> list[dict]: ...

    def layer_bits_pair(self, layer_idx: int) -> tuple[int, int] | None: ...

    def scores_from_attention(self) -> bool: ...

    def waits_for_prefill_attention(self, layer_idx: int) -> bool: ...

    def accumulate_attention(self, query: torch.Tensor, key: torch.Tensor, scaling: float, layer_idx: int) -> None: ...

    def warn_dequantize_fallback(self) -> None: ...


class LayerState(enum.Enum):
    EMPTY = "empty"  # nothing stored: new, reset, or waiting for a requery's re-prefill (``pending`` set)
    DEFERRED = "deferred"  # scorer="attention" / salient_tokens: prefill keys/values kept raw until the first decode
    PREFILL = "prefill"  # the store was built in this forward: attention runs over the keys update returned
    DECODE = "decode"  # store built; new tokens go to its full-precision part


class AttentionPath(enum.Enum):
    UNKNOWN = "unknown"  # no attention function claimed the layer yet: update hands out the dequantized cache
    SPLIT = "split"  # attn_implementation="cocktail" reads the packed store: update returns the full part only
    DEQUANTIZE = "dequantize"  # load_prefill(split_attention=False): always hand out the dequantized cache


class CocktailLayer(CacheLayerMixin):
    """One layer of a :class:`~hf_cocktail.CocktailCache`. Prefill stores the prompt's keys/values into a
    :class:`LayerStore` (context chunks quantized by the cache's precision plan); later tokens are appended to its
    full-precision part."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: LayerOwner, layer_idx: int = 0):
        super().__init__()
        self._cache = weakref.ref(cache)  # the cache owns its layers: no reference cycle
        self.layer_idx = layer_idx
        self.config = cache.config
        self.all_full = layer_idx in cache.config.full_precision_layers
        self.state = LayerState.EMPTY
        self.path = AttentionPath.UNKNOWN
        self.store: LayerStore | None = None
        self.seq_len = 0
        self.context_copy: tuple[torch.Tensor, torch.Tensor] | None = None  # keep_context_copy, on CPU
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # requery: the copy, to re-prefill
        self.deferred: tuple[torch.Tensor, torch.Tensor] | None = None  # state DEFERRED: raw prefill k/v
        self.query_moment: torch.Tensor | None = None  # rotation="auto": the prompt's queries (key_rotation)
        self.center_keys = cache.config.center_keys  # False once the attention shows soft-capping or sinks
        self._dequantized_steps = 0

    @property
    def cache(self) -> LayerOwner:
        cache = self._cache()
        if cache is None:
            raise RuntimeError("this CocktailLayer's cache no longer exists")
        return cache

    def __deepcopy__(self, memo: dict) -> CocktailLayer:
        """A copy that belongs to the copy of its cache when the cache is copied (``copy.deepcopy(cache)``), not
        to the original: the weak reference is re-pointed through ``memo``."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            new.__dict__[name] = copy.deepcopy(value, memo)
        cache = self._cache()
        new._cache = weakref.ref(memo.get(id(cache), cache)) if cache is not None else self._cache
        return new

    # ----------------------------------------------------------------- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states``, ``value_states``: ``(B, H_kv, L, D)``; returns what the attention function consumes."""
        if self.state is LayerState.EMPTY:
            return self._first_update(key_states, value_states)
        if self.state is LayerState.DEFERRED:  # first decode step after an attention-scored prefill: quantize now
            self._build_deferred()
        self.state = LayerState.DECODE
        # the appended tokens past the residual window go to the packed store before this forward's tokens join:
        # every query of the forward is newer than every packed token (causal masking reads the full part only)
        pack_appended(self._store, self.config.residual_tokens)
        self._store.append(key_states, value_states)
        self.seq_len += key_states.shape[2]
        if self.path is AttentionPath.SPLIT:  # attention reads the store; these only lead it to this layer
            keys, values = self._store.full.split_path_tensors()
            return self._tagged(keys), values
        # still here at a second decode step means another attention implementation consumes the dequantized cache
        self._dequantized_steps += 1
        if self._dequantized_steps == 2 and self.path is AttentionPath.UNKNOWN:
            self.cache.warn_dequantize_fallback()
        keys, values = self.dequantized()
        return self._tagged(keys), values

    def _first_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if self.pending is not None:  # after requery: prompt prefix + context at full precision, then the rest
            pk, pv = self.pending
            key_states = torch.cat([pk.to(key_states.device, key_states.dtype), key_states], dim=2)
            value_states = torch.cat([pv.to(value_states.device, value_states.dtype), value_states], dim=2)
            self.pending = None
        self.lazy_initialization(key_states, value_states)
        if self.cache.waits_for_prefill_attention(self.layer_idx) or self._auto_rotation():
            self.cache.plans_for_prefill(key_states, search=not self.cache.scores_from_attention())
            self.deferred = (key_states, value_states)
            self.seq_len, self.state = key_states.shape[2], LayerState.DEFERRED
        else:
            self._build_store(key_states, value_states)
        return self._tagged(key_states), value_states

    def _tagged(self, keys: torch.Tensor) -> torch.Tensor:
        """Let the attention function find this layer behind the key tensor it receives. A weak reference: the
        layer holds these tensors, and a strong one would make a reference cycle that keeps whole caches alive
        until the garbage collector runs."""
        keys._cocktail_layer = weakref.ref(self)  # type: ignore[attr-defined]
        return keys

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = self.deferred = None
        self.state = LayerState.EMPTY
        self.path = AttentionPath.UNKNOWN
        self.seq_len = 0
        self.is_initialized = False

    # ----------------------------------------------------------------- what the attention function asks
    def reads_packed_store(self) -> bool:
        """True when decode attention must read the packed store (a decode step with split attention allowed)."""
        return self.state is LayerState.DECODE and self.path is not AttentionPath.DEQUANTIZE

    def claim_split_attention(self) -> None:
        """The ``"cocktail"`` attention function serves this layer: later updates return the full part only."""
        if self.path is not AttentionPath.DEQUANTIZE:
            self.path = AttentionPath.SPLIT

    def observe_prefill_attention(
        self, query: torch.Tensor, key: torch.Tensor, scaling: float, shift_sensitive: bool = False
    ) -> None:
        """scorer="attention" / salient_tokens: record this layer's prefill attention (before it quantizes);
        rotation="auto": the second moment of its queries after the context. ``query (B, H_q, L_q, D)``, ``key
        (B, H_kv, L, D)``. ``shift_sensitive``: the attention soft-caps or has sinks, so ``center_keys`` is not
        applied to this layer (the fused kernels could not serve it)."""
        self.center_keys = self.center_keys and not shift_sensitive
        if self.state is LayerState.DEFERRED:
            self.cache.accumulate_attention(query, key, scaling, self.layer_idx)
            if self._auto_rotation():
                rows = [(p.ctx_end, key.shape[2]) for p in self.cache.plans]
                self.query_moment = tail_query_moment(query, key.shape[2], rows, key.shape[1])

    def _auto_rotation(self) -> bool:
        """rotation="auto": the layer's key rotation waits for the prompt's queries (:mod:`.key_rotation`)."""
        return self.config.rotation == "auto" and not self.all_full and self.config.uniform_bits != 16

    def after_load_prefill(self, split_attention: bool | None) -> None:
        """``load_prefill``: the next update is a decode step; ``True``/``False`` fix the attention path."""
        self.state = LayerState.DECODE if self.store is not None else self.state
        if split_attention is not None:
            self.path = AttentionPath.SPLIT if split_attention else AttentionPath.DEQUANTIZE

    def prepare_requery(self, context_len: int) -> None:
        """Drop the store; the next update re-prefills the context copy followed by the new tokens."""
        self.pending, self.store, self.state, self.seq_len = self.context_copy, None, LayerState.EMPTY, context_len

    def flush_deferred(self) -> None:
        """scorer="attention" and generation ended at prefill: quantize now."""
        if self.state is LayerState.DEFERRED:
            self._build_deferred()

    # ----------------------------------------------------------------- storage
    @property
    def _store(self) -> LayerStore:
        """The store, which the prefill builds (states PREFILL and DECODE)."""
        if self.store is None:
            raise RuntimeError(
                f"CocktailLayer {self.layer_idx} has no store: its prefill has not run (state {self.state})"
            )
        return self.store

    def _build_deferred(self) -> None:
        """State DEFERRED: quantize the raw prefill keys/values kept until the prefill attention was seen."""
        if self.deferred is None:
            raise RuntimeError(f"CocktailLayer {self.layer_idx} is in state DEFERRED without its prefill keys/values")
        self._build_store(*self.deferred)
        self.deferred = None

    def _build_store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        plans = self.cache.plans_for_prefill(k)
        cfg = self.config
        quantize_k, quantize_v = quantizers(cfg.backend, k.device)
        positions = self.cache.layer_positions(self.layer_idx, self.all_full)
        H, D = k.shape[1], k.shape[3]
        mean = None
        if self.center_keys and not self.all_full:
            mean = context_key_mean(k, [(p.ctx_start, p.ctx_end) for p in plans], cfg.torch_scale_dtype(k.dtype))
        rotation = (
            None
            if self.all_full
            else Rotation.make(self._rotation_kind(centered(k, mean), plans), H, D, cfg.rotation_seed, k.device)
        )
        full_bits = 16 if self.all_full else cfg.full_part_bits
        self.store = LayerStore.build(
            k,
            v,
            positions,
            cfg.chunk_size,
            cfg.group_size_for(k.shape[3]),
            cfg.torch_scale_dtype(k.dtype),
            quantize_k,
            quantize_v,
            rotation,
            code_widths(16, self.cache.layer_bits_pair(self.layer_idx), cfg.value_bits)[1],
            cfg.scale_bits,
            full_bits,
            0.0 if self.all_full else cfg.key_outlier_share,
            mean,
            full_part_key_basis(full_bits, rotation),
            cfg.sink_tokens,  # an 8-bit full part keeps the prompt's sink tokens at the model's precision
        )
        self.store.packing = self._appended_packing(quantize_k, quantize_v, cfg.torch_scale_dtype(k.dtype))
        # the prefill's tokens past the cache's prompt_len age like appended ones: the prompt's tail without
        # prepare_inputs (the full part's last residual_tokens), assisted decoding's first candidates with it
        self.store.appended_from -= max(0, k.shape[2] - self.cache.prompt_len)
        attach_fused_writer(self.store, cfg.backend)
        if cfg.keep_context_copy and self.context_copy is None:
            end = max(p.ctx_end for p in plans)
            self.context_copy = (k[:, :, :end].to("cpu", copy=True), v[:, :, :end].to("cpu", copy=True))
        self.seq_len = k.shape[2]
        self.state = LayerState.PREFILL

    def _rotation_kind(self, k: torch.Tensor, plans: list) -> str | None:
        """The configured rotation; with rotation="auto" the one :func:`.key_rotation.layer_rotation` chooses for
        this layer's prefill keys ``k (B, H_kv, L, D)`` at the layer's key width."""
        cfg = self.config
        if cfg.rotation != "auto":
            return cfg.rotation
        if cfg.uniform_bits == 16:  # nothing is packed: the rotation is moot
            return "hadamard"
        kind, self.query_moment = layer_rotation(k, plans, self.query_moment, self._packed_key_bits(), cfg), None
        return kind

    def _packed_key_bits(self) -> int:
        """The key width of this layer's packed chunks at the setting's width (``uniform_bits`` 4, 3 or 2; INT4 for
        the search), capped by its ``layer_bits`` as the context's chunks are."""
        cfg = self.config
        bits = 4 if cfg.uniform_bits is None else cfg.uniform_bits
        return code_widths(bits, self.cache.layer_bits_pair(self.layer_idx), cfg.value_bits)[0]

    def _appended_packing(self, quantize_k, quantize_v, scale_dtype: torch.dtype) -> AppendedPacking | None:
        """How this layer packs the tokens appended after its prefill (generated tokens, later turns) as they leave
        the residual window: at the width of the setting's packed context chunks (``uniform_bits`` 4, 3 or 2; INT4
        for the search, the width its middle tier of chunks gets), capped by the layer's ``layer_bits`` and
        ``value_bits`` as those chunks are, into the segment of that width. Never in a layer kept at full precision
        (``full_precision_layers``) or with ``uniform_bits=16`` (the cache then equals ``DynamicCache``)."""
        cfg, store = self.config, self._store
        if self.all_full or cfg.uniform_bits == 16:
            return None
        key_bits = self._packed_key_bits()
        index = next((i for i, seg in enumerate(store.segments) if seg.bits == key_bits), None)
        if index is None:
            raise RuntimeError(
                f"CocktailLayer {self.layer_idx}: no {key_bits}-bit segment for the appended tokens among "
                f"{[seg.bits for seg in store.segments]}"
            )
        return AppendedPacking(index, scale_dtype, cfg.scale_bits, quantize_k, quantize_v)

    def appended_chunk_bits(self) -> list[int]:
        """The plan's width (``uniform_bits``; 4 for the search) of each chunk of appended tokens (generated tokens,
        later turns) this layer has packed, oldest first, the same for every sequence (``layer_bits`` may store them
        narrower, as the context's chunks): what a precision map shows after the context's chunks."""
        store = self.store
        if store is None or store.packing is None:
            return []
        bits = 4 if self.config.uniform_bits is None else self.config.uniform_bits
        return [bits] * (store.packed_appended // store.segments[store.packing.segment].chunk_size)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache at the model's precision in original token order, ``(B, H_kv, seq_len, D)`` each, left
        padding as zeros (masked by the attention mask). Used by the plain sdpa/eager fallback."""
        positions = self.cache.layer_positions(self.layer_idx, self.all_full)
        return self._store.dequantized(positions, self.seq_len, self.cache.prefill_len)

    # ----------------------------------------------------------------- batch manipulation
    def select_sequences(self, indices: list[int], same_packed: bool = False) -> None:
        """Keep (and reorder / repeat) sequences ``indices`` of the batch (see :meth:`LayerStore.select`)."""
        if self.deferred is not None:
            idx = torch.tensor(indices, dtype=torch.long, device=self.deferred[0].device)
            self.deferred = (self.deferred[0].index_select(0, idx), self.deferred[1].index_select(0, idx))
        if self.store is not None:
            self.store = self.store.select(indices, same_packed)

    def crop(self, max_length: int) -> None:
        """Remove the last ``-max_length`` tokens (only generated ones can go)."""
        tokens_to_remove = int(max_length)  # some transformers versions pass a 0-d tensor
        if tokens_to_remove > 0:
            raise ValueError(f"crop expects a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or self.state is LayerState.EMPTY:
            return
        generated = self.seq_len - self.cache.prompt_len
        if n > generated:
            raise ValueError(
                f"CocktailCache can only crop tokens added after the prompt ({max(generated, 0)} "
                f"here); asked to remove {n}"
            )
        if self.deferred is not None:
            self.deferred = (self.deferred[0][:, :, :-n], self.deferred[1][:, :, :-n])
        else:  # past the unpacked tokens, the newest packed chunks too (storage.generated.crop_appended)
            crop_appended(self._store, n)
        self.seq_len -= n


def layer_of(keys: torch.Tensor) -> CocktailLayer | None:
    """The Cocktail layer whose ``update`` returned ``keys`` (None for any other tensor)."""
    ref = getattr(keys, "_cocktail_layer", None)
    return ref() if ref is not None else None
