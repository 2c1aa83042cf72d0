"""The house: every module of `agent/` and `shards/` sits in one role package, roles depend on
each other in one direction only (the order below, which docs/architecture.md shows), no
module imports another in a cycle, every module imports alone in a fresh interpreter and has
a test file named after it in the tree that mirrors the packages, and a class over 250 lines
says why.

Imports are read from the source, late ones (inside functions) and type-only ones included:
what a module needs at any moment is a dependency.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Lowest first: a role may import its own modules and those of the roles before it, never after.
# `agent` may import `shards`; `shards` never imports `agent`.
LAYERS = {
    "agent": ("core", "local", "cluster", "dataplane", "stage", "orchestration", "models", "http", "node", "cli"),
    "shards": ("errors", "store", "text", "importers", "providers", "graph", "runtime", "cli"),
}
TOP_MODULES = {"agent", "shards", "shards.errors"}  # the packages themselves, and shards' error classes


def modules() -> dict[str, Path]:
    """Every module of the two packages by dotted name (``__main__`` entry files left out)."""
    found = {}
    for top in LAYERS:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def role(module: str) -> tuple[str, int]:
    """The top package and the rank of the role ``module`` belongs to (-1: the package itself)."""
    parts = module.split(".")
    if module in TOP_MODULES:
        return parts[0], (0 if module == "shards.errors" else -1)
    return parts[0], LAYERS[parts[0]].index(parts[1])


def imported(path: Path, module: str) -> set[str]:
    """The project modules ``path`` imports anywhere in its source, resolved to modules."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names)
    resolved = set()
    for name in names:
        while name and name not in MODULES:  # an attribute of a module: the module
            name = name.rpartition(".")[0]
        if name and name.split(".")[0] in LAYERS and name != module:
            resolved.add(name)
    return resolved


GRAPH = {module: imported(path, module) for module, path in MODULES.items()}


def test_every_module_sits_in_one_role_package():
    stray = [m for m in MODULES if m not in TOP_MODULES and (len(m.split(".")) < 2 or m.split(".")[1] not in LAYERS[m.split(".")[0]])]
    assert stray == []
    for top, roles in LAYERS.items():
        for name in roles:
            if f"{top}.{name}" not in TOP_MODULES:
                assert (REPO / top / name / "__init__.py").is_file(), f"{top}/{name}/ is no package"
                assert ast.get_docstring(ast.parse((REPO / top / name / "__init__.py").read_text())), \
                    f"{top}/{name}/__init__.py says what the role is"


def test_roles_depend_in_one_direction_only():
    wrong = []
    for module, targets in GRAPH.items():
        top, rank = role(module)
        for target in targets:
            target_top, target_rank = role(target)
            if top == "shards" and target_top == "agent":
                wrong.append(f"{module} imports {target}: shards never imports agent")
            elif top == target_top and target_rank > rank:
                wrong.append(f"{module} ({LAYERS[top][rank] if rank >= 0 else top}) imports {target} "
                             f"({LAYERS[top][target_rank]}), a role above it")
    assert wrong == []


def test_no_module_imports_another_in_a_cycle():
    """Tarjan's strongly connected components over the module graph: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert cycles == []


def test_the_architecture_doc_shows_the_roles_in_their_order():
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    for top, roles in LAYERS.items():
        places = [text.find(f"`{top}/{name}" if f"{top}.{name}" not in TOP_MODULES else f"`{top}/{name}.py")
                  for name in roles]
        assert all(place >= 0 for place in places), (top, roles, places)
        assert places == sorted(places), f"docs/architecture.md lists {top}'s roles in another order"


def _import_alone(module: str) -> tuple[str, int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=REPO,
                            env=env, timeout=300)
    return module, result.returncode, result.stderr[-2000:]


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module imported first and alone: a cycle or a missing import that the usual import
    order hides shows here. The RKNN worker runs in the converter's own environment (its
    toolkit is not installed beside ncm) and is left out."""
    alone = [m for m in MODULES if m != "shards.providers.rknn_worker"]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failed = [(m, err) for m, code, err in pool.map(_import_alone, alone) if code != 0]
    assert failed == []


MAX_CLASS_LINES = 250


def test_no_class_is_over_250_lines_without_a_reason_in_its_docstring():
    """A class longer than :data:`MAX_CLASS_LINES` says why in its docstring, in a line that
    starts "Over 250 lines:"; the others are cut by concern, not to a number."""
    unexplained = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES \
                    and "Over 250 lines:" not in (ast.get_docstring(node) or ""):
                unexplained.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not unexplained, unexplained


def test_every_module_has_a_test_file_named_after_it_in_the_mirrored_tree():
    """``agent/stage/worker.py`` is tested in ``tests/agent/stage/test_worker.py`` (behaviour
    scenarios of several modules live in ``tests/agent/scenarios/``)."""
    untested = []
    for name, path in modules().items():
        relative = path.relative_to(REPO)
        if relative.name == "__init__.py":
            continue
        if not (REPO / "tests" / relative.parent / f"test_{relative.name}").is_file():
            untested.append(str(relative))
    assert not untested, untested
