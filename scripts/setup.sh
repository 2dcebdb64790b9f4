#!/usr/bin/env bash
# Create .venv with Python 3.12 and install mxdit with its test extras. Safe to run again: an existing .venv with
# Python 3.12 is reused and brought up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
    local candidate
    for candidate in python3.12 python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    # pyenv installs are not always on PATH.
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    for candidate in "$root"/versions/3.12*/bin/python3.12; do
        if [ -x "$candidate" ]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if [ -x .venv/bin/python ] && .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    echo "setup: reusing .venv ($(.venv/bin/python --version))"
elif [ -e .venv ]; then
    echo "setup: error: .venv exists but is not a Python 3.12 environment; move it away and run this again." >&2
    exit 1
else
    if ! python=$(find_python312); then
        echo "setup: error: mxdit needs Python 3.12 (jax 0.11.2 requires it) and none was found." >&2
        echo "setup: install one, e.g. 'pyenv install 3.12', 'apt-get install python3.12-venv' or 'uv python install 3.12'," >&2
        echo "setup: then run this script again." >&2
        exit 1
    fi
    echo "setup: creating .venv with $python ($("$python" --version))"
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet -e '.[test]'
echo "setup: mxdit installed in .venv"
