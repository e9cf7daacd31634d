"""Calibrate ``CocktailConfig.layer_bits`` for a model: measure how much each layer's code widths add to the KL
divergence from FP16, then pick per layer the widths with the least summed divergence at each bit budget.

Usage (see eval/README.md)::

    python -m eval.layers --out-dir eval/results/layer_calibration/round1 --budgets 2.6,2.8,3.0,3.2

The prompts are LongBench examples **not** used by ``eval.kld`` (the example after the first ``--skip`` of each task's
seeded draw), so that the allocation is scored on other prompts than those it was chosen on. Outputs under
``--out-dir``: ``records.jsonl`` (one line per prompt, resumable), ``sensitivity.md`` (the mean deltas per layer),
``sensitivity.png``, ``layer_bits.json`` (per budget: the ``layer_bits`` to pass to ``CocktailConfig``),
``settings.json``, ``run_info.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tqdm.auto import tqdm

from hf_cocktail import CocktailConfig
from hf_cocktail.calibrate.solve import layer_deltas, mean_deltas, solve

from ..cli import UsageError, parse_float_list, parse_int_list
from ..kld.cases import longbench_cases
from ..longbench.metrics import ENGLISH_TASKS
from ..models import DTYPES, eos_token_ids, load_model_and_tokenizer, set_threads
from ..paths import LONGBENCH_DIR
from ..records import append_jsonl, check_settings, iter_jsonl, lock_out_dir
from ..run_info import command_line, git_commit, now, update_run_info
from .measure import measure_case, measured

MODULE = "eval.layers"
SETTINGS_KEYS = (
    "model",
    "dtype",
    "window",
    "skip",
    "per_task",
    "seed",
    "config",
    "base",
    "key_bits",
    "value_bits",
    "max_step",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, help="results folder (resumable)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (offline GGUF wheel) or a Hub id / local folder")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--tasks", default=",".join(ENGLISH_TASKS), help="comma-separated LongBench tasks")
    p.add_argument("--skip", type=int, default=2, help="per task, the first examples of the draw left out (eval.kld's)")
    p.add_argument("--per-task", type=int, default=1, help="calibration prompts per task, after the skipped ones")
    p.add_argument("--seed", type=int, default=0, help="the seeded draw of eval.kld (--seed)")
    p.add_argument("--window", type=int, default=2048, help="max LongBench prompt tokens (middle truncation)")
    p.add_argument("--data-dir", default=os.path.join(LONGBENCH_DIR, "minilongbench"))
    p.add_argument("--config-dir", default=os.path.join(LONGBENCH_DIR, "config"))
    p.add_argument(
        "--config",
        default='{"rotation": "hadamard", "scale_bits": 8, "group_size": 32}',
        help="CocktailConfig fields (JSON) of the storage: rotation, chunk_size, group_size, scale_bits, ...",
    )
    p.add_argument(
        "--base",
        default="4,3",
        help="the base: 'key_bits,value_bits' for every layer, or FILE:BUDGET, the allocation at BUDGET in an earlier "
        "run's layer_bits.json (a second round measured around the first one's choice)",
    )
    p.add_argument("--key-bits", default="3,2", help="key widths measured per layer (values at the base)")
    p.add_argument("--value-bits", default="2,4", help="value widths measured per layer (keys at the base)")
    p.add_argument(
        "--max-step", type=int, default=None, help="measure only widths within this many bits of each layer's base"
    )
    p.add_argument("--budgets", default="2.6,2.8,3.0,3.2", help="mean code bits per K/V element to solve for")
    p.add_argument("--max-answer-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--stop-after-minutes", type=float, default=None, help="start no new prompt after this")
    p.add_argument("--report-only", action="store_true", help="rewrite the reports from the records, run nothing")
    p.add_argument("--no-progress", action="store_true")
    return p


def _upgrade_settings(old: dict) -> dict:
    """A results folder's settings with its storage config read as today's ``CocktailConfig`` reads it (a removed
    field such as ``codebook: "uniform"`` dropped), so that a folder made before a removal still resumes."""
    return {**old, "config": CocktailConfig.from_dict(old["config"]).to_dict()} if "config" in old else old


def parse_args(argv=None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    try:
        args.storage = CocktailConfig.from_dict(json.loads(args.config))
    except (ValueError, TypeError) as e:
        raise UsageError(f"--config {args.config!r}: {e}") from e
    args.base_pairs = _parse_base(args.base)
    args.key_list = parse_int_list(args.key_bits, "--key-bits")
    args.value_list = parse_int_list(args.value_bits, "--value-bits")
    args.budget_list = parse_float_list(args.budgets, "--budgets")
    widths = [w for p in args.base_pairs for w in p] + [*args.key_list, *args.value_list]
    if any(len(p) != 2 or p[1] > p[0] for p in args.base_pairs) or not set(widths) <= {2, 3, 4}:
        raise UsageError(
            f"--base must be 'key_bits,value_bits' (or FILE:BUDGET) with value_bits <= key_bits and every width in "
            f"2, 3, 4; got --base {args.base!r} --key-bits {args.key_bits!r} --value-bits {args.value_bits!r}"
        )
    if args.max_step is not None and args.max_step < 1:
        raise UsageError(f"--max-step must be >= 1, got {args.max_step}")
    if args.skip < 0 or args.per_task < 1:
        raise UsageError(f"--skip must be >= 0 and --per-task >= 1, got {args.skip} and {args.per_task}")
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    return args


def _parse_base(spec: str) -> list[tuple[int, ...]]:
    """``--base``: one pair for every layer, or FILE:BUDGET (the allocation of an earlier run)."""
    if ":" not in spec:
        return [tuple(parse_int_list(spec, "--base"))]
    path, budget = spec.rsplit(":", 1)
    try:
        with open(path, encoding="utf-8") as f:
            allocations = json.load(f)["allocations"]
        return [tuple(p) for p in allocations[budget]["layer_bits"]]
    except (OSError, KeyError, ValueError) as e:
        raise UsageError(f"--base {spec!r}: no allocation {budget!r} readable in {path!r} ({e!r})") from e


def settings_of(args) -> dict:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "window": args.window,
        "skip": args.skip,
        "per_task": args.per_task,
        "seed": args.seed,
        "config": args.storage.to_dict(),
        "base": list(args.base_pairs[0]) if len(args.base_pairs) == 1 else [list(p) for p in args.base_pairs],
        "max_step": args.max_step,
        "key_bits": args.key_list,
        "value_bits": args.value_list,
    }


def calibration_cases(args, tok) -> list:
    """Per task the ``--per-task`` examples after the first ``--skip`` of ``eval.kld``'s seeded draw."""

    def draw(n: int) -> list:
        return longbench_cases(tok, args.task_list, args.data_dir, args.config_dir, args.window, n, args.seed)

    skipped = {c.key for c in draw(args.skip)} if args.skip else set()
    return [c for c in draw(args.skip + args.per_task) if c.key not in skipped]


