"""The layout rules of docs/architecture.md: subpackages in one dependency direction (no import cycle, function-level
imports included), kernel packages that import nothing from hf_cocktail, and no library file over 400 lines."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = os.path.join(ROOT, "hf_cocktail")


def _imports(path: str, root: str, relative: bool = True, package: str | None = None) -> set[str]:
    """Modules of ``root`` imported anywhere in ``path`` (module level or inside functions); ``relative``: the file
    belongs to ``package`` (default ``root``) and its relative imports count."""
    package = package or root
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level and relative:  # from .x import y / from . import x / from ..x import y
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                out.update([base] if node.module else [f"{base}.{a.name}" for a in node.names] + [base])
            elif node.module and node.module.startswith(root):
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)  # from hf_cocktail.x import module
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(root))
    return out


LAYERS = ("storage", "presets", "planning", "decode", "cache", "integration")  # each imports only those before it
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")


def _library_modules(folder: str = LIBRARY) -> dict[str, str]:
    """``{dotted module: path}`` of every module under ``folder``, subpackages included (``__init__`` files too)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(root, f)
    return out


def _graph(top: str = "hf_cocktail") -> dict[str, set[str]]:
    mods = _library_modules(os.path.join(ROOT, top))
    graph = {}
    for m, p in mods.items():
        package = m if p.endswith("__init__.py") else m.rsplit(".", 1)[0]
        graph[m] = {d for d in _imports(p, top, package=package) if d in mods and d != m}
    return graph


def _layer(module: str) -> int:
    """The index of ``module``'s package in :data:`LAYERS`; modules outside them (the demo, loaders, calibrate, the
    package root) are above every layer."""
    if module == "hf_cocktail._version":
        return -1  # the version: below everything
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


@pytest.mark.parametrize("top", ["hf_cocktail", "eval"])
def test_no_import_cycle(top):
    graph, state = _graph(top), {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                pytest.fail(f"import cycle: {' -> '.join(stack + [m, d])}")
            if d not in state:
                visit(d, stack + [m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_each_package_imports_only_packages_below_it():
    for module, deps in _graph().items():
        above = [d for d in deps if _layer(d) > _layer(module) and d != "hf_cocktail"]
        assert not above, f"{module} ({_layer(module)}) imports {above}, from a package above it in {LAYERS}"


@pytest.mark.parametrize("package", ["triton_ops", "cpu_ops"])
def test_kernel_packages_import_nothing_from_hf_cocktail(package):
    folder = os.path.join(ROOT, package)
    for f in os.listdir(folder):
        if f.endswith(".py"):
            found = _imports(os.path.join(folder, f), "hf_cocktail", relative=False)
            assert not found, f"{package}/{f} imports {found}"


SOURCE_SUFFIXES = (".py", ".cpp", ".h")  # the source files the 400-line rule counts (eval's data files do not)


def _source_files(top: str) -> list[str]:
    """Every source file (:data:`SOURCE_SUFFIXES`) under ``top`` (relative to the repo root), subfolders included."""
    return [
        os.path.join(root, f)
        for root, _, files in os.walk(os.path.join(ROOT, top))
        for f in files
        if f.endswith(SOURCE_SUFFIXES)
    ]


@pytest.mark.parametrize("top", ["hf_cocktail", "triton_ops", "cpu_ops", "eval"])
def test_no_source_file_passes_400_lines(top):
    """The library, the kernel packages (Python, C++ sources and headers) and the evaluation: no file over 400 lines
    (``tests/`` may)."""
    files = _source_files(top)
    assert files, f"no source files found under {top}/"
    lines = {p: sum(1 for _ in open(p, encoding="utf-8")) for p in files}
    long = {os.path.relpath(p, ROOT): n for p, n in lines.items() if n > 400}
    assert not long, f"files over 400 lines: {long}"


def test_the_architecture_page_names_every_package_and_module_in_order():
    page = open(ARCHITECTURE, encoding="utf-8").read()
    named = re.findall(r"^\| `hf_cocktail/(\w+)/` \|", page, flags=re.M)
    assert named == list(LAYERS), f"docs/architecture.md lists the packages {named}, the layers are {LAYERS}"
    names = [os.path.basename(p)[:-3] for p in _library_modules().values()]
    missing = [n for n in names if n != "__init__" and n not in page]
    assert not missing, f"docs/architecture.md does not name {missing}"


RESULTS_DIR = os.path.join(ROOT, "eval", "results")
VERSIONED = re.compile(r"(_v\d+|_run\d+|_r\d+|_before|_after)\d*$")  # a name that says "another run of the same"


def _result_files() -> list[str]:
    """Every file under eval/results/, relative to it (with ``/``)."""
    return sorted(
        os.path.relpath(os.path.join(root, f), RESULTS_DIR).replace(os.sep, "/")
        for root, _, files in os.walk(RESULTS_DIR)
        for f in files
    )


def test_every_result_lies_in_a_registered_question_folder():
    """eval/results/ holds one folder per question of ``eval.questions.QUESTIONS`` (its current run): a new result
    is registered there, so that docs/results.md cites it; an old run leaves the tree (git keeps it)."""
    from eval.questions import QUESTIONS

    folders = [q.folder for q in QUESTIONS]
    loose = [f for f in _result_files() if not any(f.startswith(folder + "/") for folder in folders)]
    assert not loose, f"results in no folder of eval/questions.py's QUESTIONS (register them or remove them): {loose}"
    missing = [q.folder for q in QUESTIONS if not os.path.isdir(os.path.join(RESULTS_DIR, q.folder))]
    assert not missing, f"eval/questions.py registers folders that do not exist: {missing}"
    reports = [f"{q.folder}/{r.file}" for q in QUESTIONS for r in q.reports]
    images = [f"{q.folder}/{i}" for q in QUESTIONS for i in q.images]
    absent = [p for p in reports + images if not os.path.isfile(os.path.join(RESULTS_DIR, p))]
    assert not absent, f"eval/questions.py names files that do not exist: {absent}"
    assert len(set(folders)) == len(folders), f"a folder registered twice: {folders}"


def test_every_registered_folder_is_cited_by_the_results_page():
    from eval.questions import QUESTIONS

    page = open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8").read()
    uncited = [q.folder for q in QUESTIONS if f"`eval/results/{q.folder}/`" not in page]
    assert not uncited, f"docs/results.md does not cite {uncited}: run `python -m eval.make_docs`"


def test_no_result_name_is_versioned_and_the_questions_stay_few():
    names = {part for f in _result_files() for part in f.split("/")}
    versioned = sorted(n for n in names if VERSIONED.search(n.split(".")[0]))
    assert not versioned, f"versioned result names (a rerun replaces its result; git keeps the old one): {versioned}"
    top = os.listdir(RESULTS_DIR)
    assert len(top) <= 40, f"eval/results/ has {len(top)} entries (at most 40: one folder per question)"


@pytest.mark.parametrize("name", ["kld_v2", "bench_run10.json", "profile_before.md", "presets_after2", "cal_r2"])
def test_the_versioned_name_rule_catches_the_old_names(name):
    assert VERSIONED.search(name.split(".")[0])


@pytest.mark.parametrize("name", ["heatmap_int4first4_v3_had_g64.png", "round2", "budget_2gib.json", "kld_8k"])
def test_the_versioned_name_rule_spares_names_of_what_is_measured(name):
    assert not VERSIONED.search(name.split(".")[0])
