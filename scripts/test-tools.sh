#!/bin/sh
# Test-only tools, installed by `make test` (not `make run`): CPython's own regression
# tests (the `test` package) for the compatibility suite (tests/compat), which runs
# them with /usr/bin/python3.
set -e
if [ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c 'import test.test_os, test.libregrtest' >/dev/null 2>&1; then
    testsuite="libpython3.$(/usr/bin/python3 -c 'import sys; print(sys.version_info[1])')-testsuite"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing $testsuite (CPython's regression tests, for tests/compat)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$testsuite" >/dev/null 2>&1 || {
            apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$testsuite" >/dev/null; } ||
            echo "bootstrap: could not install $testsuite: tests/compat will skip (fail under STOCKADE_MUST_WORK=1)" >&2
    else
        echo "bootstrap: note: tests/compat needs CPython's test package; run: sudo apt-get install -y $testsuite" >&2
    fi
fi
