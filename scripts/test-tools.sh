#!/bin/sh
# Test-only tools, installed by `make test` (not `make run`):
#  - uidmap (newuidmap/newgidmap): rootless identity-mapping tests (tests/integration) and
#    rootless podman;
#  - CPython's own regression tests (the `test` package) for the compatibility suite
#    (tests/compat), which runs them with /usr/bin/python3;
#  - podman and bubblewrap: tests/integration/test_containers.py runs stockade inside a
#    podman container with its default options;
#  - curl, git (its http-backend and daemon), openssl, npm, ssh and the system Python's pip: the --net allow tests
#    (tests/netfix.py, tests/integration/test_net_allow.py) run them inside and beside the sandbox.
#  - chromium and chromium-driver: tests/integration/test_review_browser.py drives the review page in
#    headless Chromium with Selenium.
#  - xfsprogs: tests/integration/test_disk_quota.py makes an xfs with project quotas (as it makes an
#    ext4 with e2fsprogs) for --disk's project quota.
# Idempotent and silent when everything is present.
set -e
missing=""
command -v newuidmap >/dev/null 2>&1 && command -v newgidmap >/dev/null 2>&1 || missing="$missing uidmap"
if [ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c 'import test.test_os, test.libregrtest' >/dev/null 2>&1; then
    missing="$missing libpython3.$(/usr/bin/python3 -c 'import sys; print(sys.version_info[1])')-testsuite"
fi
command -v podman >/dev/null 2>&1 || missing="$missing podman"
# runc: crun (podman's default runtime) refuses a hybrid cgroup host (v1 with controllers on v2)
command -v runc >/dev/null 2>&1 || missing="$missing runc"
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
for t in curl git openssl npm; do command -v $t >/dev/null 2>&1 || missing="$missing $t"; done
command -v ssh >/dev/null 2>&1 || missing="$missing openssh-client"
[ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c 'import pip' >/dev/null 2>&1 && missing="$missing python3-pip"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v chromedriver >/dev/null 2>&1 || missing="$missing chromium-driver"
command -v mkfs.xfs >/dev/null 2>&1 || missing="$missing xfsprogs"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing test tools:$missing"
    # shellcheck disable=SC2086  # $missing is a space-separated package list
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null 2>&1 || {
        apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null; } ||
        echo "bootstrap: could not install$missing: the tests that need them skip (fail under STOCKADE_MUST_WORK=1)" >&2
else
    echo "bootstrap: note: some tests need test-only packages; run: sudo apt-get install -y$missing" >&2
fi
