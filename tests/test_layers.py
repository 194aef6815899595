"""The layers of docs/design.md, as the code's imports draw them: no module imports one that
imports it back (directly or around a circle), and the backend's face, the coordination layer
and the utilities import nothing above them. Read from the source (every import, the lazy ones
inside functions too; only ``if TYPE_CHECKING:`` blocks are left out), so a new import that runs
back up a floor fails here."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> Dict[str, str]:
    mods = {}
    for dirpath, _dirs, files in os.walk(os.path.join(ROOT, "ft")):
        if "_proto" in dirpath:
            continue  # generated stubs
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[mod.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _targets(mod: str, node: ast.AST) -> List[str]:
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".")
            if not MODULES[mod].endswith("__init__.py"):
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        names = [name] + [f"{name}.{alias.name}" for alias in node.names]
    else:
        names = [alias.name for alias in node.names]
    return [n for n in names if n in MODULES]


def _graph() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {mod: set() for mod in MODULES}
    for mod, path in MODULES.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        typing_only = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                typing_only.update(id(child) for child in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(mod, node):
                # A module's own package runs first whatever it imports: not an edge.
                if target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


GRAPH = _graph()


def _reachable(start: str) -> Set[str]:
    seen: Set[str] = set()
    todo = [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_circles():
    circles = sorted(mod for mod in MODULES if mod in _reachable(mod))
    assert not circles, f"modules that import themselves around a circle: {circles}"


def _above(prefixes):
    return lambda mod: any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_the_backends_face_imports_nothing_above_it():
    above = _above(
        [
            "ft.manager",
            "ft.collectives",
            "ft.device_mesh",
            "ft.managed_process_group",
            "ft.process_group",
            "ft.local_sgd",
            "ft.optim",
            "ft.ddp",
            "ft.manager_parts",
            "ft.checkpointing",
            "ft.coordination",
            "ft.launch",
        ]
    )
    for mod in [m for m in MODULES if m == "ft.backend" or m.startswith("ft.backend.")]:
        bad = sorted(t for t in _reachable(mod) if above(t))
        assert not bad, f"{mod} reaches {bad}"


def test_coordination_and_utils_stay_below_the_manager():
    above = _above(["ft.manager", "ft.backend", "ft.process_group", "ft.launch", "ft.optim"])
    for mod in [m for m in MODULES if m.startswith(("ft.coordination", "ft.utils"))]:
        bad = sorted(t for t in _reachable(mod) if above(t))
        assert not bad, f"{mod} reaches {bad}"
