"""The arguments every accuracy script (``eval.kld``, ``eval.needle``, ``eval.ppl``, ``eval.longbench``) takes and
their checks: the results folder, the model, the retrieval encoder, threads, progress bars; for the scripts whose
records a later run resumes, the time limit and ``--report-only``."""

from __future__ import annotations

import argparse

from .cli import UsageError
from .models import DTYPES


def script_parser(module: str, description: str) -> argparse.ArgumentParser:
    """``python -m <module>``'s parser (defaults shown in ``--help``) with ``--out-dir``, ``--model``, ``--dtype``,
    ``--device-map``, ``--encoder``, ``--threads`` and ``--no-progress``."""
    p = argparse.ArgumentParser(
        prog=f"python -m {module}", description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out-dir", required=True, help="results folder (resumable)")
    p.add_argument("--model", default="smollm2", help="an offline model (smollm2, gemma-3-270m) or a Hub id / folder")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--device-map", default=None, help="e.g. 'auto' to spread a big model over the devices")
    p.add_argument("--encoder", default=None, help="retrieval encoder (default: the offline all-MiniLM-L6-v2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores/processes)")
    p.add_argument("--no-progress", action="store_true")
    return p


def add_resume_args(p: argparse.ArgumentParser, unit: str) -> None:
    """``--stop-after-minutes`` (no new ``unit`` starts after it) and ``--report-only``."""
    p.add_argument(
        "--stop-after-minutes",
        type=float,
        default=None,
        help=f"start no new {unit} after this many minutes (the reports cover the finished ones; the same command "
        "resumes)",
    )
    p.add_argument("--report-only", action="store_true", help="rewrite the reports from the records, run nothing")


def check_script_args(args: argparse.Namespace) -> None:
    """Refuse ``--threads`` < 1 and a ``--stop-after-minutes`` that is not positive."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    minutes = getattr(args, "stop_after_minutes", None)
    if minutes is not None and minutes <= 0:
        raise UsageError(f"--stop-after-minutes must be > 0, got {minutes}")
