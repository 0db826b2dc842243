#!/usr/bin/env bash
# Install everything the demo, the tests and the benchmarks need, into the repository:
# a virtual environment (.venv) with the package, its test extra (pytest, an MPICH
# runtime wheel, mypy, ruff), and the pinned Azure Storage emulator (node_modules).
# Idempotent and quick when nothing changed. Source it or run it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "bootstrap: Python >= 3.10 is required (set PYTHON=...)" >&2
    exit 1
fi
command -v npm >/dev/null || { echo "bootstrap: npm (Node.js >= 18) is required for the emulator" >&2; exit 1; }

stamp=".venv/.azcp-bootstrap"
want="$(cat pyproject.toml package.json package-lock.json 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x node_modules/.bin/azurite-blob ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
if [ -f package-lock.json ]; then
    npm ci --no-audit --no-fund --loglevel=error
else
    npm install --no-audit --no-fund --loglevel=error
fi
echo "$want" > "$stamp"
