"""No module of the package is over 500 lines, no function outside devtools/ over 60 lines
(issue 39; devtools' own at most 80, issue 26's limit) nor over cyclomatic complexity 20.

Checked statically with ``ast``, as tests/test_purity.py checks the layering: a module is its
lines, a function (or method, or a function nested in one) the lines from its ``def`` to its
last, its docstring included. The complexity is radon's (``radon cc``: the number of
independent paths through a function, a nested function counted on its own), skipped where
radon is not installed (it is a test tool: pyproject.toml's ``test-tools``).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = "azcp_cluster"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
# The development tools (the emulator, the demo, the cluster in a box, the proxies of the
# tests) are no part of a run: the looser limit of issue 26 holds there, and no complexity one.
DEVTOOLS = "devtools/"
MAX_DEVTOOLS_FUNCTION_LINES = 80
MAX_COMPLEXITY = 20
HAVE_RADON = importlib.util.find_spec("radon") is not None

# Over the limits, each with the reason. Each entry must still be over its limit
# (test_the_allowlist_holds_only_what_is_still_too_long): drop it once it is not.
ALLOWED_MODULES: frozenset[str] = frozenset()
ALLOWED_FUNCTIONS: frozenset[str] = frozenset()
ALLOWED_COMPLEX: frozenset[str] = frozenset()


def function_lengths(source: str) -> dict[str, int]:
    """Every function of ``source`` by qualified name (``Class.method``, ``outer.inner``): its lines."""
    lengths: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lengths[name] = child.end_lineno - child.lineno + 1
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return lengths


def modules() -> dict[str, str]:
    """Every module of the package by its path below the package ("core/plan.py"): its source."""
    return {
        p.relative_to(PACKAGE_DIR).as_posix(): p.read_text(encoding="utf-8") for p in sorted(PACKAGE_DIR.rglob("*.py"))
    }


def function_limit(path: str) -> int:
    """The most lines a function of the module at ``path`` (below the package) may have."""
    return MAX_DEVTOOLS_FUNCTION_LINES if path.startswith(DEVTOOLS) else MAX_FUNCTION_LINES


def too_long(sources: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
    """The modules over :data:`MAX_MODULE_LINES` and the functions (``path::name``) over their
    module's :func:`function_limit`, with their lines, allowed or not."""
    long_modules = {path: len(s.splitlines()) for path, s in sources.items() if len(s.splitlines()) > MAX_MODULE_LINES}
    long_functions = {
        f"{path}::{name}": lines
        for path, source in sources.items()
        for name, lines in function_lengths(source).items()
        if lines > function_limit(path)
    }
    return long_modules, long_functions


def complexities(source: str) -> dict[str, int]:
    """radon's cyclomatic complexity of every function of ``source``, named as
    :func:`function_lengths` names them (a nested function on its own, as ``radon cc`` counts it)."""
    from radon.complexity import cc_visit
    from radon.visitors import Class, Function

    found: dict[str, int] = {}

    def add(block: Function | Class, prefix: str) -> None:
        if isinstance(block, Class):
            for inner in (*block.methods, *block.inner_classes):
                add(inner, f"{prefix}{block.name}.")
            return
        found[prefix + block.name] = block.complexity
        for closure in block.closures:
            add(closure, f"{prefix}{block.name}.")

    for block in cc_visit(source):
        if not (isinstance(block, Function) and block.is_method):  # a method is met again in its class
            add(block, "")
    return found


def too_complex(sources: dict[str, str]) -> dict[str, int]:
    """The functions (``path::name``) outside devtools/ over :data:`MAX_COMPLEXITY`, allowed or not."""
    return {
        f"{path}::{name}": complexity
        for path, source in sources.items()
        if not path.startswith(DEVTOOLS)
        for name, complexity in complexities(source).items()
        if complexity > MAX_COMPLEXITY
    }


# ---------------------------------------------------------------------------------------
# The checker itself catches what it should (so the real test cannot pass vacuously).


