"""Calibration of a ``CocktailConfig`` for one model on the user's texts, within a KV byte target.

1. The texts become windows (:mod:`.texts`), split into calibration and validation (held-out) windows.
2. On the calibration windows, the storage rotation with the lowest mean KL at the base widths (4-bit keys / 3-bit
   values in every layer) among the four the store supports (:data:`hf_cocktail.storage.rotation.ROTATIONS`: none,
   ``"hadamard"`` (keys and values), ``"hadamard_keys"``, ``"hadamard_values"``; four base probes per window), then
   each Cocktail layer's sensitivity under it: the KL added when that layer alone has 3- or 2-bit keys or 2- or 4-bit
   values around the base (:mod:`.sensitivity`), averaged.
3. Candidates (:mod:`.candidates`): the layer solve's caps at the largest budget that fits the target, stored with
   that rotation and, when it is a rotated one, also unrotated (the rotation's matrices count in the bytes), per storage
   variant (8-bit full part or not, 0 / 1 / 2% salient tokens), and, with ``search_scorers``, the query-aware chunk
   search on top of the best of them; bytes measured with the real cache.
4. Every candidate and the baselines (uniform INT4, ``recommended()``) are measured with the real cache
   (:mod:`.validate`) on the held-out windows and on their recall probes (:mod:`.recall`: key-value needles in the
   same context, one asked); among those whose bytes ratio on a long prompt (``bytes_tokens``, default 8192: the
   first text that long) is within the target and
   that recall at least as faithfully as uniform INT4 (the geometric mean over the probes of their recall KL over
   INT4's on the same probe at most 1: :func:`recall_ratio`), the lowest held-out KL wins; when none recalls that
   well, the lowest ``score``: the mean of the two KL divergences, each over uniform INT4's (:func:`choose`,
   :func:`add_scores`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from hf_cocktail.calibrate.agreement import real_base_kl
from hf_cocktail.calibrate.candidates import (
    Candidate,
    CapsSpace,
    baselines,
    caps_candidates,
    search_candidates,
    storage,
)
from hf_cocktail.calibrate.fake_quant import FakeQuantizer
from hf_cocktail.calibrate.recall import NEEDLES, recall_window
from hf_cocktail.calibrate.sensitivity import LayerProbe, cocktail_layer_indices, probe_deltas
from hf_cocktail.calibrate.solve import layer_deltas
from hf_cocktail.calibrate.texts import Window, bytes_window, split_windows
from hf_cocktail.calibrate.validate import Prepared, bytes_ratio, measure, prepare, summarize
from hf_cocktail.presets.config import CocktailConfig
from hf_cocktail.storage.rotation import ROTATIONS as STORE_ROTATIONS

BASE = (4, 3)  # the widths the sensitivity is measured around
KEY_OPTIONS, VALUE_OPTIONS = (3, 2), (2, 4)
SCORERS = ("encoder", "bm25", "attention")
ROTATIONS = STORE_ROTATIONS  # the storage rotations compared at the base widths: all four the store supports


@dataclass
class CalibrationResult:
    """What :func:`calibrate_model` measured: the chosen config, every candidate's held-out numbers, the sensitivity."""

    config: CocktailConfig
    chosen: str
    target: float
    candidates: list[dict[str, Any]]
    sensitivity: list[dict[str, Any]]
    cocktail_layers: list[int]
    calibration_windows: list[str]
    validation_windows: list[str]
    settings: dict[str, Any]
    timings_s: dict[str, float] = field(default_factory=dict)

    def measured(self, name: str) -> dict[str, Any]:
        """The held-out record of candidate ``name``."""
        for c in self.candidates:
            if c["name"] == name:
                return c
        raise KeyError(f"no candidate named {name!r}; measured: {[c['name'] for c in self.candidates]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen,
            "target_bytes": self.target,
            "config": self.config.to_dict(),
            "candidates": self.candidates,
            "sensitivity": self.sensitivity,
            "cocktail_layers": self.cocktail_layers,
            "calibration_windows": self.calibration_windows,
            "validation_windows": self.validation_windows,
            "settings": self.settings,
            "timings_s": self.timings_s,
        }


