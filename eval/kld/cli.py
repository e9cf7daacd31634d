"""KL divergence from FP16 per KV-cache method, teacher-forced on FP16's own greedy answer (and the last prompt
tokens), over LongBench examples and needle prompts.

A quality metric that tells quantizers apart where task scores on a 135M model are mostly noise: per example, the
prompt is prefilled once at full precision and branched into every method's cache (as ``eval.longbench`` does),
FP16's greedy answer is fed through each cache, and each position's next-token distribution is compared with FP16's:
mean KL(P_fp16 || P_method), top-1 agreement, and the KV bytes ratio (see ``eval/kld/measure.py`` for the two
segments, ``answer`` and ``tail``).

Commands, outputs and how to read them: eval/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from tqdm.auto import tqdm

from hf_cocktail import offline_encoder_path

from ..cli import UsageError
from ..longbench.metrics import ENGLISH_TASKS
from ..methods.registry import add_method_args, methods_from_args
from ..models import load_model_and_tokenizer, load_tokenizer, set_threads
from ..paths import ESSAY_DIR, LONGBENCH_DIR
from ..records import (
    append_jsonl,
    check_settings,
    left_out_note,
    lock_out_dir,
    measure_pending,
    pending,
    read_done,
    reported,
)
from ..run_info import Invocation, run_config
from ..script_args import add_resume_args, check_script_args, needle_grid, run_settings, script_parser
from .cases import KldCase, longbench_cases, needle_cases
from .measure import KldRunner
from .report import write_reports
from .workers import run_parallel

MODULE = "eval.kld"
DEFAULT_METHODS = "fp16,cocktail,int4,int2,int4_had,int2_had,int4v3_had_g64,recommended,kivi2,hqq2,hqq4"
# must match to resume: they change what a finished record means
SETTINGS_KEYS = (
    "model",
    "dtype",
    "window",
    "encoder",
    "max_answer_tokens",
    "tail_tokens",
    "seed",
)


def _parser() -> argparse.ArgumentParser:
    p = script_parser(MODULE, __doc__.split("\n\n")[0])
    add_resume_args(p, "case")
    add_method_args(p, DEFAULT_METHODS)
    p.add_argument(
        "--tasks",
        default=",".join(ENGLISH_TASKS),
        help="comma-separated LongBench tasks, or 'none' for needle prompts only",
    )
    p.add_argument(
        "--per-task",
        type=int,
        default=None,
        help="LongBench examples per task, drawn with --seed (default: every example)",
    )
    p.add_argument("--window", type=int, default=2048, help="max LongBench prompt tokens (middle truncation)")
    p.add_argument("--data-dir", default=os.path.join(LONGBENCH_DIR, "minilongbench"))
    p.add_argument("--config-dir", default=os.path.join(LONGBENCH_DIR, "config"))
    p.add_argument("--needle-lengths", default=None, help="needle haystack lengths in tokens (default: no needle)")
    p.add_argument("--needle-depths", default="0.1,0.4,0.6,0.9", help="needle depths in [0, 1]")
    p.add_argument("--needle-samples", type=int, default=1, help="needle cases per (length, depth)")
    p.add_argument("--essay-dir", default=ESSAY_DIR)
    p.add_argument("--seed", type=int, default=0, help="seeds the LongBench subset and the needle passcodes")
    p.add_argument("--max-answer-tokens", type=int, default=32, help="cap on FP16's greedy answer")
    p.add_argument(
        "--tail-tokens",
        type=int,
        default=16,
        help="last prompt tokens fed through each cache in the 'tail' segment (never inside the context)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes (cases dealt round-robin; the main process writes every file)",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    args.method_list = methods_from_args(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    args.task_list = [] if tasks == ["none"] else tasks
    bad = [t for t in args.task_list if t not in ENGLISH_TASKS]
    if bad:
        raise UsageError(f"--tasks: unknown or unsupported task(s) {bad}; known: {ENGLISH_TASKS} (or 'none')")
    check_script_args(args, per_task=1, window=64, needle_samples=1, tail_tokens=0, workers=1)
    names = ("--needle-lengths", "--needle-depths")
    args.length_list, args.depth_list = needle_grid(args.needle_lengths, args.needle_depths, names)
    if not args.task_list and not args.length_list:
        raise UsageError("nothing to run: --tasks none and no --needle-lengths")
    if args.max_answer_tokens < 2:
        raise UsageError(
            f"--max-answer-tokens must be >= 2 (the first answer token is not scored), got {args.max_answer_tokens}"
        )
    if args.task_list and not os.path.isdir(args.data_dir):
        raise UsageError(f"--data-dir {args.data_dir} does not exist (the offline data lives in ../shared/data)")
    return args


def build_cases(args, tok) -> list[KldCase]:
    """Needle prompts first (few and short), then the LongBench examples interleaved across tasks."""
    cases = needle_cases(tok, args.length_list, args.depth_list, args.needle_samples, args.seed, args.essay_dir)
    if args.task_list:
        cases += longbench_cases(
            tok,
            args.task_list,
            args.data_dir,
            args.config_dir,
            args.window,
            args.per_task,
            args.seed,
        )
    return cases


def worker_setup(argv: list[str], encoder: str) -> tuple[KldRunner, dict[str, KldCase]]:
    """What one worker process of ``--workers`` measures with: its runner and the run's cases by key."""
    args = parse_args(argv)
    set_threads(1, args.threads)
    model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", args.device_map)
    runner = KldRunner(model, tok, encoder, args.max_answer_tokens, args.tail_tokens)
    return runner, {c.key: c for c in build_cases(args, tok)}