def _function(name: str, lines: int, indent: str = "") -> str:
    """The source of a function of ``lines`` lines, its ``def`` line included."""
    return f"{indent}def {name}():\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))


def _branchy(name: str, branches: int, indent: str = "") -> str:
    """The source of a function of cyclomatic complexity ``branches + 1`` (one ``if`` each)."""
    return f"{indent}def {name}(x):\n" + "".join(
        f"{indent}    if x == {i}:\n{indent}        x = 0\n" for i in range(branches)
    )


def test_the_checker_sees_long_functions_at_any_depth_and_long_modules() -> None:
    source = (
        _function("long", 61)
        + "class C:\n"
        + _function("method", 61, "    ")
        + "def outer():\n"
        + _function("inner", 60, "    ")
        + "    return inner\n"
        + _function("short", 2)
    )
    lengths = function_lengths(source)
    assert lengths == {"long": 61, "C.method": 61, "outer": 62, "outer.inner": 60, "short": 2}
    devtools = _function("tool", 80) + _function("too_long_a_tool", 81)
    modules_over, functions_over = too_long(
        {"m.py": source, "devtools/d.py": devtools, "big.py": "x = 1\n" * 501, "ok.py": "x = 1\n" * 500}
    )
    assert modules_over == {"big.py": 501}
    assert functions_over == {
        "m.py::long": 61,
        "m.py::C.method": 61,
        "m.py::outer": 62,
        "devtools/d.py::too_long_a_tool": 81,
    }


@pytest.mark.skipif(not HAVE_RADON, reason="radon is not installed (pyproject.toml's test-tools)")
def test_the_checker_sees_complex_functions_at_any_depth_outside_devtools() -> None:
    source = (
        _branchy("complex", 20)
        + _branchy("simple", 19)
        + "class C:\n"
        + _branchy("method", 20, "    ")
        + "    class D:\n"
        + _branchy("deep", 21, "        ")
        + "def outer():\n"
        + _branchy("inner", 20, "    ")
        + "    return inner\n"
    )
    assert complexities(source) == {
        "complex": 21,
        "simple": 20,
        "C.method": 21,
        "C.D.deep": 22,
        "outer": 1,  # a nested function is counted on its own, as radon cc does
        "outer.inner": 21,
    }
    assert too_complex({"m.py": source, "devtools/d.py": _branchy("tool", 30)}) == {
        "m.py::complex": 21,
        "m.py::C.method": 21,
        "m.py::C.D.deep": 22,
        "m.py::outer.inner": 21,
    }


# ---------------------------------------------------------------------------------------
# The real check


def test_no_module_is_over_500_lines() -> None:
    modules_over, _ = too_long(modules())
    over = {path: lines for path, lines in modules_over.items() if path not in ALLOWED_MODULES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them): {over}"


def test_no_function_is_over_60_lines_outside_devtools_nor_over_80_there() -> None:
    _, functions_over = too_long(modules())
    over = {name: lines for name, lines in functions_over.items() if name not in ALLOWED_FUNCTIONS}
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines ({MAX_DEVTOOLS_FUNCTION_LINES} in {DEVTOOLS}; cut them at "
        f"their seams): {over}"
    )


@pytest.mark.skipif(not HAVE_RADON, reason="radon is not installed (pyproject.toml's test-tools)")
def test_no_function_outside_devtools_is_over_complexity_20() -> None:
    over = {name: cc for name, cc in too_complex(modules()).items() if name not in ALLOWED_COMPLEX}
    assert not over, f"functions over cyclomatic complexity {MAX_COMPLEXITY} (radon; cut them at their seams): {over}"


def test_the_allowlist_holds_only_what_is_still_too_long() -> None:
    modules_over, functions_over = too_long(modules())
    stale = sorted(e for e in ALLOWED_MODULES | ALLOWED_FUNCTIONS if e not in modules_over and e not in functions_over)
    if HAVE_RADON:
        complex_now = too_complex(modules())
        stale += sorted(e for e in ALLOWED_COMPLEX if e not in complex_now)
    assert not stale, f"within the limits now: drop {stale}"
