"""LongBench v1 evaluation of KV-cache methods side by side (official ``pred.py`` / ``eval.py`` protocol).

Per example: the task's prompt template is filled, the tokenized prompt is truncated in the middle to ``--window``
tokens, the chat template is applied (except for trec, triviaqa, samsum, lsht, lcc, repobench-p), the whole prompt is
prefilled ONCE into a full-precision ``DynamicCache`` and that prefill is branched into every method's cache (see
``eval/methods/branching.py``); the first new token is the argmax of the shared prefill's last logits (as in a plain
``generate``: every cache attends at full precision during its own prefill) and each method's cache decodes the rest
greedily, up to the task's ``dataset2maxlen`` new tokens (samsum also stops at a newline, as the official code does).

Commands, outputs and how to read them: eval/README.md.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from tqdm.auto import tqdm

from hf_cocktail import offline_encoder_path

from ..cli import UsageError
from ..methods.registry import add_method_args, methods_from_args
from ..models import load_model_and_tokenizer, set_threads
from ..paths import LONGBENCH_DIR
from ..records import check_settings, lock_out_dir
from ..run_info import Invocation, run_config
from ..runner import CaseRunner
from ..script_args import check_script_args, run_settings, script_parser
from .data import example_ids, load_config, load_task_rows
from .metrics import ENGLISH_TASKS, metric_for
from .predictions import append_part, prediction_record, read_records
from .processes import my_share, process_state
from .prompts import build_prompt
from .report import write_reports
from .scoring import score_run

MODULE = "eval.longbench"
DEFAULT_METHODS = "fp16,cocktail,int4,int2,kivi2,nosearch,hqq2"
SETTINGS_KEYS = ("model", "dtype", "window", "encoder", "max_new_tokens_cap")  # must match to resume


def parse_task_ints(spec: str | None, name: str) -> dict[str, int]:
    """``TASK=N,TASK=N`` (``--task-limits``, ``--max-new-tokens-cap``)."""
    out: dict[str, int] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise UsageError(f"{name}: expected TASK=N items, got {item!r}")
        t, v = item.split("=", 1)
        t = t.strip()
        if t not in ENGLISH_TASKS:
            raise UsageError(f"{name}: unknown task {t!r}; known: {ENGLISH_TASKS}")
        try:
            out[t] = int(v)
        except ValueError as e:
            raise UsageError(f"{name}: {item!r}: N must be an integer") from e
        if out[t] < 1:
            raise UsageError(f"{name}: {item!r}: N must be >= 1")
    return out


def _parser() -> argparse.ArgumentParser:
    p = script_parser(MODULE, __doc__.split("\n\n")[0])
    p.add_argument(
        "--data-dir",
        default=os.path.join(LONGBENCH_DIR, "minilongbench"),
        help="folder of <task>.jsonl files in the LongBench schema",
    )
    p.add_argument(
        "--config-dir",
        default=os.path.join(LONGBENCH_DIR, "config"),
        help="folder with dataset2prompt.json and dataset2maxlen.json",
    )
    p.add_argument("--tasks", default=",".join(ENGLISH_TASKS), help="comma-separated LongBench tasks")
    p.add_argument("--window", type=int, default=2048, help="max prompt tokens (middle truncation)")
    p.add_argument("--limit", type=int, default=None, help="max examples per task (the first ones of each file)")
    p.add_argument("--task-limits", default=None, help="per-task caps, e.g. 'multi_news=3,qmsum=3'")
    p.add_argument(
        "--max-new-tokens-cap",
        default=None,
        help="per-task caps on the new tokens below dataset2maxlen, e.g. 'gov_report=128'",
    )
    add_method_args(p, DEFAULT_METHODS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    check_script_args(args, window=64, limit=1)
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.task_list:
        raise UsageError("--tasks is empty")
    for t in args.task_list:
        try:
            metric_for(t)
        except ValueError as e:
            raise UsageError(str(e)) from e
    args.method_list = methods_from_args(args)
    args.task_limit_map = parse_task_ints(args.task_limits, "--task-limits")
    args.new_cap_map = parse_task_ints(args.max_new_tokens_cap, "--max-new-tokens-cap")
    if not os.path.isdir(args.data_dir):
        raise UsageError(f"--data-dir {args.data_dir} does not exist (the offline data lives in ../shared/data)")
    return args


@dataclass
class RunData:
    """The examples of the run and, per task, its template, example ids and new-token budget."""

    rows: dict[str, list[dict]]
    ids: dict[str, list[str]]
    templates: dict[str, str]
    max_new: dict[str, int]


def load_run_data(args) -> RunData:
    d2p, d2m = load_config(args.config_dir)
    for t in args.task_list:
        if t not in d2p or t not in d2m:
            raise UsageError(f"task {t!r} has no prompt/maxlen in {args.config_dir}")
    rows, ids = {}, {}
    for t in args.task_list:
        cap = args.task_limit_map.get(t, args.limit)
        task_rows = load_task_rows(t, args.data_dir)
        rows[t] = task_rows[:cap] if cap else task_rows
        ids[t] = example_ids(rows[t])
    max_new = {t: min(d2m[t], args.new_cap_map.get(t, d2m[t])) for t in args.task_list}
    return RunData(rows, ids, {t: d2p[t] for t in args.task_list}, max_new)


def pending_work(out_dir: str, tasks: list[str], methods, ids: dict[str, list[str]]) -> list[tuple]:
    """``(task, example index, methods missing)`` for every example some method has not finished."""
    done = {(t, m.name): set(read_records(out_dir, t, m.name)) for t in tasks for m in methods}
    work = []
    for t in tasks:
        for i, x in enumerate(ids[t]):
            missing = [m for m in methods if x not in done[(t, m.name)]]
            if missing:
                work.append((t, i, missing))
    return work


def run_share(args, process: int, share: list, data: RunData, encoder: str) -> None:
    """Evaluate this process's share of the pending work, appending a record per (example, method)."""
    model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", args.device_map)
    runner = CaseRunner(model, tok, encoder)
    newline_id = tok.encode("\n", add_special_tokens=False)[-1]
    runner.warm_up([m for m in args.method_list if any(m in miss for _, _, miss in share)])
    bar = tqdm(share, desc=f"longbench[{process}]", position=process, disable=args.no_progress, dynamic_ncols=True)
    for t, i, missing in bar:
        ex, ex_id = data.rows[t][i], data.ids[t][i]
        bar.set_postfix_str(f"{t} {i + 1}/{len(data.rows[t])}")
        info = build_prompt(tok, t, ex, data.templates[t], args.window)
        stop = runner.eos + [newline_id] if t == "samsum" else runner.eos
        for out in runner.run(
            info.request(ex_id), missing, data.max_new[t], stop, min_new_tokens=1 if t == "samsum" else 0
        ):
            append_part(args.out_dir, prediction_record(t, ex, ex_id, info, out, process), process)
    bar.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Invocation(args.out_dir, MODULE)
    state = process_state()
    set_threads(state.num_processes, args.threads)
    encoder = args.encoder or offline_encoder_path()
    data = load_run_data(args)
    settings = run_settings(args, SETTINGS_KEYS, encoder, max_new_tokens_cap=args.new_cap_map)
    os.makedirs(args.out_dir, exist_ok=True)
    if state.is_main_process:
        lock = lock_out_dir(args.out_dir)  # noqa: F841 (held until the process exits)
        check_settings(args.out_dir, settings, SETTINGS_KEYS)
        run.running(num_processes=state.num_processes)
    state.wait_for_everyone()
    if not state.is_main_process:
        check_settings(args.out_dir, settings, SETTINGS_KEYS)
    work = pending_work(args.out_dir, args.task_list, args.method_list, data.ids)
    share = my_share(work, state)
    state.wait_for_everyone()  # every process has read the finished records before any writes new ones
    if share:
        run_share(args, state.process_index, share, data, encoder)
    state.wait_for_everyone()
    if state.is_main_process:
        methods = [m.name for m in args.method_list]
        write_reports(args.out_dir, args.task_list, methods, score_run(args.out_dir, args.task_list, methods, data.ids))
        config = run_config(args, args.method_list, encoder, max_new_tokens=data.max_new)
        run.finished("examples", len(work), len(work), config)
        if not args.no_progress:
            with open(os.path.join(args.out_dir, "summary.md"), encoding="utf-8") as f:
                print(f.read())
    state.wait_for_everyone()
    return 0
