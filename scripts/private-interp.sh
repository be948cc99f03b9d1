#!/bin/sh
# Prints the first directory on the way to interpreter $1 that other users cannot
# enter (a pyenv under a 0700 home): a venv made from it is unusable to them, and
# so are unprivileged runs of stockade through it. Prints nothing when all is open.
set -eu
# ask the interpreter: a pyenv shim is a script that runs another one
p=$("$1" -c 'import os, sys; print(os.path.realpath(sys.executable))')
d=$(dirname "$p")
while :; do
    # others need search (x) permission on every directory on the way
    if [ "$(( $(stat -c %a "$d" | sed 's/^0*//;s/^$/0/') % 10 & 1 ))" = 0 ]; then
        echo "$d"
        exit 0
    fi
    [ "$d" = / ] && break
    d=$(dirname "$d")
done
