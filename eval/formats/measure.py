"""One held-out window: KL(P_fp16 || P) over its teacher-forced continuation for every (format, bits, side) setting.

The window (:func:`hf_cocktail.calibrate.texts.make_window`: context, question, FP16's continuation) is prefilled
once at full precision (:func:`hf_cocktail.calibrate.validate.prepare`). A setting's cache is a copy of that prefill
whose context keys/values (``[start, end)`` of the context tokens, as ``CocktailCache`` splits the prompt) of the
layers a ``CocktailCache`` quantizes (:func:`hf_cocktail.calibrate.sensitivity.cocktail_layer_indices`: every layer
of a full-attention model, the global layers of Gemma 3) are replaced by their round trip (:mod:`.variants`); the
other layers, the question and the continuation stay at full precision. Side ``"k"`` changes the keys only, ``"v"``
the values only, ``"kv"`` both.

Shapes: cache keys/values ``(1, H_kv, T, D)``; logits ``(n, V)``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_cocktail.calibrate.divergence import kl_and_top1, teacher_force
from hf_cocktail.calibrate.fake_quant import FakeQuantizer
from hf_cocktail.calibrate.validate import Prepared

from .rope import apply_rope, layer_cos_sin, undo_rope
from .variants import Format, round_trip

SETTING_SIDES = ("k", "v", "kv")


@dataclass(frozen=True)
class Setting:
    """One measurement: ``fmt`` on ``side`` (``"k"``, ``"v"`` or ``"kv"``) at ``bits``; with ``side="kv"``,
    ``value_bits`` (default ``bits``) gives the values another width than the keys."""

    fmt: Format
    bits: int
    side: str
    value_bits: int | None = None

    def width(self, one: str) -> int:
        """The code width of ``one`` (``"k"`` or ``"v"``)."""
        return self.value_bits if one == "v" and self.value_bits is not None else self.bits

    @property
    def key(self) -> tuple[str, int, int, str]:
        """``(format, key bits, value bits, side)``, how records name it."""
        return (self.fmt.name, self.width("k"), self.width("v"), self.side)


def settings(formats: list[Format], bits: list[int], pairs: Sequence[tuple[int, int]] = ()) -> list[Setting]:
    """Every setting measured: each format at each width on each side (keys-only formats, pre-RoPE without
    outliers, are not measured on the values alone, where they change nothing) and, on both sides, each
    ``(key_bits, value_bits)`` pair of ``pairs``."""
    out: list[Setting] = []
    for side in SETTING_SIDES:
        for fmt in formats:
            if side == "v" and fmt.pre_rope:
                continue
            out.extend(Setting(fmt, b, side) for b in bits)
    out.extend(Setting(fmt, kb, "kv", vb) for fmt in formats for kb, vb in pairs)
    return out


def record_key(window: str, s: dict) -> tuple:
    """A record's setting ``s`` as :attr:`Setting.key`, with its window (older records lack ``value_bits``)."""
    return (window, s["format"], s["bits"], s.get("value_bits", s["bits"]), s["side"])