class TargetUnreachable(ValueError):
    """No candidate's bytes fit the target."""


def _check_args(target: float, search_scorers: Sequence[str], rotations: Sequence[str | None]) -> None:
    if not isinstance(target, (int, float)) or not 0 < target <= 1:
        raise ValueError(f"target must be a number in (0, 1] (the quantized layers' bytes over FP16's), got {target!r}")
    if isinstance(rotations, str) or not rotations or any(r not in ROTATIONS for r in rotations):
        raise ValueError(f"rotations must be a non-empty list of {ROTATIONS}, got {rotations!r}")
    bad = [s for s in search_scorers if s not in SCORERS]
    if bad:
        raise ValueError(f"search_scorers must be among {SCORERS}, got {list(search_scorers)!r}")


def _texts(texts) -> list[tuple[str, str]]:
    if isinstance(texts, str) or not texts:
        raise ValueError("texts: give a non-empty list of your own texts (strings or (name, text) pairs)")
    return [t if isinstance(t, tuple) else (f"text {i}", t) for i, t in enumerate(texts)]


def _probe(model, prep: Prepared, cocktail: list[int], rotation: str | None) -> LayerProbe:
    k = prep.prefill.layers[cocktail[0]].keys
    fq = FakeQuantizer(CocktailConfig(**storage(k.shape[-1], rotation)), k.shape[1], k.shape[-1], k.dtype)
    return LayerProbe(model, prep.prefill, prep.span, fq, prep.continuation, prep.ref_logits, cocktail)


@torch.no_grad()
def sensitivity(
    model, tok, windows: list[Window], cocktail: list[int], progress: bool, rotations: Sequence[str | None] = ROTATIONS
) -> tuple[list, dict]:
    """Per calibration window, :func:`.sensitivity.probe_deltas` over the Cocktail layers, stored with the rotation
    of ``rotations`` whose mean KL at the base widths is the lowest; returns the records and the choice
    (``{"rotation": ..., "base_kl": {str(rotation): [KL per window]}, "base_kl_real": the same with the real
    cache}``: :mod:`.agreement`)."""
    n = 1 + len(cocktail) * (len(KEY_OPTIONS) + len(VALUE_OPTIONS))
    bar = tqdm(total=(n + 2 * len(rotations)) * len(windows), desc="calibrate: layer sensitivity", disable=not progress)
    base = [BASE] * len(cocktail)
    preps: list[Prepared] = []
    base_kl: dict[str | None, list[float]] = {r: [] for r in rotations}
    real: dict[str, list[float]] = {str(r): [] for r in rotations}
    for w in windows:
        preps.append(prepare(model, tok, w))
        for r in rotations:
            base_kl[r].append(_probe(model, preps[-1], cocktail, r).kl(base))
            real[str(r)].append(real_base_kl(model, tok, preps[-1], cocktail, r, BASE))
            bar.update(2)
    rotation = choose_rotation(base_kl, rotations)
    records = []
    for prep in preps:
        probe = _probe(model, prep, cocktail, rotation)
        records.append(
            {"window": prep.window.name, **probe_deltas(probe, base, KEY_OPTIONS, VALUE_OPTIONS, bar.update)}
        )
    bar.close()
    return records, {"rotation": rotation, "base_kl": {str(r): v for r, v in base_kl.items()}, "base_kl_real": real}


def choose_rotation(base_kl: dict[str | None, list[float]], rotations: Sequence[str | None] = ROTATIONS) -> str | None:
    """The rotation of ``base_kl`` (rotation -> KL per calibration window) with the lowest mean KL; every one of
    ``rotations`` must be there, with one KL per window."""
    missing = [r for r in rotations if not base_kl.get(r)]
    if missing:
        raise ValueError(f"base_kl: needs the KLs of every rotation in {list(rotations)}, missing {missing}")
    return min(rotations, key=lambda r: statistics.fmean(base_kl[r]))


