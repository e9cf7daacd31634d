"""The Paul Graham essays (``../shared/data/paul_graham_essays``): the haystack of the needle test and the context
of the speed benchmarks."""

from __future__ import annotations

import os

from .cli import UsageError
from .paths import ESSAY_DIR


def load_essays(essay_dir: str | None = None) -> list[str]:
    """Every ``.txt`` essay of ``essay_dir``, in file-name order, stripped."""
    essay_dir = essay_dir or ESSAY_DIR
    if not os.path.isdir(essay_dir):
        raise UsageError(
            f"Paul Graham essays not found at {essay_dir} (--essay-dir; the data lives in "
            "../shared/data/paul_graham_essays)"
        )
    files = sorted(f for f in os.listdir(essay_dir) if f.endswith(".txt"))
    if not files:
        raise UsageError(f"no .txt essays in {essay_dir}")
    out = []
    for f in files:
        with open(os.path.join(essay_dir, f), encoding="utf-8") as fh:
            out.append(fh.read().strip())
    return out


def essay_prefix(tok, n_tokens: int, essay_dir: str | None = None) -> str:
    """The first ``n_tokens`` tokens of the essays (joined by blank lines), as text."""
    ids = tok("\n\n".join(load_essays(essay_dir)), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise UsageError(f"the essays have {len(ids)} tokens, fewer than the context {n_tokens}")
    return tok.decode(ids[:n_tokens])
