"""Code widths by importance against one width per segment (issue 26), fake quantization, KLD from FP16 on held-out
windows (:mod:`.widths` says what is chosen and how).

Usage (see eval/README.md)::

    python -m eval.formats.widths_cli --model gemma-3-270m --threads 2

The weights and the per-unit errors that choose the widths come from calibration windows (default: the first
``--n-calib`` texts the model card's own calibration read); the KLD is measured on held-out essays no calibration
read (:func:`eval.formats.cli.held_out_texts`), so the choice is fixed per layer before any measured window is seen.
Outputs under ``--out-dir/<model>``: ``records.jsonl`` (one line per window), ``settings.json`` (with the chosen
widths' histograms), ``summary.md`` and ``widths.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections import Counter

import torch
from tqdm.auto import tqdm

from hf_cocktail import CocktailConfig
from hf_cocktail.calibrate.fake_quant import FakeQuantizer
from hf_cocktail.calibrate.sensitivity import cocktail_layer_indices
from hf_cocktail.calibrate.texts import make_window, read_texts
from hf_cocktail.calibrate.validate import Prepared, prepare
from hf_cocktail.offline_models import canonical_name
from hf_cocktail.storage.quant import SUPPORTED_BITS

from ..cli import UsageError
from ..kv_bytes import kv_geometry
from ..models import set_threads
from ..paths import REPO_ROOT
from ..records import append_jsonl, iter_jsonl, write_json
from ..reporting import pyplot
from ..run_info import command_line, git_commit, hardware_info
from ..stats import bootstrap_mean
from .cli import held_out_texts, load
from .measure import continuation_kl, replaced_cache
from .widths import (
    MAX_WIDTH,
    allocate,
    distortions,
    keys_round_trip,
    mean_width,
    mixed_round_trip,
    output_weights,
    query_weights,
    values_round_trip,
)

MODULE = "eval.formats.widths_cli"
PARAM_BITS = 1.0  # fp16 scale + zero per C = 32 key tokens / G = 32 value channels: 32 / 32 bits per element
PARAM_BITS_8 = 0.5  # the same with the package's 8-bit parameters (scale_bits=8)
REFERENCE = "uniform K4/V4"
WINDOW_TOKENS, QUESTION_TOKENS, CONTINUATION_TOKENS = 2048, 64, 32  # as eval.formats cuts its windows


def _pairs(text: str, arg: str) -> list[tuple[float, float]]:
    try:
        return [(float(a), float(b)) for a, b in (p.split(":") for p in text.split(",") if p.strip())]
    except ValueError as e:
        raise UsageError(f"{arg}: 'K:V' pairs of mean key and value code widths, comma-separated, got {text!r}") from e


def _width_sets(text: str) -> list[tuple[int, ...]]:
    sets = [tuple(int(c) for c in s.strip()) for s in text.split(",") if s.strip()]
    if not sets or any(list(s) != sorted(set(s)) for s in sets):
        raise UsageError(f"--width-sets: increasing digits per set, comma-separated (e.g. 234,2348), got {text!r}")
    return sets


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m", help="an offline model (gemma-3-270m, smollm2-135m-instruct)")
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "eval", "results", "formats", "widths"))
    p.add_argument("--n-texts", type=int, default=6, help="held-out windows measured")
    p.add_argument("--n-calib", type=int, default=3, help="calibration windows (the model card's first texts)")
    p.add_argument("--calib-texts", nargs="*", default=None, help="calibration texts instead of the card's")
    p.add_argument("--width-sets", default="234,2348,02348,012345678", help="candidate widths per set")
    p.add_argument("--budgets", default="4:3,3.5:3.5,3:3,3:2.5", help="mean key:value code widths")
    p.add_argument("--uniform", default="4:4,4:3,3:3", help="uniform key:value widths measured beside them")
    p.add_argument("--rotation", default=None, help="also uniform widths with this CocktailConfig rotation (hadamard)")
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    return p


def card_texts(model_name: str) -> list[str]:
    """The texts the model card's calibration read (its ``calibration.json`` command), in order."""
    path = os.path.join(REPO_ROOT, "model_cards", model_name, "calibration.json")
    if not os.path.isfile(path):
        raise UsageError(f"no model card calibration at {path}: pass --calib-texts")
    with open(path, encoding="utf-8") as f:
        found = re.findall(r"\S+\.(?:txt|jsonl)", json.load(f)["command"])
    return [p if os.path.isabs(p) else os.path.normpath(os.path.join(REPO_ROOT, p)) for p in found]