def caps_rotations(choice: dict) -> list[str | None]:
    """The storages the caps candidates are built with: the sensitivity's rotation and, when that is a rotated one
    and no rotation was compared too, no rotation. The three rotated kinds hold the same matrix bytes, so the base KL
    at equal widths compares them fairly; against no rotation the matrices' bytes count against the target (on
    Gemma 3 270M, head dim 256, ~0.04x at 2K tokens), so both go to the held-out measurement at the target."""
    rotation = choice["rotation"]
    return [rotation, None] if rotation is not None and "None" in choice["base_kl"] else [rotation]


def reused_sensitivity(earlier: dict, windows: list[str], cocktail: list[int]) -> tuple[list, dict]:
    """The sensitivity records and rotation choice of an earlier result, checked to be of the same calibration texts
    and Cocktail layers. The records were measured under its rotation, so that rotation is kept (a result from before
    the four-way comparison compared only ``"hadamard"`` and none)."""
    if earlier.get("calibration_windows") != windows or earlier.get("cocktail_layers") != cocktail:
        raise ValueError(
            f"sensitivity_from was measured on texts {earlier.get('calibration_windows')} and layers "
            f"{earlier.get('cocktail_layers')}, not on these ({windows}, {cocktail}): give the same texts and model"
        )
    choice = earlier["settings"]["rotation_choice"]
    if choice.get("rotation") not in ROTATIONS:
        raise ValueError(f"sensitivity_from: its rotation must be one of {ROTATIONS}, got {choice.get('rotation')!r}")
    return earlier["sensitivity"], choice


def validate_all(
    model,
    tok,
    held_out: list[Prepared],
    recall_probes: list[Prepared],
    cands: list[Candidate],
    target: float,
    progress: bool,
    bytes_of=None,
) -> list:
    """Every candidate measured on every held-out window and its recall probe: one record per candidate (the bytes
    from the held-out windows, ``recall_*`` from the probes; ``bytes_ratio`` and ``fits`` from ``bytes_of(config)``,
    the bytes on the prompt the target is measured on; the held-out windows' where None)."""
    total = len(cands) * (len(held_out) + len(recall_probes))
    bar = tqdm(total=total, desc="calibrate: validate", disable=not progress, dynamic_ncols=True)

    def measured_on(preps: list[Prepared], config: CocktailConfig) -> dict:
        per = []
        for p in preps:
            per.append(measure(model, tok, p, config))
            bar.update()
        return summarize(per)

    out = []
    for c in cands:
        s, r = measured_on(held_out, c.config), measured_on(recall_probes, c.config)
        ratio = s["quantized_ratio"] if bytes_of is None else bytes_of(c.config)
        out.append(
            {
                "name": c.name,
                "kind": c.kind,
                "budget": c.budget,
                **c.info,
                **s,
                "recall_kld": r["kld"],
                "recall_top1": r["top1"],
                "recall_kld_per_window": r["kld_per_window"],
                "bytes_ratio": ratio,
                "fits": ratio <= target,
                "config": c.config.to_dict(),
            }
        )
    bar.close()
    return out


_FLOOR = 1e-12  # a KLD of exactly 0 counts as this much, so that any divergence from FP16 weighs as far worse


def add_scores(measured: list[dict], reference: str = "uniform INT4") -> None:
    """Give every record its ``score``: the mean of its held-out KLD and its recall KLD, each over ``reference``'s
    (a scale-free mix: 1.0 is the reference's fidelity on both), and its ``recall_ratio`` (:func:`recall_ratio`).
    :func:`choose` reads both."""
    ref = reference_record(measured, reference)
    for m in measured:
        m["score"] = (m["kld"] / max(ref["kld"], _FLOOR) + m["recall_kld"] / max(ref["recall_kld"], _FLOOR)) / 2
        m["recall_ratio"] = recall_ratio(m, ref)


