#!/usr/bin/env bash
# Builds and installs the Python package `nucleus` (pip install ./bindings/python: maturin, a
# release build of the extension) into a virtual environment at
# bindings/python/target/venv, then runs its tests. Extra arguments go to pytest;
# `--install-only` stops after the install (.ci/run then runs pytest itself).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/target/venv"
if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$here/target"
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements-test.txt"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$here"
if [ "${1:-}" = --install-only ]; then
    exit 0
fi
cd "$here"
export PYTHONDONTWRITEBYTECODE=1
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
