"""Compatibility: git and make give the same output inside `stockade run` as bare.

One shell script per tool runs in a fresh copy of the same project on each side, as
root and as uid 65534; its output and exit status must be equal. Commit dates and
authors are fixed, so commit ids are equal too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import User, need

from .harness import Side

GIT = r"""
set -e
export GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1
export GIT_AUTHOR_NAME=A GIT_AUTHOR_EMAIL=a@example.org GIT_COMMITTER_NAME=A GIT_COMMITTER_EMAIL=a@example.org
export GIT_AUTHOR_DATE='2024-01-01T00:00:00Z' GIT_COMMITTER_DATE='2024-01-01T00:00:00Z'
cd repo
git init -q -b main .
printf 'one\n' > a.txt; git add a.txt; git commit -q -m one
printf 'two\n' >> a.txt; git commit -q -am two
git checkout -q -b topic HEAD~1; printf 'x\n' > b.txt; git add b.txt; git commit -q -m topic
git checkout -q main
git rebase -q main topic; git log --format='%H %s' topic; git checkout -q main
printf 'dirty\n' >> a.txt; git stash -q; git stash list; git status --short; git stash pop -q; git diff --stat
git worktree add -q ../wt topic; git -C ../wt log -1 --format='%H %s'; git worktree list --porcelain | sed "s|$PWD/..|P|"
git gc -q; git fsck --no-progress; git count-objects -v | grep -v size
"""

MAKE = r"""
set -e
cd repo
cat > hello.c <<'EOF'
#include <stdio.h>
#include "msg.h"
int main(void) { printf("%s %d\n", MSG, (int)sizeof(long)); return 0; }
EOF
printf '#define MSG "hi"\n' > msg.h
printf 'hello: hello.o\n\t$(CC) -o $@ $^\nhello.o: hello.c msg.h\n\t$(CC) -O2 -c -o $@ $<\nclean:\n\trm -f hello hello.o\n' > Makefile
make -s CC=gcc && ./hello
make -q hello; echo "up to date: $?"
touch msg.h; make CC=gcc 2>&1 | sed 's/^make\[[0-9]*\]/make/'
make -s clean; ls
"""



@pytest.mark.parametrize("tool", ["git", "make"])
def test_tool_same_inside(user: User, compat_base: Path, tool: str) -> None:
    need(shutil.which(tool) is not None and (tool != "make" or shutil.which("gcc") is not None),
         f"{tool} is not installed")
    script = {"git": GIT, "make": MAKE}[tool]
    outs = []
    for inside in (False, True):
        # the same absolute path both times: a fresh project, bare first
        p = compat_base / "p"
        shutil.rmtree(p, ignore_errors=True)
        (p / "repo").mkdir(parents=True)
        (p / "run.sh").write_text(script)
        user.own(compat_base)
        logs = compat_base / "logs"
        logs.mkdir(exist_ok=True)
        rc, out = Side(user, p, inside, logs).run(["/bin/sh", str(p / "run.sh")], 120, tool)
        outs.append((rc, out.decode(errors="replace")))
    (brc, bout), (irc, iout) = outs
    assert brc == 0, f"{tool} script failed bare:\n{bout}"
    assert bout.strip(), f"{tool} script printed nothing bare"
    # the CLI adds its session summary line after the command's output
    iout = "".join(line for line in iout.splitlines(keepends=True) if not line.startswith("stockade: session "))
    assert (irc, iout) == (brc, bout), f"{tool} differs inside:\n--- bare\n{bout}\n--- inside ({irc})\n{iout}"