def recall_ratio(record: dict, reference: dict) -> float:
    """How far from FP16 ``record`` recalls against ``reference``, probe by probe: the geometric mean over the
    recall probes of its recall KLD over the reference's on the same probe (1.0: as faithful as the reference; 0.5:
    half its divergence on a typical probe). Paired and scale-free, so one probe where the reference happens to
    diverge far (a mean's weight) does not decide it."""
    mine, theirs = record["recall_kld_per_window"], reference["recall_kld_per_window"]
    if len(mine) != len(theirs) or not mine:
        raise ValueError(f"recall probes differ: {len(mine)} for {record['name']!r}, {len(theirs)} for the reference")
    logs = [math.log(max(a, _FLOOR) / max(b, _FLOOR)) for a, b in zip(mine, theirs)]
    return math.exp(sum(logs) / len(logs))


def reference_record(measured: list[dict], reference: str = "uniform INT4") -> dict:
    ref = next((m for m in measured if m["name"] == reference), None)
    if ref is None:
        raise ValueError(f"no {reference!r} record among {[m['name'] for m in measured]}")
    return ref


def choose(candidates: list[dict], reference: dict) -> dict:
    """What calibration picks among ``candidates`` (measured records): the lowest held-out KLD among those that
    recall at least as faithfully as ``reference`` (uniform INT4): :func:`recall_ratio` at most 1; when none recalls
    that well, the lowest ``score`` (:func:`add_scores`)."""
    recalling = [m for m in candidates if recall_ratio(m, reference) <= 1.0]
    return min(recalling, key=lambda m: m["kld"]) if recalling else min(candidates, key=lambda m: m["score"])


