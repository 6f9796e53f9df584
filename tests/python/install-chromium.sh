#!/usr/bin/env bash
# Installs Debian's headless-capable Chromium and its WebDriver for tests/python/test_page.py:
# /usr/bin/chromium and /usr/bin/chromedriver. Does nothing when both are there; otherwise
# `apt-get update` and `apt-get install chromium chromium-driver` (as root, or through
# `sudo -n`). Downloads no browser of its own. On failure the last line it prints says why,
# and it exits non-zero.
set -uo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
fail() {
    echo "install-chromium.sh: $*" >&2
    exit 1
}
command -v apt-get >/dev/null 2>&1 ||
    fail "no apt-get on this machine: install chromium and chromedriver at /usr/bin by hand to run the page test"
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    fail "not root and no password-less sudo: cannot apt-get install chromium chromium-driver"
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq ||
    fail "apt-get update failed (is a Debian mirror reachable?)"
"${as_root[@]}" apt-get install -y -qq --no-install-recommends chromium chromium-driver ||
    fail "apt-get install chromium chromium-driver failed"
[ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] ||
    fail "apt-get installed chromium, but /usr/bin/chromium or /usr/bin/chromedriver is missing"
