"""The pure core stays pure: no Azure, aiohttp, MPI, file system, sockets or event loop.

Checked statically with ``ast`` (nothing is imported to check it), directly and through the
``azcp_cluster.*`` modules the pure ones import.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = "azcp_cluster"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

# The pure core is a folder: every module in it is pure (and only reaches pure modules). Pure
# modules elsewhere are named here (their folder is their concern, not their purity).
CORE = "core"
PURE_ELSEWHERE = ("azure.proxies",)
PURE_MODULES = (
    *sorted(f"{CORE}.{p.stem}" for p in (PACKAGE_DIR / CORE).glob("*.py") if p.stem != "__init__"),
    *PURE_ELSEWHERE,
)
FORBIDDEN = frozenset(
    {"azure", "aiohttp", "mpi4py", "os", "io", "shutil", "socket", "mmap", "pathlib", "asyncio", "importlib"}
)
FORBIDDEN_CALLS = frozenset({"open", "__import__", "exec", "eval"})


@dataclass
class Findings:
    imports: set[str] = field(default_factory=set)  # absolute dotted module names
    calls: list[str] = field(default_factory=list)  # forbidden calls, as "name (line N)"


def scan(source: str, module: str) -> Findings:
    """Every module ``source`` imports (anywhere, including inside functions) and its forbidden calls."""
    found = Findings()
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.imports.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts)
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.imports.add(target)
            # "from azcp_cluster.core import plan" imports the submodule azcp_cluster.core.plan.
            found.imports.update(f"{target}.{alias.name}" for alias in node.names if _is_package(target))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in FORBIDDEN_CALLS:
                found.calls.append(f"{name} (line {node.lineno})")
    return found


def _is_package(module: str) -> bool:
    """Whether ``module`` is the package or one of its folders (whose names may be submodules)."""
    parts = module.split(".")
    return parts[0] == PACKAGE and (PACKAGE_DIR.joinpath(*parts[1:]) / "__init__.py").is_file()


def top(module: str) -> str:
    return module.split(".")[0]


def module_file(module: str) -> Path | None:
    """The source file of an ``azcp_cluster.*`` module, or None for a name that is not a module."""
    parts = module.split(".")[1:]
    if not parts:
        return PACKAGE_DIR / "__init__.py"
    rel = Path(*parts)
    for candidate in (PACKAGE_DIR / rel.with_suffix(".py"), PACKAGE_DIR / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def closure(start: str) -> dict[str, Findings]:
    """``start`` and every ``azcp_cluster.*`` module it reaches through imports, scanned."""
    seen: dict[str, Findings] = {}
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        path = module_file(module)
        if path is None:
            continue
        seen[module] = scan(path.read_text(encoding="utf-8"), module)
        todo.extend(m for m in seen[module].imports if top(m) == PACKAGE)
    return seen


# ---------------------------------------------------------------------------------------
# The checker itself catches what it should (so the real test cannot pass vacuously).


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os", {"os"}),
        ("import os.path as p", {"os.path"}),
        ("from pathlib import Path", {"pathlib"}),
        ("def f():\n    import asyncio\n", {"asyncio"}),
        ("from azure.storage.blob import X", {"azure.storage.blob"}),
        ("from . import plan", {"azcp_cluster.core", "azcp_cluster.core.plan"}),
        ("from .model import FileEntry", {"azcp_cluster.core.model"}),
        ("from .. import api", {"azcp_cluster", "azcp_cluster.api"}),
        ("from azcp_cluster import errors", {"azcp_cluster", "azcp_cluster.errors"}),
        ("from azcp_cluster.core import errors", {"azcp_cluster.core", "azcp_cluster.core.errors"}),
    ],
)
def test_scanner_sees_imports(source: str, expected: set[str]) -> None:
    assert scan(source, f"{PACKAGE}.core.example").imports == expected


def test_scanner_sees_open_calls() -> None:
    assert scan("with open('f') as f:\n    pass\n", "m").calls == ["open (line 1)"]
    assert scan("import io\nio.open('f')\n", "m").calls == ["open (line 2)"]
    assert scan("x = opener('f')\n", "m").calls == []


def test_closure_follows_package_imports() -> None:
    reached = closure(f"{PACKAGE}.core.schedule")
    assert f"{PACKAGE}.core.plan" in reached
    assert f"{PACKAGE}.core.naming" in closure(f"{PACKAGE}.core.naming")
    assert {f"{PACKAGE}.core.errors", f"{PACKAGE}.core.model"} <= set(closure(f"{PACKAGE}.core.naming"))
    # An impure module is reached and flagged: the check would fail for it.
    impure = closure(f"{PACKAGE}.dest.localfs")[f"{PACKAGE}.dest.localfs"]
    assert "os" in impure.imports
    assert PACKAGE in closure(PACKAGE)  # the package itself resolves to its __init__.py


# ---------------------------------------------------------------------------------------
# The real check


@pytest.mark.parametrize("name", PURE_MODULES)
def test_pure_module_imports_nothing_impure(name: str) -> None:
    module = f"{PACKAGE}.{name}"
    assert module_file(module) is not None, f"{module} is missing"
    problems = []
    for reached, found in sorted(closure(module).items()):
        bad = sorted(m for m in found.imports if top(m) in FORBIDDEN)
        if bad:
            problems.append(f"{reached} imports {', '.join(bad)}")
        if found.calls:
            problems.append(f"{reached} calls {', '.join(found.calls)}")
    assert not problems, f"{module} is not pure: " + "; ".join(problems)


def test_pure_modules_only_reach_pure_modules() -> None:
    pure = {f"{PACKAGE}.{name}" for name in PURE_MODULES} | {PACKAGE, f"{PACKAGE}.{CORE}", f"{PACKAGE}.azure"}
    for name in PURE_MODULES:
        reached = set(closure(f"{PACKAGE}.{name}"))
        assert reached <= pure, f"{name} reaches {sorted(reached - pure)}"


def test_the_core_folder_holds_the_pure_modules() -> None:
    assert len(PURE_MODULES) >= 14 and f"{CORE}.fanout" in PURE_MODULES and f"{CORE}.plan" in PURE_MODULES


# ---------------------------------------------------------------------------------------
# Layers: nothing imports upward. A folder may import its own modules and any lower layer's.

LAYERS = (
    ("core",),
    ("run",),  # the cluster's agreements, signals, progress, the report
    ("azure", "dest"),  # Azure's client and credentials; the node's copy on disk
    ("download",),
    ("fanout",),
    ("stages",),
    ("pipeline",),
    ("api", "options"),
    ("cli", "__main__"),
    ("devtools",),  # the emulator, the box, the demo, the docs' tables: they use the tool; it never uses them
)


def layer_of(module: str) -> int:
    """The layer of ``azcp_cluster.X[.Y]`` (its folder, or its own name at the top level)."""
    parts = module.split(".")
    if len(parts) < 2:
        return -1  # the package's __init__: version and lazy names only
    for index, names in enumerate(LAYERS):
        if parts[1] in names:
            return index
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")


def _modules() -> list[str]:
    return sorted(
        ".".join((PACKAGE, *p.relative_to(PACKAGE_DIR).with_suffix("").parts)).removesuffix(".__init__")
        for p in PACKAGE_DIR.rglob("*.py")
    )


def test_nothing_imports_upward() -> None:
    upward = []
    for module in _modules():
        path = module_file(module)
        assert path is not None
        mine = layer_of(module)
        for target in scan(path.read_text(encoding="utf-8"), module).imports:
            if top(target) == PACKAGE and module_file(target) is not None and layer_of(target) > mine:
                upward.append(f"{module} imports {target}")
    assert not upward, "\n".join(sorted(upward))


def test_the_layering_check_sees_an_upward_import() -> None:
    found = scan("from azcp_cluster.fanout import driver", f"{PACKAGE}.core.plan").imports
    assert any(layer_of(t) > layer_of(f"{PACKAGE}.core.plan") for t in found if top(t) == PACKAGE)


def test_the_package_top_level_is_small() -> None:
    top_modules = [p for p in PACKAGE_DIR.glob("*.py")]
    assert len(top_modules) <= 12, sorted(p.name for p in top_modules)


def test_mpi4py_is_imported_by_at_most_two_modules() -> None:
    # MPI's start and end (run/mpi.py) and the fan-out's transport: everything else gets a
    # communicator passed in, so that it can run in process without MPI.
    importers = sorted(
        module
        for module in _modules()
        if any(top(m) == "mpi4py" for m in scan(module_file(module).read_text(encoding="utf-8"), module).imports)  # type: ignore[union-attr]
    )
    assert len(importers) <= 2, importers
