#!/usr/bin/env bash
# Kernel-specific tests (pytest -m vm) under a second kernel: Debian 6.1 with cgroup v2
# and Landlock ABI 2, then again with Landlock off (vm_nolandlock). Extra args go to pytest.
#
# The guest is emulated (about 20x slower), so: only the files that hold such tests are
# collected (collecting the whole suite costs minutes in there), each way into a test
# runs once (tests/conftest.py), and the tests are split over VMTEST_SHARDS guests run
# side by side (default: one per host CPU, at most 2), each its own kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
VMTEST=${VMTEST:-../shared/vmtest/vmtest.sh}
PY=.venv/bin/python   # never a pyenv shim in the guest
export STOCKADE_MUST_WORK=${STOCKADE_MUST_WORK:-1}
export VMTEST_TIMEOUT=${VMTEST_TIMEOUT:-3600}
cpus=$(nproc)
SHARDS=${VMTEST_SHARDS:-$(( cpus < 2 ? 1 : 2 ))}

# a path among the arguments chooses the tests; else the files that mark any
files_of() { grep -rlE "mark\.$1\b" tests --include='test_*.py' | sort; }
given_path=0
for a in "$@"; do [[ $a != -* && -e ${a%%::*} ]] && given_path=1; done

phase() {  # phase MARKER SHARD_COUNT [vmtest env...]
    local marker=$1 n=$2; shift 2
    local -a where=()
    [ "$given_path" = 1 ] || mapfile -t where < <(files_of "$marker")
    [ "$given_path" = 1 ] || [ "${#where[@]}" -gt 0 ] || return 0
    local -a args=(-m pytest -q -p no:cacheprovider -m "$marker" "${where[@]}" "$@")
    if [ "$n" -le 1 ]; then
        env "${VMENV[@]}" "$VMTEST" "$PY" "${args[@]}" || { rc=$?; [ "$rc" = 5 ] && return 0; return "$rc"; }
        return 0
    fi
    local dir i fail=0
    dir=$(mktemp -d /tmp/stockade-vm.XXXXXX)
    trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$dir"' INT TERM
    for ((i = 0; i < n; i++)); do
        env "${VMENV[@]}" STOCKADE_VM_SHARD="$i/$n" "$VMTEST" "$PY" "${args[@]}" >"$dir/$i.out" 2>&1 &
        echo $! >"$dir/$i.pid"
    done
    for ((i = 0; i < n; i++)); do
        rc=0; wait "$(cat "$dir/$i.pid")" || rc=$?
        echo "=== second kernel, shard $((i + 1)) of $n (exit $rc) ==="
        cat "$dir/$i.out"
        [ "$rc" = 0 ] || [ "$rc" = 5 ] || fail=$rc
    done
    rm -rf "$dir"
    trap - INT TERM
    return "$fail"
}

# vmtest.sh makes its guest kernel and initramfs on first use (apt-get, a build): two
# shards starting at once would both make them, and one loses apt's lock (exit 125).
# Made once here, before the shards, when missing (the same cache vmtest.sh reads).
cache=${VMTEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vmtest}
if [ "$SHARDS" -gt 1 ] && { [ ! -s "$cache/kernel/vmlinux" ] || [ ! -s "$cache/initramfs.cpio" ]; }; then
    echo "test-vm: making the guest's kernel and initramfs once, before the shards" >&2
    "$(dirname "$VMTEST")/setup.sh" >&2
fi

VMENV=()
phase vm "$SHARDS" "$@"
VMENV=(VMTEST_APPEND="lsm=lockdown,yama")
phase vm_nolandlock 1 "$@"
