"""A format study for the context KV cache, fake quantization only (issue 26): today's min-max codes against keys
quantized before RoPE and dense-and-sparse outliers (KVQuant), at 2, 3 and 4 bits, keys and values separately and
together, scored by the KL divergence from FP16 on held-out ~2K-token windows against honest bits per element.

Usage (see eval/README.md)::

    python -m eval.formats --model gemma-3-270m --out-dir eval/results/formats --threads 1

The windows are Paul Graham essays that no model card's calibration read (``model_cards/*/calibration.json``), cut
as the calibration cuts them (:mod:`hf_cocktail.calibrate.texts`). Outputs under ``--out-dir``: per model,
``<model>/records.jsonl`` (one line per window, resumable) and ``<model>/settings.json``; over all models measured
there, ``results.json``, ``summary.md`` and ``formats_<model>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from tqdm.auto import tqdm

from hf_cocktail import CocktailConfig
from hf_cocktail.calibrate.fake_quant import FakeQuantizer
from hf_cocktail.calibrate.sensitivity import cocktail_layer_indices
from hf_cocktail.calibrate.texts import Window, make_window, read_texts
from hf_cocktail.calibrate.validate import prepare
from hf_cocktail.offline_models import canonical_name, load_offline_model

from ..cli import UsageError, parse_int_list
from ..kv_bytes import kv_geometry
from ..models import load_model_and_tokenizer, set_threads
from ..paths import ESSAY_DIR, REPO_ROOT
from ..records import append_jsonl, check_settings, iter_jsonl, write_json
from ..run_info import command_line, git_commit, hardware_info
from .measure import WindowProbe, measure_window, record_key, settings
from .report import aggregate, model_section, plot
from .variants import FORMATS

MODULE = "eval.formats"
# what a resumed folder must share; the windows and the settings measured may grow (records name both)
SETTINGS_KEYS = ("model", "window", "question_tokens", "continuation_tokens", "config")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "eval", "results", "formats"))
    p.add_argument("--model", default="gemma-3-270m", help="an offline model (gemma-3-270m, smollm2-135m-instruct)")
    p.add_argument("--texts", nargs="*", default=None, help=".txt/.jsonl texts (default: held-out PG essays)")
    p.add_argument("--n-texts", type=int, default=6, help="windows measured (the first texts long enough)")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--continuation-tokens", type=int, default=32)
    p.add_argument("--bits", default="2,3,4", help="code widths, comma-separated")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {list(FORMATS)}")
    p.add_argument(
        "--pairs", default="", help="also keys and values at other widths, 'K:V' comma-separated (e.g. 4:3,4:2)"
    )
    p.add_argument("--config", default='{"scale_bits": 8}', help="CocktailConfig fields (JSON) of today's storage")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report-only", action="store_true", help="rewrite the summary from the records, measure nothing")
    return p


def calibration_texts() -> set[str]:
    """File names of the texts any model card's calibration read (their ``calibration.json`` commands)."""
    names: set[str] = set()
    cards = os.path.join(REPO_ROOT, "model_cards")
    for card in sorted(os.listdir(cards)):
        path = os.path.join(cards, card, "calibration.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                names.update(os.path.basename(t) for t in re.findall(r"\S+\.(?:txt|jsonl)", json.load(f)["command"]))
    return names


def held_out_texts() -> list[str]:
    """The PG essays no calibration read, in file-name order."""
    if not os.path.isdir(ESSAY_DIR):
        raise UsageError(f"Paul Graham essays not found at {ESSAY_DIR} (pass --texts)")
    used = calibration_texts()
    return [os.path.join(ESSAY_DIR, f) for f in sorted(os.listdir(ESSAY_DIR)) if f.endswith(".txt") and f not in used]


def _pair(text: str) -> tuple[int, int]:
    try:
        kb, vb = (int(x) for x in text.split(":"))
    except ValueError as e:
        raise UsageError(f"--pairs: each pair is 'K:V' (key bits:value bits), got {text!r}") from e
    if kb not in (2, 3, 4) or vb not in (2, 3, 4):
        raise UsageError(f"--pairs: widths must be of 2, 3, 4, got {text!r}")
    return kb, vb


def _args(argv) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    args.bits = parse_int_list(args.bits, "--bits")
    if bad := [b for b in args.bits if b not in (2, 3, 4)]:
        raise UsageError(f"--bits must be of 2, 3, 4, got {bad}")
    args.pairs = [_pair(p) for p in args.pairs.split(",") if p.strip()]
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if bad := [f for f in args.formats if f not in FORMATS]:
        raise UsageError(f"--formats must be of {list(FORMATS)}, got {bad}")
    try:
        args.config_dict = json.loads(args.config)
        CocktailConfig(**args.config_dict)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--config: {e}") from e
    args.model_name = canonical_name(args.model) or args.model
    return args


def load(name: str):
    """``(model, tokenizer)``, fp32, in eval mode."""
    if canonical_name(name):
        return load_offline_model(name)
    return load_model_and_tokenizer(name)


def _saved(model_dir: str) -> dict:
    """The folder's ``settings.json`` (``{}`` before the first run)."""
    path = os.path.join(model_dir, "settings.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def run_model(args, model_dir: str) -> None:
    """Measure every window not yet in ``model_dir/records.jsonl``."""
    model, tok = load(args.model)
    cfg = CocktailConfig(**args.config_dict)
    H, D = kv_geometry(model.config)
    layers = cocktail_layer_indices(model.config)
    fq = FakeQuantizer(cfg, H, D, model.dtype)
    texts = read_texts(args.texts or held_out_texts())
    windows: list[Window] = []
    for name, text in texts:
        w = make_window(tok, name, text, args.window, args.question_tokens, args.continuation_tokens)
        if w is not None and len(windows) < args.n_texts:
            windows.append(w)
    meta = {
        "model": args.model_name,
        "texts": [w.name for w in windows],
        "window": args.window,
        "question_tokens": args.question_tokens,
        "continuation_tokens": args.continuation_tokens,
        "config": args.config_dict,
        "layers": layers,
        "num_kv_heads": H,
        "head_dim": D,
        "chunk_size": cfg.chunk_size,
        "group_size": cfg.group_size,
        "scale_bits": cfg.scale_bits,
    }
    check_settings(model_dir, meta, SETTINGS_KEYS)
    meta["texts"] = list(dict.fromkeys([*_saved(model_dir).get("texts", []), *meta["texts"]]))
    write_json(os.path.join(model_dir, "settings.json"), meta)
    path = os.path.join(model_dir, "records.jsonl")
    old = list(iter_jsonl(path)) if os.path.isfile(path) else []
    done = {record_key(r["window"], s) for r in old for s in r["settings"]}
    grid = settings([FORMATS[f] for f in args.formats], args.bits, args.pairs)
    todo = [(w, [st for st in grid if (w.name, *st.key) not in done]) for w in windows]
    todo = [(w, sts) for w, sts in todo if sts]
    with tqdm(total=sum(len(sts) for _, sts in todo), desc=f"{args.model_name} settings") as bar:
        for w, sts in todo:
            probe = WindowProbe(model, prepare(model, tok, w), layers, fq)
            append_jsonl(path, measure_window(probe, sts, bar.update))


def write_report(out_dir: str) -> None:
    """``results.json``, ``summary.md`` and the PNGs from every model folder under ``out_dir``."""
    sections: list[str] = []
    results: dict = {"models": {}}
    for name in sorted(os.listdir(out_dir)):
        records_path = os.path.join(out_dir, name, "records.jsonl")
        if not os.path.isfile(records_path):
            continue
        with open(os.path.join(out_dir, name, "settings.json"), encoding="utf-8") as f:
            meta = json.load(f)
        runs_path = os.path.join(out_dir, name, "runs.jsonl")
        runs = list(iter_jsonl(runs_path)) if os.path.isfile(runs_path) else []
        records = list(iter_jsonl(records_path))
        rows = aggregate(records, meta)
        png = os.path.join(out_dir, f"formats_{name}.png")
        plot(name, rows, png)
        sections += model_section(name, meta, records, rows, png, runs)
        results["models"][name] = {"settings": meta, "runs": runs, "rows": rows}  # records: <model>/records.jsonl
    write_json(os.path.join(out_dir, "results.json"), results)
    head = [
        "# Context KV formats: KLD from FP16 against bits per element (fake quantization)",
        "",
        "Generated by `python -m eval.formats` (the commands under each model); formats in "
        "`eval/formats/variants.py`. KLD: mean KL(P_fp16 || P) over each window's 32 teacher-forced continuation "
        "tokens, averaged over windows; only the context keys/values of the layers a CocktailCache quantizes change. "
        "Bits per element: codes + scales/zeros at their bits + 32 bits per outlier (16-bit value, 16-bit index).",
        "",
    ]
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(head + sections))


def main(argv=None) -> int:
    args = _args(argv)
    set_threads(threads=args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.time()
    if not args.report_only:
        model_dir = os.path.join(args.out_dir, args.model_name)
        run_model(args, model_dir)
        run = {
            "command": command_line(MODULE),
            "commit": git_commit(args.out_dir),
            "runtime_s": round(time.time() - start, 1),
            "hardware": hardware_info(),
        }
        append_jsonl(os.path.join(model_dir, "runs.jsonl"), run)
    write_report(args.out_dir)
    print(f"wrote {os.path.join(args.out_dir, 'summary.md')}")
    return 0