class WindowProbe:
    """KL from FP16 of one prepared window with the quantized layers' context in a chosen format."""

    def __init__(self, model, prep: Prepared, layers: list[int], fq: FakeQuantizer):
        self.model, self.prep, self.layers, self.fq = model, prep, layers, fq
        s, e = prep.span
        positions = torch.arange(s, e, device=prep.input_ids.device)
        self.rope = {i: layer_cos_sin(model, i, positions) for i in layers}
        self._memo: dict[tuple, tuple[torch.Tensor, float]] = {}

    def stored(self, layer: int, side: str) -> torch.Tensor:
        """The FP16 prefill's context keys or values of ``layer``: ``(H_kv, N, D)``."""
        s, e = self.prep.span
        src = self.prep.prefill.layers[layer]
        return (src.keys if side == "k" else src.values)[0, :, s:e]

    def rope_round_trip_error(self) -> tuple[float, float]:
        """Max |apply_rope(undo_rope(k)) - k| over the quantized layers' context keys (no quantization), and the max
        |k| beside it."""
        errs, mags = [], []
        for i in self.layers:
            k = self.stored(i, "k")
            errs.append(float((apply_rope(undo_rope(k, *self.rope[i]), *self.rope[i]) - k).abs().max()))
            mags.append(float(k.abs().max()))
        return max(errs), max(mags)

    def context(self, layer: int, side: str, fmt: Format, bits: int) -> tuple[torch.Tensor, float]:
        """The round trip of ``layer``'s context ``side`` in ``fmt`` at ``bits`` (model dtype) and its outlier
        fraction (memoized)."""
        key = (layer, side, fmt.name, bits)
        if key not in self._memo:
            x = self.stored(layer, side)
            y, frac = round_trip(self.fq, x, bits, side, fmt, *self.rope[layer])
            self._memo[key] = (y.to(x.dtype), frac)
        return self._memo[key]

    def cache(self, setting: Setting | None) -> tuple[DynamicCache, dict[str, float]]:
        """A copy of the prefill with the quantized layers' context as ``setting`` stores it (``None``: unchanged),
        and the mean outlier fraction of the keys and of the values."""
        fracs: dict[str, list[float]] = {"k": [], "v": []}
        contexts: dict[int, dict[str, torch.Tensor]] = {}
        for i in self.layers if setting is not None else ():
            contexts[i] = {}
            for one in setting.side:
                contexts[i][one], frac = self.context(i, one, setting.fmt, setting.width(one))
                fracs[one].append(frac)
        return replaced_cache(self.model, self.prep, contexts), {k: sum(v) / len(v) for k, v in fracs.items() if v}

    @torch.no_grad()
    def kl(self, setting: Setting | None) -> dict:
        """``{"kld", "top1", "outliers"}``: mean KL and top-1 agreement over the continuation, outlier fractions."""
        cache, fracs = self.cache(setting)
        return {**continuation_kl(self.model, self.prep, cache), "outliers": fracs}


def replaced_cache(model, prep: Prepared, contexts: dict[int, dict[str, torch.Tensor]]) -> DynamicCache:
    """A copy of ``prep``'s FP16 prefill in which layer ``i``'s context keys (``contexts[i]["k"]``) and values
    (``contexts[i]["v"]``), each ``(H_kv, N, D)`` for the context span, replace the stored ones (cast to the cache's
    dtype); layers and sides not named are copied unchanged."""
    cache = DynamicCache(config=model.config)
    s, e = prep.span
    for i, src in enumerate(prep.prefill.layers):
        if i not in contexts:
            cache.layers[i] = copy.deepcopy(src)
            continue
        kv = {"k": src.keys.clone(), "v": src.values.clone()}
        for one, y in contexts[i].items():
            kv[one][0, :, s:e] = y.to(kv[one].dtype)
        cache.update(kv["k"], kv["v"], i)
    return cache


@torch.no_grad()
def continuation_kl(model, prep: Prepared, cache: DynamicCache) -> dict[str, float]:
    """``{"kld", "top1"}``: mean KL(P_fp16 || P) and top-1 agreement over ``prep``'s teacher-forced continuation
    through ``cache``."""
    logits = teacher_force(model, cache, prep.continuation, False)
    kl, agree = kl_and_top1(prep.ref_logits, logits)
    return {"kld": float(kl.mean()), "top1": float(agree.double().mean())}


def measure_window(probe: WindowProbe, grid: list[Setting], tick: Callable[[], None] = lambda: None) -> dict:
    """One record: the unchanged copy's KL (a check: 0 up to rounding), the RoPE round trip's max error and every
    setting's :meth:`WindowProbe.kl`."""
    record = {
        "window": probe.prep.window.name,
        "context_tokens": probe.prep.span[1] - probe.prep.span[0],
        "fp16_copy_kld": probe.kl(None)["kld"],
        "rope_round_trip_max_abs_err": None,
        "keys_max_abs": None,
        "settings": [],
    }
    record["rope_round_trip_max_abs_err"], record["keys_max_abs"] = probe.rope_round_trip_error()
    for st in grid:
        fields = {"format": st.fmt.name, "bits": st.width("k"), "value_bits": st.width("v"), "side": st.side}
        record["settings"].append({**fields, **probe.kl(st)})
        tick()
    return record
