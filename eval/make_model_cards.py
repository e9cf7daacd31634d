"""Regenerate every model card in model_cards/ (and the index model_cards/README.md).

Each preset folder model_cards/<preset>/ holds ``cocktail_config.json`` and ``card_meta.json``::

    {"base_model": "<Hub id>", "license": "apache-2.0", "settings_source": "paper" | "local",
     "notes": ["markdown paragraph", ...],              # "{name_or_path}" is replaced by the load path
     "results": "eval/results/summary.csv",             # optional, relative to the repo root
     "run_info": "eval/results/run_info.json",          # optional: command, commit, runtime_s, hardware
     "measurements": "markdown"}                         # optional: python -m hf_cocktail.calibrate's held-out table

Results and provenance are only ever read from the evaluation's files; without them the card says so.

    python -m eval.make_model_cards                       # rewrite model_cards/*/README.md
    python -m eval.make_model_cards --push-to ORG [--presets smollm2-135m-instruct]
        # push each preset to ORG/cocktail-<preset> (config + card whose snippet loads the repo id)
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

from hf_cocktail.presets.config import CocktailConfig
from hf_cocktail.presets.hub import CONFIG_NAME, README_NAME
from hf_cocktail.presets.model_card import make_model_card, read_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CARDS_DIR = os.path.join(ROOT, "model_cards")
META_NAME = "card_meta.json"
META_KEYS = {"base_model", "license", "settings_source", "notes", "results", "run_info", "measurements"}


def presets(cards_dir: str = CARDS_DIR) -> list[str]:
    """Names of the preset folders (those holding a cocktail_config.json)."""
    return sorted(d for d in os.listdir(cards_dir) if os.path.isfile(os.path.join(cards_dir, d, CONFIG_NAME)))


def load_meta(folder: str) -> dict:
    path = os.path.join(folder, META_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no {META_NAME} (needs at least base_model)")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    unknown = sorted(set(meta) - META_KEYS)
    if unknown or "base_model" not in meta:
        raise ValueError(f"{path}: needs base_model; allowed keys are {sorted(META_KEYS)}, got {sorted(meta)}")
    return meta


def build_card(folder: str, name_or_path: str, root: str = ROOT) -> str:
    """The README.md of preset ``folder``; the usage snippet loads the config from ``name_or_path``."""
    config = CocktailConfig.from_pretrained(folder)
    meta = load_meta(folder)
    res_rel, info_rel, run_info = meta.get("results"), meta.get("run_info"), {}
    has_results = bool(res_rel) and os.path.isfile(os.path.join(root, res_rel))
    results = read_results(os.path.join(root, res_rel)) if has_results else None
    # the results' run, or without results a calibrated preset's own record
    if info_rel and os.path.isfile(os.path.join(root, info_rel)) and (has_results or not res_rel):
        with open(os.path.join(root, info_rel), encoding="utf-8") as f:
            run_info = json.load(f)
    elif has_results:
        warnings.warn(
            f"{res_rel} exists but its run info {info_rel!r} does not: the card says 'not recorded'", stacklevel=2
        )
    notes = meta.get("notes", [])
    notes = [n.replace("{name_or_path}", name_or_path) for n in ([notes] if isinstance(notes, str) else notes)]
    return make_model_card(
        config,
        meta["base_model"],
        results=results,
        hardware=run_info.get("hardware"),
        commit=run_info.get("commit"),
        notes=notes,
        name_or_path=name_or_path,
        license=meta.get("license", "apache-2.0"),
        settings_source=meta.get("settings_source", "local"),
        command=run_info.get("command"),
        runtime_s=run_info.get("runtime_s"),
        results_name=res_rel,
        measurements=meta.get("measurements"),
    )


def index(cards_dir: str = CARDS_DIR) -> str:
    rows = []
    for name in presets(cards_dir):
        folder = os.path.join(cards_dir, name)
        config, meta = CocktailConfig.from_pretrained(folder), load_meta(folder)
        res = meta.get("results")
        status = (
            "measured, see card"
            if res and os.path.isfile(os.path.join(ROOT, res)) or meta.get("measurements")
            else "paper settings, not measured here"
            if meta.get("settings_source") == "paper"
            else "no evaluation results yet"
        )
        rows.append(f"| [{name}]({name}/README.md) | {meta['base_model']} | `{config.encoder}` | {status} |")
    return (
        "# hf-cocktail presets\n\nOne folder per preset: `cocktail_config.json`, its card `README.md` and "
        "`card_meta.json` (input of `python eval/make_model_cards.py`, which writes the cards; do not edit them "
        'by hand). Load one with `CocktailConfig.from_pretrained("model_cards/<preset>")`.\n\n'
        "| preset | base model | encoder | results |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cards-dir", default=CARDS_DIR)
    ap.add_argument("--presets", nargs="*", help="only these presets (default: all)")
    ap.add_argument("--push-to", metavar="NAMESPACE", help="also push each preset to NAMESPACE/cocktail-<preset>")
    ap.add_argument("--private", action="store_true", help="create pushed repos as private")
    args = ap.parse_args(argv)
    names = presets(args.cards_dir)
    unknown = sorted(set(args.presets or []) - set(names))
    if unknown:
        ap.error(f"unknown presets {unknown}; available: {names}")
    for name in args.presets or names:
        folder = os.path.join(args.cards_dir, name)
        rel = os.path.relpath(folder, ROOT).replace(os.sep, "/")
        with open(os.path.join(folder, README_NAME), "w", encoding="utf-8") as f:
            f.write(build_card(folder, rel))
        print(f"wrote {rel}/{README_NAME}")
        if args.push_to:
            repo_id = f"{args.push_to}/cocktail-{name}"
            info = CocktailConfig.from_pretrained(folder).push_to_hub(
                repo_id,
                model_card=build_card(folder, repo_id),
                private=args.private or None,
                commit_message=f"Upload hf-cocktail preset {name}",
            )
            print(f"pushed {rel} -> {getattr(info, 'commit_url', repo_id)}")
    with open(os.path.join(args.cards_dir, README_NAME), "w", encoding="utf-8") as f:
        f.write(index(args.cards_dir))


if __name__ == "__main__":
    main()