def allocations(records: list[dict], budgets: list[float], base: list[tuple[int, ...]]) -> dict:
    deltas = layer_deltas(records, base)
    base_kl = statistics.fmean(r["base_kl"] for r in records)
    out = {}
    for budget in budgets:
        picks, total = solve(deltas, budget)
        out[f"{budget:g}"] = {
            "layer_bits": [list(p) for p in picks],
            "mean_code_bits": sum(k + v for k, v in picks) / (2 * len(picks)),
            "estimated_kl": base_kl + total,
        }
    return {"base_kl": base_kl, "prompts": len(records), "allocations": out}


def _base_text(base: list[tuple[int, ...]]) -> str:
    if len(base) == 1:
        return f"every layer at {base[0][0]}-bit keys / {base[0][1]}-bit values"
    return f"per layer `{[list(p) for p in base]}`"


def write_reports(out_dir: str, records: list[dict], args) -> str:
    if not records:
        return "no calibration prompt finished yet"
    solved = allocations(records, args.budget_list, args.base_pairs)
    solved["config"] = args.storage.to_dict()
    with open(os.path.join(out_dir, "layer_bits.json"), "w", encoding="utf-8") as f:
        json.dump(solved, f, indent=1)
    keys, values = mean_deltas(records, "key_deltas"), mean_deltas(records, "value_deltas")
    names = [f"keys {k}" for k in args.key_list] + [f"values {v}" for v in args.value_list]
    measured = [keys[k] for k in args.key_list] + [values[v] for v in args.value_list]  # one list per column
    lines = [
        f"# Per-layer sensitivity ({len(records)} prompts; base: {_base_text(args.base_pairs)}, mean KL "
        f"{solved['base_kl']:.5f})",
        "",
        "Mean KL divergence added when one layer alone takes the column's width (keys with that layer's base values,",
        "values with its base keys), in 1e-4 nats; blank: not measured there.",
        "",
        "| layer | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for layer, row in enumerate(zip(*measured)):
        lines.append(f"| {layer} | " + " | ".join("" if d is None else f"{1e4 * d:+.1f}" for d in row) + " |")
    lines += ["", "| mean code bits | estimated KL | layer_bits |", "| --- | --- | --- |"]
    for budget, a in solved["allocations"].items():
        lines.append(f"| {a['mean_code_bits']:.3f} (<= {budget}) | {a['estimated_kl']:.5f} | `{a['layer_bits']}` |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "sensitivity.md"), "w", encoding="utf-8") as f:
        f.write(text)
    _plot(os.path.join(out_dir, "sensitivity.png"), measured, names)
    return text


def _plot(path: str, measured: list[list[float | None]], names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.8 / len(names)
    for i, (name, deltas) in enumerate(zip(names, measured)):
        xs = [layer + (i - (len(names) - 1) / 2) * width for layer in range(len(deltas))]
        ax.bar(xs, [0.0 if d is None else 1e4 * d for d in deltas], width, label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("KL added (1e-4 nats)")
    ax.set_title("KL divergence from FP16 added by one layer at fewer bits")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    commit, started_at = git_commit(exclude=args.out_dir), now()
    os.makedirs(args.out_dir, exist_ok=True)
    check_settings(args.out_dir, settings_of(args), SETTINGS_KEYS, upgrade=_upgrade_settings)
    lock = lock_out_dir(args.out_dir)  # noqa: F841 (held until the process exits)
    rec_path = os.path.join(args.out_dir, "records.jsonl")
    done = {r["case"]: r for r in iter_jsonl(rec_path)} if os.path.exists(rec_path) else {}
    set_threads(1, args.threads)
    model, tok = load_model_and_tokenizer(args.model, args.dtype)
    cases = calibration_cases(args, tok)
    todo = [c for c in cases if c.key not in done] if not args.report_only else []
    if todo:
        update_run_info(
            args.out_dir, started_at, {"command": command_line(MODULE), "commit": commit, "status": "running"}
        )
    L = model.config.get_text_config(decoder=True).num_hidden_layers
    base = args.base_pairs * L if len(args.base_pairs) == 1 else args.base_pairs
    per_case = 1 + sum(
        sum(measured(base, side, w, args.max_step))
        for side, widths in ((0, args.key_list), (1, args.value_list))
        for w in widths
    )
    bar = tqdm(total=len(todo) * per_case, desc="layers", disable=args.no_progress, dynamic_ncols=True)
    ran = 0
    for case in todo:
        if args.stop_after_minutes and time.time() - t_start > 60 * args.stop_after_minutes:
            break
        rec = measure_case(
            model,
            tok,
            case,
            args.storage,
            args.base_pairs,
            args.key_list,
            args.value_list,
            args.max_answer_tokens,
            eos_token_ids(model, tok),
            bar.update,
            args.max_step,
        )
        append_jsonl(rec_path, rec)
        done[case.key] = rec
        ran += 1
    bar.close()
    keys = {c.key for c in cases}
    print(write_reports(args.out_dir, [r for k, r in done.items() if k in keys], args))
    if todo:
        status = {"runtime_s": round(time.time() - t_start, 1), "cases_processed": ran, "finished_at": now()}
        status["status"] = "finished" if ran == len(todo) else "stopped"
        update_run_info(args.out_dir, started_at, status, settings_of(args))
    return 0
