"""How the code is built, checked: the import graph (deferred imports inside functions included) is a house with
floors and no circle, stage runners never import the driver, only the checkpoint package names a layout, only the
backends touch megatron, no function outside the Triton kernel sources runs past 80 lines, and every environment
variable rlx reads is documented in docs/environment.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

RLX = REPO / "rlx"
FLOORS = [  # a package may import its own floor and the floors below it (the layered house of rlx/)
    ("rlx.errors", "rlx.config"),
    ("rlx.utils",),
    ("rlx.algorithms", "rlx.kernels"),
    ("rlx.models", "rlx.tasks"),
    ("rlx.parallel", "rlx.formats", "rlx.observe"),
    ("rlx.logprobs", "rlx.rollout", "rlx.checkpoints"),
    ("rlx.chat", "rlx.training", "rlx.scoring"),
    ("rlx.serve", "rlx.backends", "rlx.sft", "rlx.evaluation"),
    ("rlx.agent",),
    ("rlx.ppo", "rlx.stages"),
    ("rlx.commands", "rlx.cli", "rlx.__main__"),
]


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__") or name


MODULES = {module_name(p): p for p in sorted(RLX.rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """Every rlx module `path` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in MODULES}


GRAPH = {name: imports(path) - {name} for name, path in MODULES.items()}


def package(name: str) -> str:
    """The top-level package (or module) of rlx that `name` belongs to: rlx.rollout.native.engine -> rlx.rollout."""
    return ".".join(name.split(".")[:2])


def floor(name: str) -> int:
    if name == "rlx":  # the package itself: its version
        return 0
    return next(i for i, prefixes in enumerate(FLOORS) if package(name) in prefixes)


def test_every_package_has_a_floor():
    assert not [name for name in MODULES if name != "rlx" and not any(package(name) in f for f in FLOORS)]


def test_no_module_imports_a_floor_above_its_own():
    upward = [(m, t) for m, targets in GRAPH.items() for t in targets if floor(t) > floor(m)]
    assert not upward, upward


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path, node, target]
            if target not in state and (cycle := visit(target, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [])):
            return cycle
    return None


def test_the_import_graph_has_no_cycle_between_modules():
    assert find_cycle(GRAPH) is None


def test_the_import_graph_has_no_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        packages.setdefault(package(name), set()).update(package(t) for t in targets)
    assert find_cycle({p: targets - {p} for p, targets in packages.items()}) is None


def test_stage_runners_never_import_the_driver():
    for name, targets in GRAPH.items():
        if name.startswith("rlx.stages"):
            assert not [t for t in targets if t.startswith("rlx.ppo")], name


def test_only_the_backends_reach_megatron_and_only_the_checkpoint_package_reads_layouts():
    for name, targets in GRAPH.items():
        if not name.startswith("rlx.backends"):
            assert not [t for t in targets if t.startswith("rlx.backends.megatron")], name
    for name, path in MODULES.items():
        if name.startswith("rlx.checkpoints"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):  # e.g. `meta.layout == "megatron"`: dispatch belongs in the registry
                sides = [node.left, *node.comparators]
                assert not any(isinstance(s, ast.Attribute) and s.attr == "layout" for s in sides), name


def test_no_function_runs_past_80_lines():
    long = []
    for name, path in MODULES.items():
        if name.endswith("_kernels"):  # Triton kernel sources
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_every_environment_variable_rlx_reads_is_documented():
    readme = (REPO / "docs" / "environment.md").read_text()
    names = set()
    for path in MODULES.values():
        names.update(re.findall(r"\b(RLX_[A-Z0-9_]+)\b", path.read_text()))
    missing = sorted(n for n in names if n not in readme)
    assert not missing, missing


def test_only_the_model_families_ask_whether_a_config_is_vision_language():
    """Callers ask `rlx.models.family.family_of(config)` and call its bundle; `is_vision_config` stays in rlx.models."""
    users = [
        name
        for name, path in MODULES.items()
        if not name.startswith("rlx.models") and "is_vision_config" in path.read_text()
    ]
    assert not users, users
