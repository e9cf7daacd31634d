"""The SmolLM2 speed/memory benchmarks' shared parts: their command line, the prompt (a Paul Graham essay prefix and
a question), one measured ``generate`` per (method, context length), the ratio tables and the result files."""

from __future__ import annotations

import argparse
import os
import sys

from tqdm.auto import tqdm

from ..cli import UsageError, parse_int_list
from ..essays import essay_prefix
from ..kv_bytes import cache_kv_bytes, fp16_kv_bytes
from ..methods.kinds import Method, Request, cache_and_inputs
from ..methods.registry import METHODS, PRESET_HELP, register_presets
from ..models import DTYPES, load_model_and_tokenizer, model_input_device, set_threads
from ..records import write_json
from ..run_info import command_line, git_commit, hardware_info
from .rounds import bench_request, resolve_methods
from .timing import timed_generate


def measure(method: Method, model, tok, request: Request, new_tokens: int, encoder: str | None = None) -> dict:
    """Run ``generate`` with ``method``'s cache over ``request`` for exactly ``new_tokens`` tokens: the times, the
    peak memory growth of both phases and the KV bytes."""
    cache, inputs = cache_and_inputs(method, model, tok, request, encoder)
    timing = timed_generate(model, cache, inputs.to(model_input_device(model)), new_tokens, tok.eos_token_id)
    seq = int(cache.get_seq_length())
    res = {
        "method": method.name,
        **timing,
        "kv_bytes": cache_kv_bytes(cache),
        "kv_bytes_in_memory": cache_kv_bytes(cache, deployed=False),
        "fp16_kv_bytes": fp16_kv_bytes(model.config, seq),
    }
    res["kv_ratio"] = res["kv_bytes"] / res["fp16_kv_bytes"]
    if hasattr(cache, "memory_report"):
        res["chunks"] = cache.memory_report()["chunks"]
    return res


def new_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A speed script's command line, described by the first paragraph of its module docstring."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def common_args(p: argparse.ArgumentParser, threads: int | None = None) -> None:
    """The options every SmolLM2 speed script takes: ``--model --dtype --threads --essay-dir --out``."""
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--essay-dir", default=None)
    p.add_argument("--out", default=None, help="also write the results to this JSON file (and a .md next to it)")


def fp16_first(spec: str) -> list[Method]:
    """``--methods`` resolved (registry names, ``NAME:BACKEND``), ``fp16`` first: the reference."""
    return [METHODS["fp16"]] + [m for m in resolve_methods(spec) if m.name != "fp16"]


def parse_args(
    argv=None,
    module: str = "",
    doc: str = "",
    default_methods: str = "fp16,cocktail,int4,int2,kivi2",
    rounds: bool = False,
) -> argparse.Namespace:
    """The shared command line: one ``generate`` per (context, method) of ``--new-tokens``, or with ``rounds=True``
    the alternating-rounds decode options of ``bench_latency`` instead."""
    p = new_parser(module, doc)
    p.add_argument("--contexts", default=None, help="context lengths in tokens (default 1024,2048,4096,8192)")
    p.add_argument("--methods", default=None, help=f"methods (default {default_methods})")
    p.add_argument("--preset", action="append", default=None, help=PRESET_HELP)
    p.add_argument("--quick", action="store_true", help="default contexts 1024,2048, methods fp16,cocktail,int2")
    common_args(p)
    p.add_argument("--device-map", default=None)
    if rounds:
        rounds_args(p)
    else:
        p.add_argument("--new-tokens", type=int, default=32, help="new tokens per run")
    args = p.parse_args(argv)
    note_start(args.out)
    if args.contexts is None:
        args.contexts = "1024,2048" if args.quick else "1024,2048,4096,8192"
    if args.methods is None:
        args.methods = "fp16,cocktail,int2" if args.quick else default_methods
    args.context_list = parse_int_list(args.contexts, "--contexts")
    if any(c < 64 for c in args.context_list):
        raise UsageError(f"--contexts must be >= 64 tokens, got {args.context_list}")
    if not rounds and args.new_tokens < 2:
        raise UsageError("--new-tokens must be >= 2 (decode time needs at least one decode step)")
    if rounds and (args.rounds < 1 or args.steps_per_round < 1 or args.warmup_steps < 0):
        raise UsageError("--rounds and --steps-per-round must be >= 1, --warmup-steps >= 0")
    register_presets(args.preset)
    args.method_list = fp16_first(args.methods)
    return args


