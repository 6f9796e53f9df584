#!/usr/bin/env bash
# Runs the Python integration tests of `nucleus serve` against an already built binary:
# $NUCLEUS_BIN if set, else <repo>/target/debug/nucleus. Builds nothing.
# The virtual environment lives in <repo>/target/python-venv; extra arguments go to pytest.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$repo/target/python-venv"
requirements="$repo/tests/python/requirements.txt"

if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$repo/target"
    python3 -m venv "$venv"
fi
# Install (quietly) only when the requirements changed since the last install.
stamp="$venv/.requirements.txt"
if ! cmp -s "$requirements" "$stamp"; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
    cp "$requirements" "$stamp"
fi

cd "$repo"
export PYTHONDONTWRITEBYTECODE=1
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python "$@"
