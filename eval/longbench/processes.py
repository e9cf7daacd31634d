"""Several processes for one LongBench run (``accelerate launch`` / ``torchrun``): the process state, and which
pending (task, example) items each process handles (dealt round-robin)."""

from __future__ import annotations

import datetime
import os
import sys

import torch
from accelerate import PartialState

ONE_PROCESS_WARNING = (
    "warning: `accelerate launch --cpu --num_processes N` started ONE process (accelerate starts several CPU processes "
    "only through MPI); running single-process. For N CPU processes use `accelerate launch --multi_gpu "
    "--num_processes N -m eval.longbench ...` (torchrun underneath; the processes use gloo on a CPU-only machine) or "
    "`torchrun --nproc_per_node N -m eval.longbench ...`."
)


def process_state() -> PartialState:
    """This process's place in the run (gloo on CPU); warns when ``accelerate launch --cpu`` started one process."""
    use_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    state = PartialState(cpu=use_cpu, timeout=datetime.timedelta(hours=48))
    if (
        state.num_processes == 1
        and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"
        and os.environ.get("MASTER_ADDR")
        and "WORLD_SIZE" not in os.environ
    ):
        print(ONE_PROCESS_WARNING, file=sys.stderr)
    return state


def my_share(work: list, state: PartialState) -> list:
    """The items of ``work`` this process handles."""
    return work[state.process_index :: state.num_processes]
