"""Perplexity of real text continued over each method's quantized context, and its KL divergence from FP16.

Per window of WikiText-2 or the Paul Graham essays: the prompt (a context of real text, then the lead: the text just
before the continuation) is prefilled once at full precision and branched into every method's cache; the next
tokens of the text are teacher-forced through each cache (see ``eval/ppl/measure.py``).

Commands, outputs and how to read them: eval/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from tqdm.auto import tqdm

from hf_cocktail import offline_encoder_path

from ..cli import UsageError
from ..methods.registry import add_method_args, methods_from_args
from ..models import load_model_and_tokenizer, load_tokenizer, set_threads
from ..paths import ESSAY_DIR
from ..records import check_settings, lock_out_dir, measure_pending, pending, read_done, reported
from ..run_info import Invocation, run_config
from ..script_args import add_resume_args, check_script_args, run_settings, script_parser
from .measure import PplRunner
from .report import write_reports
from .windows import SOURCES, Window, make_windows, source_text

MODULE = "eval.ppl"
DEFAULT_METHODS = "fp16,int4,int4_had,int2,int2_had,cocktail,recommended"
SETTINGS_KEYS = ("model", "dtype", "context", "lead", "continuation", "encoder")  # must match to resume


def _parser() -> argparse.ArgumentParser:
    p = script_parser(MODULE, __doc__.split("\n\n")[0])
    add_resume_args(p, "window")
    add_method_args(p, DEFAULT_METHODS)
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, from {SOURCES}")
    p.add_argument("--windows", type=int, default=8, help="windows per source (evenly spaced, non-overlapping)")
    p.add_argument("--context", type=int, default=1920, help="context tokens per window (quantized)")
    p.add_argument("--lead", type=int, default=64, help="tokens between the context and the continuation")
    p.add_argument("--continuation", type=int, default=129, help="continuation tokens (the first is not scored)")
    p.add_argument("--essay-dir", default=ESSAY_DIR)
    p.add_argument("--wikitext-file", default=None, help="default: ../shared/data/wikitext2/wiki.test.raw")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    args.method_list = methods_from_args(args)
    args.source_list = [s.strip() for s in args.sources.split(",") if s.strip()]
    bad = [s for s in args.source_list if s not in SOURCES]
    if bad or not args.source_list:
        raise UsageError(f"--sources must be a comma-separated list from {SOURCES}, got {args.sources!r}")
    check_script_args(args, windows=1, context=64, lead=1, continuation=2)
    return args


def build_windows(args, tok) -> list[Window]:
    """The windows of every source, interleaved (the first of each source, then the second...) so that a run
    stopped early still covers every source."""
    per = [
        make_windows(
            tok,
            s,
            source_text(s, args.essay_dir, args.wikitext_file),
            args.context,
            args.lead,
            args.continuation,
            args.windows,
        )
        for s in args.source_list
    ]
    return [ws[j] for j in range(args.windows) for ws in per]


def describe(args) -> str:
    return (
        f"# Perplexity over the quantized context ({args.model}, {args.dtype})\n\n"
        f"{args.windows} windows per source ({', '.join(args.source_list)}): {args.context} context tokens, "
        f"{args.lead} lead tokens, {args.continuation} continuation tokens ({args.continuation - 1} scored)."
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = Invocation(args.out_dir, MODULE)
    set_threads(1, args.threads)
    encoder = args.encoder or offline_encoder_path()
    check_settings(args.out_dir, run_settings(args, SETTINGS_KEYS, encoder), SETTINGS_KEYS)
    lock = lock_out_dir(args.out_dir)  # held until the run ends
    try:
        return _run(args, encoder, run)
    finally:
        if lock is not None:
            lock.close()


def _run(args, encoder: str, run: Invocation) -> int:
    rec_path = os.path.join(args.out_dir, "records.jsonl")
    done = read_done(rec_path, key="window")
    if args.report_only:  # the tokenizer cuts the windows; no model
        model, tok = None, load_tokenizer(args.model)
    else:
        model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", args.device_map)
    windows = build_windows(args, tok)
    todo = pending(windows, args.method_list, done, lambda w: w.key)
    ran = 0
    if not args.report_only:
        run.running()
        bar = tqdm(todo, desc="ppl", disable=args.no_progress, dynamic_ncols=True)
        runner = PplRunner(model, tok, encoder)
        ran = measure_pending(bar, runner.run, rec_path, done, "window", run.deadline(args.stop_after_minutes))
    names = [m.name for m in args.method_list]
    print(write_reports(args.out_dir, reported(done, [w.key for w in windows], names), names, describe(args)))
    if not args.report_only:
        run.finished("windows", ran, len(todo), run_config(args, args.method_list, encoder))
    return 0
