#!/bin/sh
# `make install`: a user install, pipx-style, with no pipx needed. A wheel of this
# tree goes into its own venv under $PREFIX/share/stockade (the distribution's
# Python refuses `pip install --user`, PEP 668), and $PREFIX/bin/stockade links to it.
# PREFIX defaults to ~/.local (root: /usr/local). PYTHON picks the interpreter.
set -eu
cd "$(dirname "$0")/.."
if [ -z "${PREFIX:-}" ]; then
    if [ "$(id -u)" = 0 ]; then PREFIX=/usr/local; else PREFIX="$HOME/.local"; fi
fi
PY=${PYTHON:-python3}
VENV="$PREFIX/share/stockade/venv"
closed=$(./scripts/private-interp.sh "$PY" || true)
if [ -n "$closed" ]; then
    echo "install: note: $PY is under $closed, which other users cannot enter: only $(id -un) can run this install (PYTHON=/usr/bin/python3 make install for one every user can run)" >&2
fi
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" . >/dev/null
# a venv records its own path, so it is built where it stays, in a new directory;
# then one rename of a symlink swaps it in (a failed install leaves the old one)
BASE="$PREFIX/share/stockade"
mkdir -p "$BASE"
NEW=$(mktemp -d "$BASE/venv-XXXXXX")
chmod 755 "$NEW"
"$PY" -m venv "$NEW"
"$NEW/bin/python" -m pip install -q "$wheels"/stockade-*.whl
"$NEW/bin/python" -m compileall -q "$NEW" >/dev/null 2>&1 || true
ln -sfn "$(basename "$NEW")" "$BASE/venv.tmp"
mv -T "$BASE/venv.tmp" "$VENV"
for old in "$BASE"/venv-*; do
    [ "$old" = "$NEW" ] || rm -rf "$old"
done
mkdir -p "$PREFIX/bin"
ln -sfn "$VENV/bin/stockade" "$PREFIX/bin/stockade"
echo "installed: $PREFIX/bin/stockade ($("$PREFIX/bin/stockade" --version 2>/dev/null || echo stockade))"
case ":$PATH:" in *":$PREFIX/bin:"*) ;; *) echo "note: $PREFIX/bin is not on your PATH; add it: export PATH=\"$PREFIX/bin:\$PATH\"" ;; esac
