"""No module of the package is over 500 lines, and no function over 80 (issue 26).

Checked statically with ``ast``, as tests/test_purity.py checks the layering: a module is its
lines, a function (or method, or a function nested in one) the lines from its ``def`` to its
last. ``options.build_parser``, the CLI's declarative parser, is within the limit and needs
no exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "azcp_cluster"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

# Over the limits, each with the reason (none now). Each entry must still be over its limit
# (test_the_allowlist_holds_only_what_is_still_too_long): drop it once it is not.
ALLOWED_MODULES: frozenset[str] = frozenset()
ALLOWED_FUNCTIONS: frozenset[str] = frozenset()


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


def too_long(sources: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
    """The modules over :data:`MAX_MODULE_LINES` and the functions (``path::name``) over
    :data:`MAX_FUNCTION_LINES`, with their lines, allowed or not."""
    long_modules = {path: len(s.splitlines()) for path, s in sources.items() if len(s.splitlines()) > MAX_MODULE_LINES}
    long_functions = {
        f"{path}::{name}": lines
        for path, source in sources.items()
        for name, lines in function_lengths(source).items()
        if lines > MAX_FUNCTION_LINES
    }
    return long_modules, long_functions


# ---------------------------------------------------------------------------------------
# The checker itself catches what it should (so the real test cannot pass vacuously).


def _function(name: str, lines: int, indent: str = "") -> str:
    """The source of a function of ``lines`` lines, its ``def`` line included."""
    return f"{indent}def {name}():\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))


def test_the_checker_sees_long_functions_at_any_depth_and_long_modules() -> None:
    source = (
        _function("long", 81)
        + "class C:\n"
        + _function("method", 81, "    ")
        + "def outer():\n"
        + _function("inner", 80, "    ")
        + "    return inner\n"
        + _function("short", 2)
    )
    lengths = function_lengths(source)
    assert lengths == {"long": 81, "C.method": 81, "outer": 82, "outer.inner": 80, "short": 2}
    modules_over, functions_over = too_long({"m.py": source, "big.py": "x = 1\n" * 501, "ok.py": "x = 1\n" * 500})
    assert modules_over == {"big.py": 501}
    assert functions_over == {"m.py::long": 81, "m.py::C.method": 81, "m.py::outer": 82}


# ---------------------------------------------------------------------------------------
# The real check


def test_no_module_is_over_500_lines() -> None:
    modules_over, _ = too_long(modules())
    over = {path: lines for path, lines in modules_over.items() if path not in ALLOWED_MODULES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them): {over}"


def test_no_function_is_over_80_lines() -> None:
    _, functions_over = too_long(modules())
    over = {name: lines for name, lines in functions_over.items() if name not in ALLOWED_FUNCTIONS}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (extract helpers): {over}"


def test_the_allowlist_holds_only_what_is_still_too_long() -> None:
    modules_over, functions_over = too_long(modules())
    stale = sorted(e for e in ALLOWED_MODULES | ALLOWED_FUNCTIONS if e not in modules_over and e not in functions_over)
    assert not stale, f"within the limits now: drop {stale}"
