"""The arguments every accuracy script (``eval.kld``, ``eval.needle``, ``eval.ppl``, ``eval.longbench``) takes and
their checks: the results folder, the model, the retrieval encoder, threads, progress bars; for the scripts whose
records a later run resumes, the time limit and ``--report-only``."""

from __future__ import annotations

import argparse
import os

from .cli import UsageError, parse_float_list, parse_int_list
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


def check_script_args(args: argparse.Namespace, **minimums: int) -> None:
    """Refuse ``--threads`` or an argument of ``minimums`` (``dest=lowest allowed``; an unset optional one is not
    checked) below its minimum, and a ``--stop-after-minutes`` that is not positive."""
    for dest, low in {"threads": 1, **minimums}.items():
        value = getattr(args, dest)
        if value is not None and value < low:
            raise UsageError(f"--{dest.replace('_', '-')} must be >= {low}, got {value}")
    minutes = getattr(args, "stop_after_minutes", None)
    if minutes is not None and minutes <= 0:
        raise UsageError(f"--stop-after-minutes must be > 0, got {minutes}")


def run_settings(args: argparse.Namespace, keys: tuple[str, ...], encoder: str, **values) -> dict:
    """What ``settings.json`` holds of a run (:func:`eval.records.check_settings`): each of ``keys`` from ``values``,
    else the argument of that name; ``encoder``: the retrieval encoder's folder name."""
    named = {"encoder": os.path.basename(os.path.normpath(encoder)), **values}
    return {k: named[k] if k in named else getattr(args, k) for k in keys}


def needle_grid(lengths: str | None, depths: str | None, names: tuple[str, str]) -> tuple[list[int], list[float]]:
    """The haystack lengths (>= 64 tokens) and needle depths (in [0, 1]) of the comma-separated arguments ``names``
    (empty lists for an argument not given)."""
    length_list = parse_int_list(lengths, names[0]) if lengths is not None else []
    depth_list = parse_float_list(depths, names[1]) if depths is not None else []
    if any(x < 64 for x in length_list):
        raise UsageError(f"{names[0]} must be >= 64 tokens, got {length_list}")
    if any(not 0 <= d <= 1 for d in depth_list):
        raise UsageError(f"{names[1]} must lie in [0, 1], got {depth_list}")
    return length_list, depth_list
