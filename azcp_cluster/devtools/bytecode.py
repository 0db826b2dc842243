"""The package's modules compiled once, before many runs of it start.

An installed copy is compiled by pip; a checkout is compiled by the first interpreter that
imports it, unless PYTHONDONTWRITEBYTECODE is set (this sandbox sets it), in which case every
process compiles every module it imports, every time: 0.2 s of CPU per rank here, so about
0.2 s of every `mpiexec -n 4` the tests start on two cores, and some of it inside a
benchmark's timed stages. Compiling explicitly writes the bytecode whatever that variable says.
"""

from __future__ import annotations

import compileall
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def compile_package() -> bool:
    """Compile every module of ``azcp_cluster`` that is not compiled yet, or changed since; True
    if every one compiled (a module that does not compile fails where it is imported, as before)."""
    return bool(compileall.compile_dir(PACKAGE, quiet=2))
