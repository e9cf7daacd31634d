"""Result files of a resumable run: JSON and JSON-lines writing/reading that survives a kill, the settings a folder
was made with, and the lock that keeps a second run out of it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator

from .cli import UsageError


def write_json(path: str, obj) -> None:
    """Write ``obj`` as indented JSON, atomically (a temporary file renamed over ``path``)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def append_jsonl(path: str, record: dict) -> None:
    """Append one JSON line to ``path``. A last line cut by a kill (no trailing newline) is closed first, so the new
    record starts on its own line and stays readable (the cut line is skipped by :func:`iter_jsonl`)."""
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


def iter_jsonl(path: str) -> Iterator[dict]:
    """The records of a JSON-lines file written by :func:`append_jsonl`; blank lines and a line cut by a kill are
    skipped (that record is redone by the resume)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_done(path: str, key: str = "case") -> dict[tuple[str, str], dict]:
    """The finished records of ``path`` (none when it does not exist yet) by ``(record[key], record["method"])``."""
    return {(r[key], r["method"]): r for r in iter_jsonl(path)} if os.path.isfile(path) else {}


def pending(cases: Iterable, methods: list, done: dict, key_of: Callable) -> list[tuple]:
    """``(case, the methods without a record of it)`` for every case some method has not finished (``done``: by
    ``(key_of(case), method name)``)."""
    todo = [(c, [m for m in methods if (key_of(c), m.name) not in done]) for c in cases]
    return [(c, ms) for c, ms in todo if ms]


def measure_pending(
    todo: Iterable[tuple], measure: Callable, path: str, done: dict, key: str = "case", deadline: float | None = None
) -> int:
    """Measure the cases of ``todo`` (:func:`pending`) in order, ``measure(case, methods)`` yielding their records,
    each appended to ``path`` and put in ``done`` as it comes; no case starts after ``deadline`` (a ``time.time()``,
    ``--stop-after-minutes``). Returns the number of cases finished."""
    ran = 0
    for case, methods in todo:
        if deadline is not None and time.time() >= deadline:
            break
        for rec in measure(case, methods):
            append_jsonl(path, rec)
            done[(rec[key], rec["method"])] = rec
        ran += 1
    return ran


def reported(done: dict, keys: Iterable[str], names: list[str]) -> list[dict]:
    """The records of ``done`` (in the order they were written) for the case keys ``keys`` and the methods ``names``:
    what a run's reports cover."""
    keys = set(keys)
    return [r for (k, m), r in done.items() if k in keys and m in names]


def check_settings(out_dir: str, settings: dict, keys) -> None:
    """Refuse to resume into ``out_dir`` with other ``settings`` (compared on ``keys``): its finished records would be
    reused as they are. The old settings are ``out_dir/settings.json``, written by the first run."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "settings.json")
    old = None
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    if old is not None:
        diff = {k: (old.get(k), settings.get(k)) for k in keys if old.get(k) != settings.get(k)}
        if diff:
            raise UsageError(
                f"{out_dir} holds results made with other settings {diff} (old, new); use another "
                "--out-dir or the same settings to resume"
            )
    if not os.path.isfile(path):
        write_json(path, settings)


def lock_out_dir(out_dir: str):
    """An exclusive lock on ``out_dir/.lock`` for this run (released when the returned file is closed or the process
    exits): a second run into the same folder would write the same records. POSIX only; elsewhere nothing is
    locked (returns None)."""
    try:
        import fcntl
    except ImportError:
        return None
    f = open(os.path.join(out_dir, ".lock"), "w")  # noqa: SIM115 (kept open: the lock lives as long as the file)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UsageError(
            f"another run is using --out-dir {out_dir} (it holds {out_dir}/.lock); wait for it to "
            "finish or use another --out-dir"
        ) from None
    return f


def left_out_note(done: Iterable[tuple[str, str]], names: list[str]) -> str | None:
    """A line naming the methods a folder's records hold that a report of ``names`` leaves out (``done``: the
    ``(case, method)`` keys of the records), or None: a run rewrites the reports for its own ``--methods`` only."""
    others = sorted({m for _, m in done} - set(names))
    if not others:
        return None
    return (
        f"note: the reports cover --methods only; records.jsonl also holds {others}: to keep them in the reports, "
        "rerun with --report-only and every method in --methods"
    )
