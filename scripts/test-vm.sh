#!/usr/bin/env bash
# Kernel-specific tests (pytest -m vm) under a second kernel: Debian 6.1 with cgroup v2
# and Landlock ABI 2, then again with Landlock off (vm_nolandlock). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VMTEST=${VMTEST:-../shared/vmtest/vmtest.sh}
PY=.venv/bin/python   # never a pyenv shim in the guest
export STOCKADE_MUST_WORK=${STOCKADE_MUST_WORK:-1}
# the vm suite outgrew vmtest's default 30 minutes under software emulation
export VMTEST_TIMEOUT=${VMTEST_TIMEOUT:-3600}
"$VMTEST" "$PY" -m pytest -q -p no:cacheprovider -m vm tests "$@"
VMTEST_APPEND="lsm=lockdown,yama" "$VMTEST" "$PY" -m pytest -q -p no:cacheprovider -m vm_nolandlock tests "$@" || {
    rc=$?; [ "$rc" = 5 ] || exit "$rc"   # 5 = no tests collected
}
