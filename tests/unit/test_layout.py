"""The package's layout: few top-level modules, no import cycle, data flowing one way between stages.

The import graph is read with ``ast`` from the source, so imports inside functions (lazy ones) count as
much as those at the top of a module. Imports under ``if TYPE_CHECKING:`` are left out: they name types
for the type checker and run nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest_transformers_opt

PACKAGE = Path(pytest_transformers_opt.__file__).parent
NAME = PACKAGE.name
# Stage packages in the order data flows through them; a stage imports only foundation modules, its own
# modules and earlier stages. The pytest face (plugin, fixtures, options, markers, session, plan, cli,
# hookspecs) may import any stage.
FOUNDATION = {"errors", "units", "files", "compat"}
STAGES = ("techniques", "engine", "verdict", "report", "advisor")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports when it runs (at import or inside a function)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    runtime: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                typing_only.update(id(child) for stmt in node.body for child in ast.walk(stmt))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            for candidate in candidates:
                # a module's own packages are imported before it anyway: not an edge (no spurious cycles)
                ancestor = name.startswith(candidate + ".")
                if candidate in modules and candidate != name and not ancestor and id(node) not in typing_only:
                    runtime[name].add(candidate)
    return runtime


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _short(module: str) -> str:
    return module.removeprefix(NAME + ".")


def _stage(module: str) -> str:
    """A module's stage: its top folder, "foundation", "face", or "" for the package's own __init__."""
    parts = _short(module).split(".")
    if module == NAME:
        return ""
    if parts[0] in STAGES:
        return parts[0]
    return "foundation" if parts[0] in FOUNDATION else "face"


def test_at_most_twelve_top_level_modules_and_every_stage_is_a_folder() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 12, top
    for stage in STAGES:
        assert (PACKAGE / stage / "__init__.py").is_file(), stage


def test_no_import_cycle_among_the_package_modules() -> None:
    graph = import_graph()
    assert len(graph) > 30  # the graph really was read, lazy imports included
    assert f"{NAME}.engine.generation" in graph[f"{NAME}.engine.model"]  # OptModel.generate's, inside it
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(_short(m) for m in cycle or [])


def test_data_flows_one_way_between_stages() -> None:
    runtime = import_graph()
    order = {"foundation": -1, **{stage: index for index, stage in enumerate(STAGES)}}
    wrong = []
    for module, deps in runtime.items():
        stage = _stage(module)
        if stage in ("face", ""):
            continue
        for dep in deps:
            target = _stage(dep)
            if target == "face" or (target != "" and order[target] > order[stage]):
                wrong.append(f"{_short(module)} ({stage}) imports {_short(dep)} ({target})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
