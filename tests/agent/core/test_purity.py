"""The planning core is pure: no I/O, clock, randomness or runtime inside agent/core."""

import ast
from pathlib import Path

import agent.core

FORBIDDEN = {
    "asyncio", "socket", "selectors", "ssl", "onnxruntime", "aiohttp", "zeroconf", "time",
    "datetime", "random", "secrets", "uuid", "os", "subprocess", "threading", "multiprocessing",
    "psutil", "shutil", "pathlib", "io", "logging", "urllib", "http", "tomllib",
}


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"open", "__import__", "eval", "exec"}:
            roots.add(node.func.id)
    return roots


def test_core_modules_import_nothing_impure():
    files = sorted(Path(agent.core.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    offenders = {f.name: sorted(imported_roots(f) & (FORBIDDEN | {"open", "__import__", "eval", "exec"})) for f in files}
    assert {name: bad for name, bad in offenders.items() if bad} == {}


def test_core_only_imports_the_core_or_the_standard_library():
    allowed_project = {"agent"}
    for path in Path(agent.core.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in allowed_project:
                assert node.module.startswith("agent.core"), f"{path.name} imports {node.module}"


def test_shards_never_imports_agent():
    import shards

    for path in Path(shards.__file__).parent.rglob("*.py"):
        assert "agent" not in imported_roots(path), f"{path} imports agent"
