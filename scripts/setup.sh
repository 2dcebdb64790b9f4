#!/usr/bin/env bash
# Create .venv with a supported Python (the newest found) and install mxdit with its test extras. Safe to run again:
# an existing .venv with a supported Python is reused and brought up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Python versions for which every dependency in pyproject.toml (test extras included) has wheels, newest first:
# jax 0.11.2 requires >= 3.12; for 3.15, tensorstore (through flax and orbax) and scikit-image have none yet.
SUPPORTED=(3.14 3.13 3.12)
LISTED=$(IFS=/; echo "${SUPPORTED[*]}")  # 3.14/3.13/3.12

is_version() {  # is_version PYTHON X.Y: PYTHON runs and is Python X.Y
    "$1" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$2')" >/dev/null 2>&1
}

find_python() {  # the newest supported Python on PATH or in pyenv's versions (not always on PATH)
    local version candidate
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    for version in "${SUPPORTED[@]}"; do
        for candidate in "python$version" python3 python "$root"/versions/"$version"*/bin/"python$version"; do
            if command -v "$candidate" >/dev/null 2>&1 && is_version "$candidate" "$version"; then
                command -v "$candidate"
                return 0
            fi
        done
    done
    return 1
}

venv_version() {  # X.Y of .venv's Python, if it runs
    .venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null
}

if [ -x .venv/bin/python ] && [[ " ${SUPPORTED[*]} " == *" $(venv_version) "* ]]; then
    echo "setup: reusing .venv ($(.venv/bin/python --version))"
elif [ -e .venv ]; then
    echo "setup: error: .venv exists but is not a Python $LISTED environment; move it away and run this again." >&2
    exit 1
else
    if ! python=$(find_python); then
        echo "setup: error: mxdit needs Python $LISTED (the versions all its dependencies have wheels for; jax" \
             "0.11.2 requires >= 3.12) and none was found." >&2
        echo "setup: install one, e.g. 'pyenv install 3.13', 'apt-get install python3.13-venv' or" \
             "'uv python install 3.13', then run this script again." >&2
        exit 1
    fi
    echo "setup: creating .venv with $python ($("$python" --version))"
    if ! "$python" -m venv .venv; then
        rm -rf .venv
        echo "setup: error: $python cannot create a virtual environment (Debian and Ubuntu: apt-get install" \
             "python$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv)." >&2
        exit 1
    fi
fi
.venv/bin/python -m pip install --quiet -e '.[test]'
echo "setup: mxdit installed in .venv"
