"""The layout rules of the README: one dependency direction among library modules (no import cycle, function-level
imports included), kernel packages that import nothing from hf_cocktail, and no library file past ~400 lines."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = os.path.join(ROOT, "hf_cocktail")


def _imports(path: str, package: str, relative: bool = True) -> set[str]:
    """Modules of ``package`` imported anywhere in ``path`` (module level or inside functions); ``relative``: the
    file belongs to ``package`` and its relative imports count."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level and relative:  # from .x import y / from . import x
                base = node.module or ""
                names = [base] if base else [a.name for a in node.names]
                out.update(f"{package}.{n}".rstrip(".") for n in names)
            elif node.module and node.module.startswith(package):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(package))
    return out


def _graph() -> dict[str, set[str]]:
    mods = {
        f"hf_cocktail.{f[:-3]}": os.path.join(LIBRARY, f)
        for f in os.listdir(LIBRARY)
        if f.endswith(".py") and f != "__init__.py"
    }
    return {m: {d for d in _imports(p, "hf_cocktail") if d in mods and d != m} for m, p in mods.items()}


def test_library_modules_have_no_import_cycle():
    graph, state = _graph(), {}

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


@pytest.mark.parametrize("package", ["triton_ops", "cpu_ops"])
def test_kernel_packages_import_nothing_from_hf_cocktail(package):
    folder = os.path.join(ROOT, package)
    for f in os.listdir(folder):
        if f.endswith(".py"):
            found = _imports(os.path.join(folder, f), "hf_cocktail", relative=False)
            assert not found, f"{package}/{f} imports {found}"


def test_no_library_file_passes_about_400_lines():
    long = {
        f: n
        for f in os.listdir(LIBRARY)
        if f.endswith(".py")
        for n in [sum(1 for _ in open(os.path.join(LIBRARY, f), encoding="utf-8"))]
        if n > 420
    }
    assert not long, f"library files over ~400 lines: {long}"


def test_the_readme_layout_table_names_every_library_module():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    layout = readme[readme.index("## Layout") :]
    missing = [f for f in sorted(os.listdir(LIBRARY)) if f.endswith(".py") and f != "__init__.py" and f not in layout]
    assert not missing, f"README's Layout section does not name {missing}"


def test_each_module_imports_only_modules_above_it_in_the_readme_table():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    layout = readme[readme.index("## Layout") :]
    order = [f"hf_cocktail.{m}" for m in re.findall(r"`hf_cocktail/(\w+)\.py`", layout)]
    graph = _graph()
    for i, module in enumerate(order):
        below = set(order[i + 1 :])
        assert not graph.get(module, set()) & below, f"{module} imports {graph[module] & below}, listed below it"