def windows(tok, paths: list[str], n: int) -> list:
    """The first ``n`` windows of ``paths`` long enough, cut as calibration cuts them."""
    out = []
    for name, text in read_texts(paths):
        w = make_window(tok, name, text, WINDOW_TOKENS, QUESTION_TOKENS, CONTINUATION_TOKENS)
        if w is not None and len(out) < n:
            out.append(w)
    return out


class Calibration:
    """Per quantized layer: the query and output weights and the summed per-unit errors over the calibration
    windows, from which each (width set, budget) choice is made once."""

    def __init__(self, model, preps: list[Prepared], layers: list[int], C: int, G: int):
        H, D = kv_geometry(model.config)
        blocks = model.get_decoder().layers
        self.layers, self.C, self.G, self.preps = layers, C, G, preps
        self.wq = {i: query_weights([p.queries[i] for p in preps], H) for i in layers}
        self.wo = {i: output_weights(blocks[i].self_attn.o_proj.weight, H, D) for i in layers}
        self._errors: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._choices: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def errors(self, layer: int, widths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, widths)
        if key not in self._errors:
            parts = [
                distortions(*context(p, layer), self.wq[layer], self.wo[layer], widths, self.C, self.G)
                for p in self.preps
            ]
            self._errors[key] = (sum(k for k, _ in parts), sum(v for _, v in parts))
        return self._errors[key]

    def choice(self, layer: int, widths: tuple[int, ...], kb: float, vb: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value width choices of ``layer`` (made once, then reused for every window)."""
        key = (layer, widths, kb, vb)
        if key not in self._choices:
            kd, vd = self.errors(layer, widths)
            self._choices[key] = (allocate(kd, widths, kb), allocate(vd, widths, vb))
        return self._choices[key]


def rotated_quantizer(model, rotation: str | None, C: int, G: int) -> FakeQuantizer | None:
    """The package's own ``rotation`` round trip at fp16 parameters, for the uniform rows beside (``None``: none)."""
    if rotation is None:
        return None
    H, D = kv_geometry(model.config)
    cfg = CocktailConfig(rotation=rotation, scale_bits=16, chunk_size=C, group_size=G, scale_dtype="float16")
    return FakeQuantizer(cfg, H, D, model.dtype)


def context(prep: Prepared, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s context keys and values ``(H_kv, N, D)`` of the FP16 prefill, fp32."""
    s, e = prep.span
    src = prep.prefill.layers[layer]
    return src.keys[0, :, s:e].float(), src.values[0, :, s:e].float()


def setting_name(widths: tuple[int, ...] | None, kb: float, vb: float) -> str:
    return f"uniform K{kb:g}/V{vb:g}" if widths is None else f"widths {''.join(map(str, widths))} K{kb:g}/V{vb:g}"


def measure_window(model, prep: Prepared, calib: Calibration, args, rotated: FakeQuantizer | None = None) -> dict:
    """One record: every uniform and allocated setting's KLD, top-1 and mean code widths on ``prep``; ``rotated``
    (:func:`rotated_quantizer`) adds the uniform widths in the package's rotated storage."""
    C, G = args.chunk_size, args.group_size
    ctx = {i: context(prep, i) for i in calib.layers}
    rows = []
    for kb, vb in args.uniform:
        contexts = {
            i: {"k": keys_round_trip(k, int(kb), C), "v": values_round_trip(v, int(vb), G)} for i, (k, v) in ctx.items()
        }
        kl = continuation_kl(model, prep, replaced_cache(model, prep, contexts))
        rows.append({"setting": setting_name(None, kb, vb), "key_bits": kb, "value_bits": vb, **kl})
        if rotated is not None:
            contexts = {
                i: {"k": rotated.keys(k, int(kb)), "v": rotated.values(v, int(vb))} for i, (k, v) in ctx.items()
            }
            kl = continuation_kl(model, prep, replaced_cache(model, prep, contexts))
            name = f"uniform {args.rotation} K{kb:g}/V{vb:g}"
            rows.append({"setting": name, "key_bits": kb, "value_bits": vb, **kl})
    for widths in args.width_sets:
        for kb, vb in args.budgets:
            contexts, kw, vw = {}, [], []
            for i, (k, v) in ctx.items():
                kc, vc = calib.choice(i, widths, kb, vb)
                k_hat, v_hat = mixed_round_trip(k, v, kc, vc, widths, C, G)
                contexts[i] = {"k": k_hat, "v": v_hat}
                kw.append(mean_width(kc, widths))
                vw.append(mean_width(vc, widths))
            kl = continuation_kl(model, prep, replaced_cache(model, prep, contexts))
            name = setting_name(widths, kb, vb)
            rows.append({"setting": name, "key_bits": statistics.fmean(kw), "value_bits": statistics.fmean(vw), **kl})
    return {"window": prep.window.name, "settings": rows}


def histograms(calib: Calibration, args) -> dict:
    """Per setting and layer: how many key channels / value groups got each width."""
    out: dict = {}
    for widths in args.width_sets:
        for kb, vb in args.budgets:
            per_layer = {}
            for i in calib.layers:
                kc, vc = calib.choice(i, widths, kb, vb)
                per_layer[str(i)] = {
                    "keys": {str(widths[j]): n for j, n in sorted(Counter(kc.tolist()).items())},
                    "values": {str(widths[j]): n for j, n in sorted(Counter(vc.tolist()).items())},
                }
            out[setting_name(widths, kb, vb)] = per_layer
    return out


def aggregate(records: list[dict]) -> list[dict]:
    """Mean KLD, top-1 and code widths per setting over the windows, with bits per element, and the paired
    difference from :data:`REFERENCE` (mean, 95% bootstrap interval over the windows, windows lower)."""
    by: dict[str, dict[str, dict]] = {}
    for rec in records:
        for s in rec["settings"]:
            by.setdefault(s["setting"], {})[rec["window"]] = s
    ref = by.get(REFERENCE, {})
    rows = []
    for name, per_window in by.items():
        ss = list(per_window.values())
        code = (statistics.fmean(s["key_bits"] for s in ss) + statistics.fmean(s["value_bits"] for s in ss)) / 2
        diffs = [s["kld"] - ref[w]["kld"] for w, s in per_window.items() if w in ref]
        mean, lo, hi = bootstrap_mean({"windows": diffs})
        rows.append(
            {
                "setting": name,
                "windows": len(ss),
                "code_bits": code,
                "bits_per_element": code + PARAM_BITS,
                "bits_per_element_params8": code + PARAM_BITS_8,
                "kld": statistics.fmean(s["kld"] for s in ss),
                "top1": statistics.fmean(s["top1"] for s in ss),
                "vs_reference": {"mean": mean, "lo": lo, "hi": hi, "lower": sum(d < 0 for d in diffs), "n": len(diffs)},
            }
        )
    return sorted(rows, key=lambda r: (r["code_bits"], r["kld"]))


def paired_cell(row: dict) -> str:
    """``"+0.00012 [+0.00003, +0.00020], 2/12 lower"``, or ``"-"`` for the reference itself or without one."""
    d = row["vs_reference"]
    if row["setting"] == REFERENCE or d["mean"] is None:
        return "-"
    return f"{d['mean']:+.5f} [{d['lo']:+.5f}, {d['hi']:+.5f}], {d['lower']}/{d['n']} lower"


def write_summary(model_dir: str, model: str, meta: dict, rows: list[dict], runs: list[dict]) -> None:
    ref = next((r for r in rows if r["setting"] == REFERENCE), None)
    lines = [
        f"# {model}: code widths by importance (fake quantization)",
        "",
        f"Generated by `python -m {MODULE}` (`eval/formats/widths.py` says what is chosen). Calibration (weights and "
        f"per-unit errors): {', '.join(meta['calibration'])}; measured on {len(meta['texts'])} held-out windows "
        f"({', '.join(meta['texts'])}), 2K tokens, FP16's 32-token continuation teacher-forced; quantized layers "
        f"{meta['layers']}; C={meta['chunk_size']}, G={meta['group_size']}; fp16 scales/zeros (bits/element = code "
        f"bits + {PARAM_BITS}; the package's 8-bit parameters would make it + {PARAM_BITS_8}: the last column).",
        "",
        "Measured by:",
        "",
        *(f"- `{r['command']}` (commit {r['commit']}, {r['runtime_s']} s)" for r in runs),
        "",
        "![KLD vs code bits](widths.png)",
        "",
        "| setting | code bits (mean K, V) | bits/element | mean KLD | / "
        + REFERENCE
        + " | minus "
        + REFERENCE
        + ", paired [95% CI] | top-1 | bits/element, 8-bit params | x FP16, 8-bit params |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = f"{r['kld'] / ref['kld']:.2f}" if ref and ref["kld"] > 0 else "-"
        lines.append(
            f"| {r['setting']} | {r['code_bits']:.3f} | {r['bits_per_element']:.3f} | {r['kld']:.5f} | {rel} | "
            f"{paired_cell(r)} | {r['top1']:.3f} | {r['bits_per_element_params8']:.3f} | "
            f"{r['bits_per_element_params8'] / 16:.3f} |"
        )
    with open(os.path.join(model_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def plot(model_dir: str, model: str, rows: list[dict]) -> None:
    """KLD (log) against mean code bits: uniform widths and each width set's choices, one line each."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["setting"].rsplit(" ", 1)[0], []).append(r)
    for label, rs in groups.items():
        pts = sorted((r["code_bits"], r["kld"]) for r in rs)
        ax.plot(*zip(*pts), marker="o", label=label, ls="--" if label.startswith("uniform") else "-")
    ax.set_yscale("log")
    ax.set_xlabel("mean code bits per element (keys and values; + 0.5 with 8-bit params)")
    ax.set_ylabel("mean KL(P_fp16 || P) (nats)")
    ax.set_title(f"{model}: code widths by importance vs one width")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(model_dir, "widths.png"), dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, with ``width_sets``, ``budgets`` and ``uniform`` parsed into tuples."""
    args = _parser().parse_args(argv)
    args.width_sets = _width_sets(args.width_sets)
    args.budgets = _pairs(args.budgets, "--budgets")
    args.uniform = _pairs(args.uniform, "--uniform")
    if bad := [s for s in args.width_sets if s[-1] > MAX_WIDTH]:
        raise UsageError(f"--width-sets: widths must be in 0..{MAX_WIDTH}, got {bad}")
    if bad := [kv for kv in args.uniform if any(b not in SUPPORTED_BITS for b in kv)]:
        raise UsageError(f"--uniform: widths must be of {SUPPORTED_BITS}, got {bad}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    name = canonical_name(args.model) or args.model
    set_threads(threads=args.threads)
    start = time.time()
    model, tok = load(args.model)
    layers = cocktail_layer_indices(model.config)
    calib_wins = windows(tok, args.calib_texts or card_texts(name), args.n_calib)
    held = windows(tok, held_out_texts(), args.n_texts)
    preps = [prepare(model, tok, w) for w in calib_wins]
    calib = Calibration(model, preps, layers, args.chunk_size, args.group_size)
    rotated = rotated_quantizer(model, args.rotation, args.chunk_size, args.group_size)
    model_dir = os.path.join(args.out_dir, name)
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "records.jsonl")
    if os.path.isfile(path):
        os.remove(path)  # one run per folder: the choice depends on every argument
    meta = {
        "model": name,
        "calibration": [w.name for w in calib_wins],
        "texts": [w.name for w in held],
        "layers": layers,
        "chunk_size": args.chunk_size,
        "group_size": args.group_size,
        "width_sets": args.width_sets,
        "budgets": args.budgets,
        "histograms": histograms(calib, args),
    }
    write_json(os.path.join(model_dir, "settings.json"), meta)
    for w in tqdm(held, desc=f"{name} windows"):
        append_jsonl(path, measure_window(model, prepare(model, tok, w), calib, args, rotated))
    runs_path = os.path.join(model_dir, "runs.jsonl")
    if os.path.isfile(runs_path):
        os.remove(runs_path)
    run = {
        "command": command_line(MODULE),
        "commit": git_commit(model_dir),
        "runtime_s": round(time.time() - start, 1),
        "hardware": hardware_info(),
    }
    append_jsonl(runs_path, run)
    rows = aggregate(list(iter_jsonl(path)))
    write_summary(model_dir, name, meta, rows, [run])
    plot(model_dir, name, rows)
    print(f"wrote {os.path.join(model_dir, 'summary.md')}")
    return 0


if __name__ == "__main__":
    from ..cli import run_cli

    run_cli(main)