def rounds_args(p: argparse.ArgumentParser) -> None:
    """``bench_latency``'s options: decode timed in alternating rounds from one shared prefill per context."""
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (eval/benchmarks/rounds.py)")
    p.add_argument("--steps-per-round", type=int, default=8, help="decode steps per method and round")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps per method first")
    p.add_argument(
        "--no-ablation",
        action="store_true",
        help="accepted for the recorded commands: the no-reorder ablation this skipped left at 2b36508 "
        "(docs/experiments.md, 'The PyTorch path')",
    )
    p.add_argument(
        "--unpacked-twins",
        action="store_true",
        help="also time NAME_unpacked for every Cocktail method: its config with residual_tokens beyond any "
        "generation (generated tokens never packed, the cache before issue 44), in the same rounds",
    )
    p.add_argument(
        "--prefill-dtype",
        default=None,
        choices=list(DTYPES),
        help="run the shared prefill with a copy of the model in this dtype and cast its keys/values to --dtype "
        "(bfloat16 prefill is very slow on some CPUs; decode time does not depend on the values)",
    )


def warm_model(args, device_map: str | None = None) -> tuple[object, object]:
    """The model and tokenizer of ``args``, after one untimed 2-token ``generate`` of every method (first-call
    overheads: encoder loading, kernel build, hqq / quanto, out of the measurements)."""
    set_threads(1, args.threads)
    model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", device_map)
    warm = bench_request(tok, essay_prefix(tok, 64, args.essay_dir))
    for m in args.method_list:
        measure(m, model, tok, warm, 2)
    return model, tok


def run(args) -> tuple[list[dict], object, object]:
    """Every (context, method) measurement, after the warm-up; returns them, the model and the tokenizer."""
    model, tok = warm_model(args, args.device_map)
    results = []
    jobs = [(c, m) for c in args.context_list for m in args.method_list]
    for c, m in tqdm(jobs, desc="bench", dynamic_ncols=True):
        request = bench_request(tok, essay_prefix(tok, c, args.essay_dir))
        results.append(measure(m, model, tok, request, args.new_tokens))
    return results, model, tok


_START: dict = {}


def note_start(out: str | None = None) -> None:
    """Record the checkout's commit (``+dirty``) as the run starts: :func:`write_run_json` writes it beside the
    commit at the end, so a run that started on a tree being edited shows it."""
    _START.setdefault("commit", git_commit(exclude=out))


def kernel_build() -> dict | None:
    """The ``cpu_ops`` C++ extension this process ran (None when it never loaded): its module name hashes the kernel
    sources it was built from, so two runs' kernels compare by name whatever the checkout said at save time; with
    the build ``isa="auto"`` picks where the kernel has :func:`kernel_target`."""
    build = sys.modules.get("cpu_ops._build")
    module = getattr(build, "_module", None)
    if module is None:
        return None
    info = {"extension": module.__name__}
    target = getattr(module, "kernel_target", None)
    if callable(target):
        info["kernel_target"] = target()
    return info


def run_hardware() -> dict:
    """``hardware_info()`` plus the OpenMP wait policy (see ``eval/benchmarks/__init__.py``) and the ``cpu_ops``
    kernel build that ran (:func:`kernel_build`)."""
    return {**hardware_info(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpu_ops": kernel_build()}


def ratio(a, b) -> float:
    return a / b if b else float("nan")


def with_fp16_baseline(results: list[dict]) -> list[tuple[dict, dict]]:
    """Each result row with the ``fp16`` row of its context (the row itself where that context has none)."""
    base = {r["context_tokens"]: r for r in results if r["method"] == "fp16"}
    return [(r, base.get(r["context_tokens"], r)) for r in results]


def write_run_json(path: str, module: str, payload: dict) -> None:
    """``payload`` as JSON at ``path`` (folders created), after the run's command, commit and hardware."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    info = {"command": command_line(module), "commit": git_commit(exclude=path), "hardware": run_hardware()}
    if "commit" in _START:
        info["commit_at_start"] = _START["commit"]
    write_json(path, {**info, **payload})


def write_outputs(path: str, module: str, payload: dict, title: str, table: str, after: str = "") -> None:
    """``payload`` as JSON at ``path`` (:func:`write_run_json`) and, next to it (``.md``), ``title``, the command,
    ``table`` and ``after``."""
    write_run_json(path, module, payload)
    with open(os.path.splitext(path)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(f"# {title}\n\n`{command_line(module)}`\n\n{table}\n{after}")


def save(args, module: str, results: list[dict], table: str, title: str) -> None:
    """``--out``: the results as JSON (with command, commit, hardware) and the table as markdown next to it."""
    if args.out:
        write_outputs(args.out, module, {"results": results}, title, table)
