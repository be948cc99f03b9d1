"""Real developer tools still work in the full sandbox under the default profile
(namespaces, Landlock, capabilities dropped, seccomp), as root and as uid 65534."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import User, make_wheel, need
from tests.security.helpers import sandbox

# under the second kernel too (make test-vm), but for the slow pip case: the others
# cover what the kernel changes for a tool


def _have(tool: str) -> str:
    path = shutil.which(tool)
    need(path is not None, f"{tool} not installed")
    assert path is not None
    return path


def _ok(r: object) -> str:
    import subprocess

    assert isinstance(r, subprocess.CompletedProcess)
    assert r.returncode == 0, (r.returncode, r.stdout.decode(), r.stderr.decode())
    return str(r.stdout.decode())


@pytest.mark.vm
def test_git(user: User, project: Path) -> None:
    _have("git")
    script = (
        "set -e; export GIT_CONFIG_NOSYSTEM=1 HOME=$PWD; git init -q .; git config user.email t@e; "
        "git config user.name t; git add -A; git commit -qm one; echo x >> README.md; "
        "git status --porcelain; git diff --stat | tail -1; git gc -q; git log --oneline | wc -l"
    )
    out = _ok(sandbox(user, project, ["sh", "-c", script]))
    assert "M README.md" in out and out.strip().endswith("1"), out
    assert not (project / ".git").exists()  # it all went to the session's upper layer


@pytest.mark.vm
def test_gcc_make(user: User, project: Path) -> None:
    _have("gcc")
    _have("make")
    (project / "main.c").write_text(
        "#include <stdio.h>\n#include <pthread.h>\nstatic void *f(void *a){return a;}\n"
        'int main(void){pthread_t t;pthread_create(&t,0,f,0);pthread_join(t,0);puts("built");return 0;}\n'
    )
    (project / "Makefile").write_text(
        "prog: main.o\n\tgcc -pthread -o $@ $^\nmain.o: main.c\n\tgcc -O1 -c $<\n"
    )
    user.own(project)
    out = _ok(sandbox(user, project, ["sh", "-c", "make -s -j2 && ./prog"]))
    assert out.strip() == "built"


@pytest.mark.slow
def test_python_venv_pip_localmake_wheel(user: User, project: Path) -> None:
    need(Path("/usr/bin/python3").exists(), "/usr/bin/python3 missing")
    make_wheel(project)
    user.own(project)
    script = (
        "set -e; /usr/bin/python3 -m venv .venv; "
        ".venv/bin/pip install -q --no-index --disable-pip-version-check ./demo_pkg-0.1-py3-none-any.whl; "
        ".venv/bin/python -c 'import demo_pkg, sqlite3, ssl, multiprocessing as m; "
        "p = m.Pool(2); print(sum(p.map(abs, [-1, 2])) + demo_pkg.VALUE); p.close()'"
    )
    out = _ok(sandbox(user, project, ["sh", "-c", script], timeout=300))
    assert out.strip().splitlines()[-1] == "45"


@pytest.mark.vm
def test_node(user: User, project: Path) -> None:
    if shutil.which("node") is None:
        pytest.skip("node not installed")  # optional, even under STOCKADE_MUST_WORK
    js = (
        "const fs=require('fs');const cp=require('child_process');fs.writeFileSync('x.txt','ok');"
        "fs.promises.readFile('x.txt','utf8').then(s=>{"
        "console.log(cp.execFileSync('/bin/echo',[s]).toString().trim());});"
    )
    out = _ok(sandbox(user, project, ["node", "-e", js]))
    assert out.strip() == "ok"


@pytest.mark.vm
@pytest.mark.parametrize("profile", ["strict", "permissive"])
def test_other_profiles_run_a_build(user: User, project: Path, profile: str) -> None:
    _have("gcc")
    (project / "t.c").write_text('#include <stdio.h>\nint main(void){puts("ok");return 0;}\n')
    user.own(project)
    out = _ok(sandbox(user, project, ["sh", "-c", "gcc -o t t.c && ./t"], "--seccomp", profile))
    assert out.strip() == "ok"
