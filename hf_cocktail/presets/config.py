"""`CocktailConfig`: the one validated configuration object of hf-cocktail."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from hf_cocktail.presets.files import ConfigFiles
from hf_cocktail.presets.moot import check_moot
from hf_cocktail.storage.layer_bits import check_layer_bits, mean_code_bits
from hf_cocktail.storage.quant import FULL_PART_BITS, SCALE_BITS, SUPPORTED_BITS
from hf_cocktail.storage.rotation import ROTATIONS

FORMAT_VERSION = 1
DEFAULT_ENCODER = "facebook/contriever"
_BACKENDS = ("auto", "torch", "triton", "cpu")
_UNIFORM_BITS = (None, 16, 4, 3, 2)
_LOW_BITS = (2, 3)
_SCALE_DTYPES = ("float16", "bfloat16", "float32", "model")
_SCORERS = ("encoder", "bm25", "attention")
_CHOICES: dict[str, tuple] = dict(backend=_BACKENDS, scorer=_SCORERS, scale_dtype=_SCALE_DTYPES)  # one of these
_CHOICES.update(rotation=(*ROTATIONS, "auto"), scale_bits=SCALE_BITS, full_part_bits=FULL_PART_BITS)
_COUNTS = {"chunk_size": 1, "encoder_batch_size": 1, "sink_tokens": 0, "recent_tokens": 0, "neighbors": 0}
_COUNTS.update(residual_tokens=0)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class CocktailConfig(ConfigFiles):
    """Settings of a Cocktail KV cache.

    A field set (to a value other than its default) where another field makes it ineffective is refused, naming both
    (e.g. ``target_bits`` or ``scorer`` with ``uniform_bits``, ``neighbors`` with ``target_bits``): the table is
    :data:`hf_cocktail.presets.moot.MOOT`.

    Args:
        chunk_size: context tokens per chunk (C). Each chunk gets one precision; for keys the chunk is also the
            quantization group along tokens (per-channel scale/zero within the chunk).
        alpha: ``T_low = s_min + alpha * (s_max - s_min)``; chunks with ``s <= T_low`` get the low precision
            (``low_bits``: INT2 in the paper).
        beta: ``T_high = s_max - beta * (s_max - s_min)``; chunks with ``s > T_high`` are FP16, the rest INT4.
        encoder: retrieval encoder, a Hub id or a local folder. Sentence-transformers models use their own pooling;
            plain encoders (Contriever) use mean pooling over non-padding tokens.
        group_size: values are quantized per token in groups of up to ``group_size`` channels (G), a power of two: a
            layer whose head dim D it does not divide uses the largest power of two below it that does
            (:meth:`group_size_for`: 64 gives 64 at D=64, 128, 256, 32 at D=32 and 96, 16 at D=80), recorded in its
            packed segments and counted by ``nbytes()``; ``memory_report()["value_group_sizes"]`` lists those used.
        uniform_bits: ``None`` for the Cocktail search, or 16 / 4 / 3 / 2 to force every context chunk to one
            precision (the uniform baselines).
        low_bits: the lowest of the three precisions, given to the least relevant chunks: 2 (the paper's INT2) or 3
            (INT3, stored as a 2-bit and a 1-bit plane; with rotation it loses ~10x less than INT2 for 1 more bit).
        backend: decode attention backend: ``"auto"`` (Triton on CUDA when installed; on CPU the fused C++ kernel of
            ``cpu_ops``, compiled on first use, or PyTorch with one warning where it cannot be built), ``"torch"``
            (the plain PyTorch reference), ``"triton"``, ``"cpu"`` (the fused CPU kernel, an error if unavailable).
        scale_dtype: dtype of quantization scales and zeros: ``"float16"`` (default, as KIVI), ``"bfloat16"``,
            ``"float32"`` or ``"model"`` (the model's dtype). A scale that overflows it raises an error.
        encoder_batch_size: chunks embedded per encoder forward.
        encoder_device: device of the encoder (``None``: CUDA if available, else CPU).
        scorer: how chunks are scored against the query: ``"encoder"`` (the paper: cosine similarity of retrieval
            embeddings), ``"bm25"`` (lexical Okapi BM25, no model at all) or ``"attention"`` (the LLM's own prefill
            attention from the query's tokens to each chunk, summed over heads and layers, mean per token; needs
            ``attn_implementation="cocktail"``; quantization then waits for the first decode step).
        target_bits: budget mode (``None``: the paper's alpha/beta thresholds). Average bits per context K/V element,
            scales and zeros included (INT2 costs ``2 + 16/C + 16/G`` bits, INT3 ``3 + ...``, INT4 ``4 + ...``, FP16 16
            counted as in an FP16 deployment). Chunks above ``T_high`` get FP16, then INT4 goes to the best-ranked
            remaining chunks while the budget allows, the rest the low precision (``low_bits``); budget left once all
            are INT4 buys FP16 in rank order. Must lie in ``[bits of all-low, 16]``.
        sink_tokens: the first ``sink_tokens`` tokens of each prompt always stay at full precision, even inside the
            context (attention sinks).
        recent_tokens: the last ``recent_tokens`` context tokens always stay at full precision.
        full_precision_layers: indices of layers kept entirely at full precision (e.g. ``(0,)``).
        neighbors: chunks within ``neighbors`` positions of an FP16 chunk are promoted to FP16 too (alpha/beta
            mode), so that a fact straddling a chunk boundary is not half INT2. 0 (default) is the paper. Not adopted:
            on SmolLM2 ``neighbors=1`` bought no gain beyond noise for 14% more KV bytes (CHANGELOG.md).
        rotation: rotated storage (:mod:`hf_cocktail.storage.rotation`): ``None`` (the paper), ``"hadamard"`` (keys and
            values), ``"hadamard_keys"`` or ``"hadamard_values"``. A fixed orthonormal per-head transform (Hadamard
            with seeded random signs; a seeded random orthogonal matrix for head dims that are not a power of two) is
            applied to the stored keys/values; attention rotates the query once and the output back once, never the
            cache. Same bytes, far less quantization error. ``"auto"``: values rotated in every layer, keys in the
            layers where the prompt's own queries after the context see less logit error from rotated keys than from
            unrotated ones (:mod:`hf_cocktail.planning.key_rotation`; needs ``attn_implementation="cocktail"`` or
            ``load_prefill(..., prefill_queries=...)``, else keys are rotated everywhere, with a log warning).
        rotation_seed: seed of the rotation's random signs.
        value_bits: the most code bits a packed chunk's values get (``None``, the paper: values take their chunk's
            precision, as keys do): with 3, an INT4 chunk stores 4-bit keys and 3-bit values. Keys decide which tokens
            attention reads and lose far more to low bits. One of 2, 3, 4.
        scale_bits: storage of the packed chunks' scales and zeros: 16 (the paper: ``scale_dtype`` numbers) or 8
            (8-bit codes on three numbers per chunk and head, :func:`hf_cocktail.storage.params8.encode_params8`; key
            parameters then cost 16/C bits per element instead of 32/C, value parameters 16/G instead of 32/G).
        layer_bits: ``None`` (every layer alike) or one ``(key_bits, value_bits)`` pair per model layer, each of 2, 3,
            4 with ``value_bits <= key_bits``: the most code bits packed keys and values keep in that layer (a chunk
            planned at ``b`` bits stores ``min(b, key_bits)``-bit keys there; FP16 chunks stay FP16;
            :mod:`hf_cocktail.storage.layer_bits`). Calibrated per model (``python -m hf_cocktail.calibrate``): the
            layers that tolerate low bits give their bytes to those that do not.
        salient_tokens: the fraction (0 to 1) of each layer's packed context tokens kept at full precision: those
            with the most attention from the tokens after the context (the question) in that layer's prefill
            (:mod:`hf_cocktail.planning.salient`). 0 (default) is the paper. Needs ``attn_implementation="cocktail"``
            (or ``load_prefill(..., prefill_queries=...)``); quantization then waits for the first decode step. Their
            bytes come on top of the plan's (``target_bits`` budgets the chunks only).
        full_part_bits: storage of the tokens outside the packed chunks (template, question, FP16 chunks, sink and
            salient tokens, generated tokens): 16 (the paper: the model's precision) or 8 (8-bit codes with one scale
            per token and head, keys in the layer's rotated basis, or in the values' where only the values are
            rotated; the first ``sink_tokens`` tokens stay at the model's precision beside them;
            :mod:`hf_cocktail.storage.full_part`). The
            plan's FP16 tier (16 in ``precision_map``) is then 8-bit; ``target_bits`` counts it at 8 (the scale's 16/D
            bits left out). ``full_precision_layers`` stay at the model's precision.
        residual_tokens: the newest tokens of each sequence kept at the full part's precision (KIVI's residual,
            ``QuantizedCache``'s ``residual_length``): generated tokens and later turns are packed at the layer's
            widths a chunk at a time as they fall more than ``residual_tokens`` behind the newest token; without
            :meth:`~hf_cocktail.CocktailCache.prepare_inputs` the prompt's last ``residual_tokens`` tokens stay at
            full precision too and the rest of it (after ``sink_tokens``) is packed as context.
        key_outlier_share: the share (0 to 0.5) of each KV head's key channels stored with 8-bit codes in the packed
            chunks: per layer and head those of the largest per-chunk ranges in the prefill's own (rotated) keys, key
            outliers being fixed per channel (KIVI, KVQuant); the rest keep the chunk's width, values are unchanged.
            Rounded up per segment so the rest fill whole code bytes (:mod:`hf_cocktail.storage.key_outliers`).
            0 (default): none. Needs ``scale_bits=16``.
        center_keys: store each layer's keys minus the mean key of the prompt's context (per sequence, head and
            channel; :mod:`hf_cocktail.storage.key_centering`). Attention is unchanged (every score of a query moves by
            the same amount), but a channel's constant offset no longer costs the 8-bit zeros (``scale_bits=8``) and
            the 8-bit full part their precision. Costs ``2 * D`` bytes per sequence, head and layer. False: the paper.
        keep_context_copy: keep a full-precision copy of the prompt up to the end of the context on CPU, so that
            :meth:`CocktailCache.requery` can answer a new question about the same document without a new prefill.
    """

    chunk_size: int = 32
    alpha: float = 0.6
    beta: float = 0.1
    encoder: str = DEFAULT_ENCODER
    group_size: int = 32
    uniform_bits: int | None = None
    low_bits: int = 2
    backend: str = "auto"
    scale_dtype: str = "float16"
    encoder_batch_size: int = 64
    encoder_device: str | None = None
    scorer: str = "encoder"
    target_bits: float | None = None
    sink_tokens: int = 4
    recent_tokens: int = 0
    full_precision_layers: tuple = ()
    keep_context_copy: bool = False
    neighbors: int = 0
    rotation: str | None = None
    rotation_seed: int = 0
    value_bits: int | None = None
    scale_bits: int = 16
    layer_bits: tuple | None = None
    salient_tokens: float = 0.0
    full_part_bits: int = 16
    residual_tokens: int = 128
    key_outlier_share: float = 0.0
    center_keys: bool = False

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():  # of the allowed values' own types (True is not 1, 8.0 is not 8)
            v = getattr(self, name)
            _check(
                type(v) in {type(a) for a in allowed} and v in allowed, f"{name} must be one of {allowed}, got {v!r}"
            )
        for name, least in _COUNTS.items():
            v = getattr(self, name)
            _check(_is_int(v) and v >= least, f"{name} must be an integer >= {least}, got {v!r}")
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            _check(_is_real(v) and 0.0 <= v <= 1.0, f"{name} must be a number in [0, 1], got {v!r}")
        _check(
            self.alpha + self.beta <= 1.0 + 1e-12,
            f"alpha + beta must be <= 1 (so that T_low <= T_high), got alpha={self.alpha!r}, beta={self.beta!r}",
        )
        _check(
            isinstance(self.encoder, str) and self.encoder.strip() != "",
            f"encoder must be a non-empty Hub id or local path, got {self.encoder!r}",
        )
        _check(
            _is_int(self.group_size) and self.group_size >= 1 and (self.group_size & (self.group_size - 1)) == 0,
            f"group_size must be a power of two >= 1, got {self.group_size!r}",
        )
        _check(
            self.uniform_bits is None or (_is_int(self.uniform_bits) and self.uniform_bits in _UNIFORM_BITS),
            f"uniform_bits must be one of None, 16, 4, 3, 2, got {self.uniform_bits!r}",
        )
        _check(
            _is_int(self.low_bits) and self.low_bits in _LOW_BITS,
            f"low_bits must be one of {_LOW_BITS}, got {self.low_bits!r}",
        )
        layers = self.full_precision_layers
        _check(
            isinstance(layers, (list, tuple)) and all(_is_int(i) and i >= 0 for i in layers),
            f"full_precision_layers must be a list of layer indices >= 0, got {layers!r}",
        )
        object.__setattr__(self, "full_precision_layers", tuple(sorted(set(layers))))  # no re-validation
        for name in ("keep_context_copy", "center_keys"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.target_bits is not None:
            lo = self.packed_bits_per_element(self.low_bits)
            _check(
                _is_real(self.target_bits) and lo <= self.target_bits <= 16,
                f"target_bits must be None or a number in [{lo:g}, 16] (all-INT{self.low_bits} costs {lo:g} bits "
                f"per element "
                f"with chunk_size={self.chunk_size}, group_size={self.group_size}), got {self.target_bits!r}",
            )
        _check(
            self.encoder_device is None or isinstance(self.encoder_device, str),
            f"encoder_device must be None or a device string, got {self.encoder_device!r}",
        )
        _check(_is_int(self.rotation_seed), f"rotation_seed must be an integer, got {self.rotation_seed!r}")
        _check(
            self.value_bits is None or (_is_int(self.value_bits) and self.value_bits in SUPPORTED_BITS),
            f"value_bits must be one of None, {', '.join(map(str, SUPPORTED_BITS))}, got {self.value_bits!r}",
        )
        _check(
            _is_real(self.salient_tokens) and 0.0 <= self.salient_tokens <= 1.0,
            f"salient_tokens must be a number in [0, 1] (a fraction of the packed context tokens), got "
            f"{self.salient_tokens!r}",
        )
        share = self.key_outlier_share
        _check(
            _is_real(share) and 0.0 <= share <= 0.5,
            f"key_outlier_share must be a number in [0, 0.5] (a share of each head's key channels), got {share!r}",
        )
        _check(
            share == 0 or self.scale_bits == 16,
            f"key_outlier_share={share!r} needs scale_bits=16 (outlier key channels keep 16-bit scales), got "
            f"scale_bits={self.scale_bits!r}",
        )
        object.__setattr__(self, "layer_bits", check_layer_bits(self.layer_bits))  # lists -> tuples
        check_moot(self)  # a field another makes ineffective (hf_cocktail.presets.moot)
        object.__setattr__(self, "_validated", True)  # from now on, assignments are validated (__setattr__)

    def __new__(cls, *args: Any, **kwargs: Any) -> CocktailConfig:
        """Refuses a removed field (:data:`REMOVED_FIELDS`) with why it went, instead of Python's bare TypeError."""
        for name in sorted(REMOVED_FIELDS.keys() & kwargs.keys()):
            raise removed_field_error(name, kwargs[name])
        return super().__new__(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        """A field assigned after construction is validated as at construction, and a refused value is not kept.
        Checks across fields run too: change related fields together with ``dataclasses.replace(config, ...)``. A
        name that is not a field (a typo, a removed field) is refused: nothing would read it."""
        fields = {f.name for f in dataclasses.fields(self)}
        if name not in fields and not name.startswith("_"):
            if name in REMOVED_FIELDS:
                raise removed_field_error(name, value)
            raise AttributeError(f"CocktailConfig has no field {name!r}; its fields: {sorted(fields)}")
        if not self.__dict__.get("_validated") or name not in fields:
            object.__setattr__(self, name, value)
            return
        old = self.__dict__[name]
        object.__setattr__(self, name, value)
        try:
            self.__post_init__()
        except Exception:
            object.__setattr__(self, name, old)
            raise

    @classmethod
    def recommended(cls, **overrides: Any) -> CocktailConfig:
        """The recommended setting: every context chunk with 4-bit keys and values (``uniform_bits=4``), 8-bit scales
        and zeros (``scale_bits=8``), values in groups of up to 64 channels, keys centred on the context's mean key
        (``center_keys=True``), values rotated and keys rotated in the layers where the prompt's own queries see less
        error so (``rotation="auto"``, read from the prefill under ``attn_implementation="cocktail"``; keys rotated
        everywhere under another attention). Its KL divergence from FP16 beside uniform INT4's, at 8K-token LongBench
        windows and needle prompts: docs/results.md (issue 46). No query is needed, so it works without
        ``prepare_inputs``. Groups of up to 64 channels: a head dim that 64 does not divide (32, 80, 96) gets the
        largest power of two that does (:meth:`group_size_for`). ``CocktailConfig()`` stays the paper's setting; the
        recommendation before 2026-12-07 is ``recommended(rotation="hadamard", value_bits=3, scale_bits=16,
        center_keys=False)``. ``overrides`` replace fields (e.g. ``encoder=``)."""
        return cls(**{**RECOMMENDED, **overrides})

    def group_size_for(self, head_dim: int) -> int:
        """The value group size a layer of head dim ``head_dim`` (D) stores with: the largest power of two that is
        at most ``group_size`` and divides D."""
        if not _is_int(head_dim) or head_dim < 1:
            raise ValueError(f"head_dim must be an integer >= 1, got {head_dim!r}")
        g = self.group_size
        while head_dim % g:
            g //= 2
        return g

    @property
    def packed_bits(self) -> tuple[int, ...]:
        """The packed precisions a layer's store holds, in storage order: INT4 and the low precision (the uniform
        one's with ``uniform_bits`` 3 or 2)."""
        low = self.uniform_bits if self.uniform_bits in (2, 3) else self.low_bits
        return (4, low)

    def chunk_value_bits(self, bits: int) -> int:
        """The code width of a ``bits``-bit chunk's values (``value_bits`` caps it; ``layer_bits`` may cap it more)."""
        return bits if self.value_bits is None else min(bits, self.value_bits)

    def packed_bits_per_element(self, bits: int) -> float:
        """Storage bits per K/V element of a ``bits``-bit chunk, scales and zeros included (K: 2 per C tokens per
        channel, V: 2 per G channels), averaged over K and V (values capped by ``value_bits``) and over the layers
        (``layer_bits``). With ``scale_bits=8`` each is 8 bits; the 3 numbers per chunk and head (~0.02 bits at C=32,
        D=64) are left out."""
        p = 8 if self.scale_bits == 8 else 32 if self.scale_dtype == "float32" else 16
        outliers = self.key_outlier_share * (8 - bits) / 2  # 8-bit outlier key channels (their rounding left out)
        return (
            mean_code_bits(bits, self.layer_bits, self.value_bits)
            + p / self.chunk_size
            + p / self.group_size
            + outliers
        )

    def torch_scale_dtype(self, model_dtype):
        """The torch dtype of scales/zeros for a model whose keys/values have ``model_dtype``."""
        return model_dtype if self.scale_dtype == "model" else getattr(torch, self.scale_dtype)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["full_precision_layers"] = list(self.full_precision_layers)  # JSON-native
        d["format_version"] = FORMAT_VERSION
        if not d["key_outlier_share"]:  # a setting without outlier key channels serialises as before they existed
            del d["key_outlier_share"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> CocktailConfig:
        if not isinstance(d, dict):
            raise TypeError(f"from_dict expects a dict, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("format_version", FORMAT_VERSION)
        if not _is_int(version) or version > FORMAT_VERSION or version < 1:
            raise ValueError(
                f"cocktail config format_version {version!r} is not supported by this hf-cocktail "
                f"(it reads versions 1..{FORMAT_VERSION}); upgrade hf-cocktail: pip install -U hf-cocktail"
            )
        d.update(overrides)
        _drop_removed(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown CocktailConfig keys {unknown}; allowed keys are {sorted(known)}")
        return cls(**d)

    def to_json_string(self) -> str:
        """The exact text ``save_pretrained`` writes to ``cocktail_config.json``."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


# Fields removed from CocktailConfig: {name: (the value that kept the behaviour left, why the rest went)}. A saved
# config holding the kept value still loads (the key is dropped); any other value is refused (CHANGELOG.md).
REMOVED_FIELDS: dict[str, tuple[Any, str]] = {
    "codebook": (
        "uniform",
        "the anchored Lloyd-Max levels measured no better than uniform levels on LongBench (every paired interval "
        "contains 0) and ~4x worse on the needle prompts with INT3, and no preset used them",
    ),
}


def _drop_removed(d: dict[str, Any]) -> None:
    """Drop the keys of :data:`REMOVED_FIELDS` from a saved config ``d`` (in place) where they hold the behaviour
    that is left; any other value is a ValueError saying the feature was removed and why."""
    for name, (kept, _why) in REMOVED_FIELDS.items():
        if name not in d:
            continue
        value = d.pop(name)
        if value != kept or type(value) is not type(kept):
            raise removed_field_error(name, value)


def removed_field_error(name: str, value: Any) -> ValueError:
    """The error for a field of :data:`REMOVED_FIELDS` given ``value`` (in a saved config, the constructor or an
    assignment)."""
    kept, why = REMOVED_FIELDS[name]
    return ValueError(
        f"{name}={value!r} is no longer supported: the {name!r} field was removed in this version of hf-cocktail "
        f"(CHANGELOG.md, Removed), because {why}; without it the behaviour is {kept!r}, the only one left: delete "
        f"{name!r} from the saved config or the call"
    )


RECOMMENDED: dict[str, Any] = {
    "rotation": "auto",
    "uniform_bits": 4,
    "scale_bits": 8,
    "group_size": 64,
    "center_keys": True,
}
