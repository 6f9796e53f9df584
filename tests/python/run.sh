#!/usr/bin/env bash
# Runs the Python integration tests of `nucleus serve` against an already built binary:
# $NUCLEUS_BIN if set, else <repo>/target/debug/nucleus. Builds nothing; installs Debian's
# chromium and chromium-driver for the page test when they are missing (install-chromium.sh).
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

# The page test (test_page.py) drives Debian's Chromium: install it when missing. If that
# fails, the test fails with the reason (it does not skip).
chromium_log="$repo/target/install-chromium.log"
if ! bash "$repo/tests/python/install-chromium.sh" >"$chromium_log" 2>&1; then
    reason="$(tail -n 1 "$chromium_log")"
    echo "run.sh: Chromium is not installed, so the page test will fail: $reason" >&2
    export NUCLEUS_CHROMIUM_MISSING="$reason (full output: $chromium_log)"
fi
# Selenium must not download a browser or a driver.
export SE_OFFLINE=true

cd "$repo"
export PYTHONDONTWRITEBYTECODE=1
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python "$@"
