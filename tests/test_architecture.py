"""The architecture's rules, read from the source (ast), so they stay true as the code grows.

- No import cycle inside ``shardtune/`` (imports inside functions count too: a lazy import is still a dependency).
- ``shardtune/train/`` imports nothing from ``shardtune.memory`` or ``shardtune.cli`` (dependencies point down:
  cli -> memory -> train -> data/config).
- Product code carries no test hooks: no ``SHARDTUNE_TEST*`` or ``SHARDTUNE_FAULT`` in ``shardtune/``.
- No function anywhere in ``shardtune/`` is over 80 lines.
- Packages form no loop either (``data`` and ``hub``, say, each importing the other through different modules), and
  the bottom layer (``config/``, ``data/``) imports none of the layers above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shardtune"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str], root: Path = PACKAGE) -> set[str]:
    """The shardtune modules ``path`` imports: ``from pkg import submodule`` names the submodule."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    return {name: imported_modules(path, set(paths), root) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles():
    # The rule below is only as good as this finder: a 3-module cycle beside a clean chain.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_relative_and_from_imports(tmp_path):
    pkg = tmp_path / "shardtune"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import x\n")
    (pkg / "sub" / "x.py").write_text("def f():\n    from shardtune.sub import y\n")
    (pkg / "sub" / "y.py").write_text("import shardtune.sub.x\n")
    graph = import_graph(pkg)
    assert graph["shardtune.sub"] == {"shardtune.sub.x"}
    assert graph["shardtune.sub.x"] == {"shardtune.sub.y"}
    assert cycles(graph) == [["shardtune.sub.x", "shardtune.sub.y"]]


def test_no_import_cycle_inside_shardtune():
    assert cycles(import_graph()) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between shardtune's top-level packages and modules (shardtune.data, shardtune.hub, ...)."""
    top = lambda module: ".".join(module.split(".")[:2])  # noqa: E731
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        packages.setdefault(top(module), set()).update(top(d) for d in deps if top(d) != top(module))
    return packages


def test_no_loop_between_packages():
    assert cycles(package_graph(import_graph())) == []


def test_the_bottom_layer_imports_no_layer_above_it():
    above = ("shardtune.train", "shardtune.memory", "shardtune.cli", "shardtune.infer", "shardtune.bench",
             "shardtune.demo")
    packages = package_graph(import_graph())
    upward = {p: sorted(d for d in packages[p] if d.startswith(above)) for p in ("shardtune.config", "shardtune.data")}
    assert upward == {"shardtune.config": [], "shardtune.data": []}


def test_train_imports_nothing_from_memory_or_cli():
    graph = import_graph()
    upward = {name: sorted(d for d in deps if d.startswith(("shardtune.memory", "shardtune.cli")))
              for name, deps in graph.items() if name.startswith("shardtune.train")}
    assert {name: deps for name, deps in upward.items() if deps} == {}


def test_no_test_hooks_in_product_code():
    hooks = [f"{path.relative_to(PACKAGE.parent)}:{n}" for path in PACKAGE.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if "SHARDTUNE_TEST" in line or "SHARDTUNE_FAULT" in line]
    assert hooks == []


MAX_FUNCTION_LINES = 80


def long_functions(root: Path = PACKAGE) -> list[str]:
    """Every function (methods and nested functions too) of every module under ``root`` longer than the limit."""
    return [f"{path.relative_to(root.parent)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(root.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def _function(name: str, lines: int, indent: str = "") -> str:
    """The source of a function ``lines`` lines long, its def line included."""
    return f"{indent}def {name}():\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))


def test_the_length_rule_sees_every_package_and_methods(tmp_path):
    # The rule below is only as good as this finder: a function in a subpackage's module, a method in a class.
    pkg = tmp_path / "shardtune"
    (pkg / "memory" / "calibration").mkdir(parents=True)

    def write(lines: int) -> None:
        (pkg / "cli.py").write_text(_function("run", lines))
        (pkg / "memory" / "calibration" / "deep.py").write_text("class C:\n" + _function("m", lines, "    "))

    write(MAX_FUNCTION_LINES + 1)
    assert long_functions(pkg) == ["shardtune/cli.py:run (81 lines)",
                                   "shardtune/memory/calibration/deep.py:m (81 lines)"]
    write(MAX_FUNCTION_LINES)
    assert long_functions(pkg) == []  # exactly the limit is allowed


def test_no_function_in_shardtune_over_80_lines():
    assert long_functions() == []
