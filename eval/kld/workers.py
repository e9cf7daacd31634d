"""Several worker processes for one KLD run (``--workers N``): on a small shared CPU, N processes of one thread each
use N cores without the OpenMP oversubscription of one process with N threads.

The main process keeps every file of the run (the lock, ``records.jsonl``, ``run_info.json``): the workers (started
with ``spawn``, each loading the model once) take the pending cases round-robin and send their records back through
a queue, in which the main process writes them as they come.
"""

from __future__ import annotations

import queue as queue_mod
import time
import traceback
from collections.abc import Callable


def _worker(
    index: int,
    setup: Callable,
    argv: list[str],
    encoder: str,
    work: list[tuple[str, list[str]]],
    deadline: float | None,
    out,
) -> None:
    """One worker: rebuild the run's runner and cases from its arguments (``setup(argv, encoder) -> (runner, {case
    key: case})``, a module-level function of the caller), measure ``work`` ((case key, method names) pairs) in
    order, put ``("record", rec)`` per record and ``("case", key)`` per finished case, then ``("done", index)``;
    ``("error", text)`` on any failure."""
    try:
        from ..methods.registry import METHODS

        runner, cases = setup(argv, encoder)
        for key, names in work:
            if deadline is not None and time.time() >= deadline:
                break
            for rec in runner.run(cases[key], [METHODS[n] for n in names]):
                out.put(("record", rec))
            out.put(("case", key))
        out.put(("done", index))
    except BaseException:  # noqa: BLE001 (reported to the main process, which stops the run)
        out.put(("error", f"worker {index}: {traceback.format_exc()}"))


def run_parallel(
    n_workers: int,
    setup: Callable,
    argv: list[str],
    encoder: str,
    todo: list,
    deadline: float | None,
    on_record: Callable[[dict], None],
    on_case: Callable[[], None],
) -> int:
    """Measure ``todo`` ((case, methods) pairs) in ``n_workers`` processes (each built by ``setup``, see
    :func:`_worker`), case ``i`` in worker ``i % n``; calls
    ``on_record`` for every record and ``on_case()`` for every finished case, in the main process. Returns the number of
    cases finished; a failing worker stops the others and raises ``RuntimeError`` with its traceback."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    work = [[(c.key, [m.name for m in ms]) for c, ms in todo[i::n_workers]] for i in range(n_workers)]
    procs = [
        ctx.Process(target=_worker, args=(i, setup, argv, encoder, work[i], deadline, out), daemon=True)
        for i in range(n_workers)
        if work[i]
    ]
    for p in procs:
        p.start()
    finished = ran = 0
    try:
        while finished < len(procs):
            try:
                kind, payload = out.get(timeout=30)
            except queue_mod.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"a worker died (exit code {dead[0].exitcode})") from None
                continue
            if kind == "record":
                on_record(payload)
            elif kind == "case":
                ran += 1
                on_case()
            elif kind == "done":
                finished += 1
            else:
                raise RuntimeError(payload)
    finally:
        for p in procs:
            if p.is_alive() and finished < len(procs):
                p.terminate()
            p.join(timeout=30)
    return ran
