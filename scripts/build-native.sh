#!/bin/sh
# Rebuild only the C extension in place (fast path during development).
set -eu
cd "$(dirname "$0")/.."
.venv/bin/python setup.py -q build_ext --inplace --force 2>&1 | grep -v -e '^running' -e 'warning: no' -e Deprecat -e '^!!' -e '^ *\*\*\*' || true
