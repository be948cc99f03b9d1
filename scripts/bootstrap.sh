#!/bin/sh
# Creates .venv, installs stockade (editable, C core built) and the dev tools.
# python-prctl compiles against libcap's headers: install libcap-dev when missing.
set -eu
PY=${PYTHON:-python3}
if [ ! -e /usr/include/sys/capability.h ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing libcap-dev (headers python-prctl builds against)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q libcap-dev >/dev/null 2>&1 || {
            apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libcap-dev >/dev/null; }
    else
        echo "bootstrap: libcap-dev is missing; run: sudo apt-get install -y libcap-dev" >&2
        exit 1
    fi
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# A venv runs its interpreter from where it was made: under a 0700 home, nobody
# else (uid 65534, `--user`, CI's build user) can start it.
closed=$(./scripts/private-interp.sh .venv/bin/python || true)
if [ -n "$closed" ]; then
    echo "bootstrap: note: .venv's interpreter $(readlink -f .venv/bin/python) is under $closed, which other users cannot enter: only $(id -un) can run this stockade. For a venv every user can run: make clean && PYTHON=/usr/bin/python3 make run" >&2
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel cffi >/dev/null
.venv/bin/python -m pip install -q --no-build-isolation -e '.[dev]'
# Byte-compile now: with PYTHONDONTWRITEBYTECODE set (common on CI) every CLI start
# would otherwise recompile the package from source.
.venv/bin/python -m compileall -q src >/dev/null
touch .venv/.bootstrapped