def calibrate_model(
    model,
    tokenizer,
    texts,
    target: float = 0.25,
    *,
    calibration_texts: int = 4,
    validation_texts: int = 4,
    window: int = 2048,
    question_tokens: int = 64,
    continuation_tokens: int = 32,
    search_scorers: Sequence[str] = (),
    encoder: str | None = None,
    progress: bool = True,
    sensitivity_from: dict | None = None,
    rotations: Sequence[str | None] = ROTATIONS,
    bytes_tokens: int = 8192,
) -> CalibrationResult:
    """Calibrate a config for ``model`` on ``texts`` (strings or ``(name, text)`` pairs) whose Cocktail layers'
    KV bytes are at most ``target`` times their FP16 bytes on a ``bytes_tokens``-token prompt. See the module docstring.
    ``encoder``: the retrieval encoder of ``search_scorers`` "encoder" and of the returned config.
    ``sensitivity_from``: an earlier result's ``to_dict()`` on the same model and texts, whose sensitivity is reused
    (another target without measuring it again). ``rotations``: the storage rotations compared (default all four;
    a subset, e.g. ``(None, "hadamard")``, reproduces a narrower comparison). ``bytes_tokens``: the prompt length
    the target holds at (:func:`.texts.bytes_window`: the first text that long, else the longest); at most
    ``window`` (e.g. 0): the first held-out window."""
    _check_args(target, search_scorers, rotations)
    if not isinstance(bytes_tokens, int) or bytes_tokens < 0:
        raise ValueError(f"bytes_tokens must be an integer >= 0 (0: the held-out windows), got {bytes_tokens!r}")
    t0 = time.perf_counter()
    named = _texts(texts)
    cal, val = split_windows(
        tokenizer, named, calibration_texts, validation_texts, window, question_tokens, continuation_tokens
    )
    cocktail = cocktail_layer_indices(model.config)
    if not cocktail:
        raise ValueError(
            "the model has no full-attention layer: a CocktailCache quantizes nothing, nothing to calibrate"
        )
    timings = {}
    if sensitivity_from is None:
        records, rotation_choice = sensitivity(model, tokenizer, cal, cocktail, progress, rotations)
    else:
        records, rotation_choice = reused_sensitivity(sensitivity_from, [w.name for w in cal], cocktail)
    timings["sensitivity"] = time.perf_counter() - t0
    deltas = layer_deltas(records, [BASE])
    recall_windows = [recall_window(tokenizer, w) for w in val]
    bar = tqdm([*val, *recall_windows], desc="calibrate: held-out prefills", disable=not progress)
    prepared = [prepare(model, tokenizer, w) for w in bar]
    preps, recall_preps = prepared[: len(val)], prepared[len(val) :]
    long = bytes_window(tokenizer, named, bytes_tokens, question_tokens, 2) if bytes_tokens > window else None
    bytes_prep = preps[0] if long is None else prepare(model, tokenizer, long)
    head_dim = preps[0].prefill.layers[cocktail[0]].keys.shape[-1]
    num_layers = len(preps[0].prefill.layers)
    spaces = {r: CapsSpace(deltas, cocktail, num_layers, head_dim, r) for r in caps_rotations(rotation_choice)}
    rotation_choice = {**rotation_choice, "caps_rotations": [str(r) for r in spaces]}

    fit_bar = tqdm(desc="calibrate: bytes of candidate settings", disable=not progress, unit="fill")

    def ratio_of(cfg: CocktailConfig) -> float:
        fit_bar.update()
        return bytes_ratio(tokenizer, bytes_prep, cfg)

    t1 = time.perf_counter()
    caps = [c for space in spaces.values() for c in caps_candidates(space, ratio_of, target)]
    if not caps:
        cheapest = min(ratio_of(sp.config(sp.budgets[0], 8, 0.0)) for sp in spaces.values())
        raise TargetUnreachable(
            f"target={target!r}: even every layer at 2-bit keys and values takes "
            f"{cheapest:.3f}x the FP16 bytes here; give a larger target"
        )
    timings["fit_caps"] = time.perf_counter() - t1
    val_args = (model, tokenizer, preps, recall_preps)
    measured = validate_all(*val_args, [*caps, *baselines(head_dim)], target, progress, ratio_of)
    add_scores(measured)
    if search_scorers:
        caps_records = measured[: len(caps)]  # measured opens with the caps, in their order
        picked = choose(caps_records, reference_record(measured))
        best_caps = next(c for c, m in zip(caps, caps_records) if m is picked)
        t2 = time.perf_counter()
        space = spaces[best_caps.info["rotation"]]
        search = search_candidates(space, best_caps, ratio_of, target, search_scorers, encoder)
        timings["fit_search"] = time.perf_counter() - t2
        measured += validate_all(*val_args, search, target, progress, ratio_of)
        add_scores(measured)
    fit_bar.close()
    fitting = [m for m in measured if m["fits"] and m["kind"] != "baseline"] or [m for m in measured if m["fits"]]
    if not fitting:
        raise TargetUnreachable(f"target={target!r}: no candidate's held-out bytes ratio is within it: {measured}")
    best = choose(fitting, reference_record(measured))
    timings["total"] = time.perf_counter() - t0
    settings = {
        "target": target,
        "window": window,
        "bytes_window": {"text": bytes_prep.window.name, "tokens": int(bytes_prep.input_ids.shape[1])},
        "question_tokens": question_tokens,
        "continuation_tokens": continuation_tokens,
        "recall_needles": NEEDLES,
        "search_scorers": list(search_scorers),
        "base": list(BASE),
        "key_options": list(KEY_OPTIONS),
        "value_options": list(VALUE_OPTIONS),
        "rotation_choice": rotation_choice,
    }
    return CalibrationResult(
        CocktailConfig.from_dict(best["config"], **({"encoder": encoder} if encoder else {})),
        best["name"],
        target,
        measured,
        records,
        cocktail,
        [w.name for w in cal],
        [w.name for w in val],
        settings,
        {k: round(v, 1) for k, v in timings.items()},
    )


def calibrate(model, tokenizer, texts, target: float = 0.25, **kwargs: Any) -> CocktailConfig:
    """The config :func:`calibrate_model` chooses: the lowest held-out KL divergence from FP16 among the settings
    whose Cocktail layers hold at most ``target`` times their FP16 KV bytes and which recall needles from the held-out
    texts at least as faithfully as uniform INT4 (:func:`choose`)."""
    return calibrate_model(model, tokenizer, texts, target, **kwargs).config