def describe(args, cases: list[KldCase]) -> str:
    lb = [c for c in cases if c.source == "longbench"]
    nd = [c for c in cases if c.source == "needle"]
    parts = []
    if lb:
        per = "every example" if args.per_task is None else f"{args.per_task} per task drawn with seed {args.seed}"
        parts.append(f"LongBench: {len(lb)} examples of {len(args.task_list)} tasks ({per}), window {args.window}")
    if nd:
        parts.append(
            f"needle: {len(nd)} prompts (lengths {args.length_list}, depths {args.depth_list}, "
            f"{args.needle_samples} sample(s))"
        )
    return (
        f"# KL divergence from FP16 ({args.model}, {args.dtype})\n\n"
        + "; ".join(parts)
        + f". FP16 answer capped at {args.max_answer_tokens} tokens; tail segment: last {args.tail_tokens} prompt "
        "tokens at most."
    )


def run_cases(
    args, argv: list[str], model, tok, encoder: str, todo: list, rec_path: str, done: dict, deadline: float | None
) -> int:
    """Measure the pending cases in order (in ``--workers`` processes), appending a record per (case, method); no
    new case starts after ``--stop-after-minutes``. Returns the number of cases finished."""
    with tqdm(todo, desc="kld", disable=args.no_progress, dynamic_ncols=True) as bar:
        if args.workers == 1:
            runner = KldRunner(model, tok, encoder, args.max_answer_tokens, args.tail_tokens)
            return measure_pending(bar, runner.run, rec_path, done, deadline=deadline)

        def on_record(rec: dict) -> None:
            append_jsonl(rec_path, rec)
            done[(rec["case"], rec["method"])] = rec

        return run_parallel(args.workers, worker_setup, argv, encoder, todo, deadline, on_record, bar.update)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = Invocation(args.out_dir, MODULE)
    set_threads(args.workers, args.threads)
    encoder = args.encoder or offline_encoder_path()
    check_settings(args.out_dir, run_settings(args, SETTINGS_KEYS, encoder), SETTINGS_KEYS)
    lock = lock_out_dir(args.out_dir)  # noqa: F841 (held until the process exits)
    rec_path = os.path.join(args.out_dir, "records.jsonl")
    done = read_done(rec_path)
    if args.workers == 1 and not args.report_only:
        model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", args.device_map)
    else:  # the workers load the model; here the tokenizer builds the cases
        model, tok = None, load_tokenizer(args.model)
    cases = build_cases(args, tok)
    todo = pending(cases, args.method_list, done, lambda c: c.key)
    ran = 0
    if not args.report_only:
        run.running()
        ran = run_cases(args, argv, model, tok, encoder, todo, rec_path, done, run.deadline(args.stop_after_minutes))
    names = [m.name for m in args.method_list]
    print(write_reports(args.out_dir, reported(done, [c.key for c in cases], names), names, describe(args, cases)))
    if note := left_out_note(done, names):
        print(note)
    if not args.report_only:
        run.finished("cases", ran, len(todo), run_config(args, args.method_list, encoder))
    return 0
