"""`make install` gives a working `stockade` outside the checkout, for every user;
the bootstrap names an interpreter other users cannot reach."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import NOBODY, ROOT, need, world_tmpdir


def test_private_interpreter_is_named() -> None:
    base = world_tmpdir("stockade-interp-")
    closed = base / "home"
    (closed / "bin").mkdir(parents=True)
    py = closed / "bin" / "python3"
    shutil.copy2(os.path.realpath("/usr/bin/python3"), py)
    closed.chmod(0o700)
    r = subprocess.run([ROOT / "scripts" / "private-interp.sh", str(py)], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == str(closed)
    closed.chmod(0o755)
    r = subprocess.run([ROOT / "scripts" / "private-interp.sh", str(py)], capture_output=True, text=True, check=True)
    assert r.stdout == ""
    shutil.rmtree(base)


@pytest.mark.slow
def test_make_install_runs_for_root_and_another_user() -> None:
    need(os.geteuid() == 0, "installs for uid 65534 to check; needs root")
    prefix = world_tmpdir("stockade-install-")
    proj = world_tmpdir("stockade-installproj-")
    try:
        r = subprocess.run([ROOT / "scripts" / "install.sh"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PREFIX": str(prefix), "PYTHON": "/usr/bin/python3"}, timeout=600)
        assert r.returncode == 0, r.stderr
        exe = prefix / "bin" / "stockade"
        assert f"installed: {exe}" in r.stdout
        assert "cannot enter" not in r.stderr  # /usr/bin/python3 is open to everyone
        (proj / "a.txt").write_text("a\n")
        for pre in ([], ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]):
            state = world_tmpdir("stockade-installstate-")
            if pre:  # each user runs on a project of its own
                for p in (state, proj, proj / "a.txt"):
                    os.chown(p, NOBODY, NOBODY)
            try:
                # not the checkout's code: a clean environment, from outside the tree
                env = {"PATH": "/usr/bin:/bin", "HOME": str(state), "STOCKADE_STATE_DIR": str(state / "s"), "LANG": "C.UTF-8"}
                r = subprocess.run([*pre, str(exe), "run", "--", "sh", "-c", "cat a.txt; echo b > b.txt"], cwd=proj,
                                   capture_output=True, text=True, env=env, timeout=120)
                assert r.returncode == 0, r.stderr
                assert r.stdout == "a\n"
                assert "1 added" in r.stderr
                assert not (proj / "b.txt").exists()
                r = subprocess.run([*pre, str(prefix / "share/stockade/venv/bin/python"), "-c",
                                    "import stockade, sys; print(stockade.__file__)"],
                                   capture_output=True, text=True, env=env, cwd="/")
                assert r.stdout.startswith(str(prefix)), r.stdout  # the installed copy, not the checkout
            finally:
                subprocess.run(["pkill", "-u", str(NOBODY), "-f", str(prefix)], capture_output=True)
                shutil.rmtree(state, ignore_errors=True)
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
        shutil.rmtree(proj, ignore_errors=True)


def test_doctor_names_a_closed_interpreter() -> None:
    from stockade.doctor import probe_interpreter

    base = world_tmpdir("stockade-interp-")
    try:
        (base / "home" / "bin").mkdir(parents=True)
        py = base / "home" / "bin" / "python3"
        py.write_text("")
        (base / "home").chmod(0o700)
        p = probe_interpreter(str(py))
        assert p.data == {"closed": str(base / "home")}
        assert p.fix and "PYTHON=/usr/bin/python3" in p.fix
        (base / "home").chmod(0o755)
        assert probe_interpreter(str(py)).fix is None
    finally:
        shutil.rmtree(base)
