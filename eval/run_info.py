"""``run_info.json``: what produced a results folder (command, commit, hardware, configs, every invocation).

A run records itself when it starts (``status`` "running", so a killed run keeps its command and commit) and
completes the record when it ends (runtime, counts); resuming into the folder adds an invocation.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch
import transformers

from .paths import REPO_ROOT
from .records import write_json


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def git_commit(exclude: str | None = None) -> str:
    """HEAD of the checkout, with ``+dirty`` when the working tree has changes outside ``exclude`` (a run's own
    output folder) and ``eval/results``: results being written do not make the code that ran "dirty"."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        commit = out.stdout.strip() or "unknown"
        cmd = ["git", "status", "--porcelain", "--", ".", ":(exclude)eval/results"]
        if exclude:
            rel = os.path.relpath(os.path.abspath(exclude), REPO_ROOT)
            if not rel.startswith(".."):
                cmd.append(f":(exclude){rel}")
        dirty = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def command_line(module: str) -> str:
    """``python -m <module>`` and the arguments; under several processes (torchrun, or ``accelerate launch``, which
    starts torchrun) the launcher and the process count, which the script's own argv does not show."""
    args = " ".join(sys.argv[1:])
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        launcher = (
            "accelerate launch --num_processes"
            if any(k.startswith("ACCELERATE_") for k in os.environ)
            else "torchrun --nproc_per_node"
        )
        return f"{launcher} {world} -m {module} {args}".rstrip()
    return f"python -m {module} {args}".rstrip()


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def update_run_info(out_dir: str, started_at: str, invocation: dict, config: dict | None = None) -> None:
    """Record this invocation (identified by ``started_at``) in ``out_dir/run_info.json``, merged over what an
    earlier call for it wrote. Top level: ``command`` / ``commit`` of the first invocation, ``runtime_s`` of all
    finished ones together, ``config`` with the union over invocations of the methods' configs."""
    path = os.path.join(out_dir, "run_info.json")
    old = _read(path)
    past = list(old.get("invocations", []))
    mine = next((x for x in past if x.get("started_at") == started_at), {})
    invocations = [x for x in past if x.get("started_at") != started_at]
    invocations.append({**mine, **invocation, "started_at": started_at})
    info = {
        "command": invocations[0].get("command"),
        "commit": invocations[0].get("commit"),
        "runtime_s": round(sum(x.get("runtime_s") or 0 for x in invocations), 1),
        "unfinished_invocations": sum(1 for x in invocations if x.get("status") == "running"),
        "hardware": old.get("hardware") or hardware_info(),
        "config": old.get("config") or {},
        "invocations": invocations,
    }
    if config:
        methods = {**info["config"].get("methods", {}), **config.get("methods", {})}
        info["config"] = {**config, "methods": methods}
    write_json(path, info)


class Invocation:
    """One run of a script into its results folder: the commit and the start time read when it starts (a commit
    made mid-run is not the code that runs) and its entry in ``run_info.json``."""

    def __init__(self, out_dir: str, module: str):
        self.out_dir, self.module = out_dir, module
        self.t_start = time.time()
        self.commit = git_commit(exclude=out_dir)
        self.started_at = now()

    def deadline(self, minutes: float | None) -> float | None:
        """When ``--stop-after-minutes`` stops starting new cases (``None``: never)."""
        return self.t_start + 60 * minutes if minutes else None

    def running(self, **extra) -> None:
        """Record the invocation as it starts (a run killed later keeps its command and commit)."""
        entry = {"command": command_line(self.module), "commit": self.commit, **extra, "status": "running"}
        update_run_info(self.out_dir, self.started_at, entry)

    def finished(self, unit: str, ran: int, todo: int, config: dict | None = None) -> None:
        """Complete the record: the runtime, ``<unit>_processed``, and ``status`` "stopped" with ``<unit>_left``
        where ``--stop-after-minutes`` left ``todo - ran`` of them (said on stdout too)."""
        entry = {"runtime_s": round(time.time() - self.t_start, 1), f"{unit}_processed": ran, "finished_at": now()}
        entry["status"] = "finished" if ran >= todo else "stopped"
        if ran < todo:
            entry[f"{unit}_left"] = todo - ran
            print(f"stopped after {ran} of {todo} {unit} (--stop-after-minutes); the same command resumes")
        update_run_info(self.out_dir, self.started_at, entry, config)


def run_config(args, methods: list, encoder: str, **extra) -> dict:
    """The ``config`` of ``run_info.json``: every method's config, the parsed arguments, and ``extra``."""
    cfg = {"methods": {m.name: m.config_dict(encoder) for m in methods}}
    return {**cfg, "args": {k: v for k, v in vars(args).items() if k != "method_list"}, **extra}
