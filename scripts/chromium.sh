#!/usr/bin/env bash
# Make sure Chromium is there for the course site's browser test (arithlib.course.browse):
# install Debian's chromium with apt-get when it is missing (as root), then print its path.
# .ci/run calls it before the tests and sets ARITHLIB_REQUIRE_BROWSER, so that the test
# fails instead of skipping when no browser can be found.
set -euo pipefail
say() { echo "[chromium] $*" >&2; }
if [ -n "${ARITHLIB_CHROMIUM:-}" ]; then echo "$ARITHLIB_CHROMIUM"; exit 0; fi
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "ERROR: chromium is not installed, and installing it needs root and apt-get (Debian/Ubuntu): apt-get install chromium"
        exit 2
    fi
    say "installing chromium (apt-get)"
    log="${TMPDIR:-/tmp}/chromium_apt.log"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >"$log" 2>&1 || {
        apt-get update -q >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >"$log" 2>&1
    } || { say "ERROR: apt-get install chromium failed (see $log)"; exit 1; }
fi
command -v chromium
