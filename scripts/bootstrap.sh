#!/usr/bin/env bash
# Install everything the demo, the tests and the benchmarks need, into the repository:
# a virtual environment (.venv) with the package, its test extra (pytest, an MPICH
# runtime wheel, mypy, ruff), and the pinned Azure Storage emulator (node_modules).
# Idempotent: each part is redone only when its inputs changed (pyproject.toml for .venv,
# package.json and package-lock.json for node_modules), and it prints nothing when nothing
# did. Before each step it says what it installs and about how long it takes.
# Run it (scripts/demo and scripts/test do).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "bootstrap: Python >= 3.10 is required (set PYTHON=...)" >&2
    exit 1
fi
command -v npm >/dev/null || { echo "bootstrap: npm (Node.js >= 18) is required for the emulator" >&2; exit 1; }

say() { echo "bootstrap: $*" >&2; }
started=$SECONDS
did=""

py_stamp=".venv/.azcp-bootstrap"
py_want="$(sha256sum < pyproject.toml | cut -d' ' -f1)"
if ! { [ -f "$py_stamp" ] && [ "$(cat "$py_stamp")" = "$py_want" ] && [ -x .venv/bin/python ]; }; then
    what="the package (editable) with its test tools (pytest, hypothesis, mypy, ruff, radon, shellcheck, hadolint, an MPICH wheel)"
    if [ -x .venv/bin/python ]; then
        say "pyproject.toml changed: updating .venv, $what: about 30 s"
    else
        say "creating .venv and installing $what: 1 to 2 minutes"
        "$python" -m venv .venv
    fi
    # pip's and npm's output goes to stderr: stdout is the demo's (scripts/demo runs this first).
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]' >&2
    echo "$py_want" > "$py_stamp"
    did=1
fi

# The stamp lives inside node_modules, which `npm ci` empties first: it is there only after a complete install.
node_stamp="node_modules/.azcp-bootstrap"
node_want="$(cat package.json package-lock.json 2>/dev/null | sha256sum | cut -d' ' -f1)"
if ! { [ -f "$node_stamp" ] && [ "$(cat "$node_stamp")" = "$node_want" ] && [ -x node_modules/.bin/azurite-blob ]; }; then
    if [ -f package-lock.json ]; then
        say "installing the Azure Storage emulator (Azurite, pinned in package-lock.json) into node_modules with npm ci: 20 to 40 s"
        npm ci --no-audit --no-fund --loglevel=error >&2
    else
        say "installing the Azure Storage emulator (Azurite) into node_modules with npm install: 20 to 40 s"
        npm install --no-audit --no-fund --loglevel=error >&2
    fi
    echo "$node_want" > "$node_stamp"
    did=1
fi

if [ -n "$did" ]; then
    say "ready in $((SECONDS - started)) s (a second run does nothing until pyproject.toml or package-lock.json change)"
fi
