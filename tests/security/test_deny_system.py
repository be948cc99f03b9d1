"""Every path `stockade policy why` reports DENIED is unreadable inside (issue 12 item 3).

A deny of a system path (/usr/share/..., /usr/bin/..., a curated /etc entry) used to be
ignored by the mounts while `why` said DENIED. Each case plants a canary on the host,
asks `why` (which must say denied), then reads the canary inside; the host checks that
the canary's secret never came out. Denies come from every layer (--deny, the
workspace file, `stockade deny` into a session) and the runs go through every start
path (launcher and cold, served CLI and in-process), as root and as uid 65534.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import User, world_tmpdir

START = {"launcher": {}, "cold": {"STOCKADE_LAUNCHER": "0"}}
SERVE = {"served": {"STOCKADE_SERVER": "1"}, "inproc": {"STOCKADE_SERVER": "0"}}


@dataclass
class Case:
    name: str
    deny: str  # the path the rule names
    read: str  # the file read inside (the deny itself, or a file beneath it)
    secret: str  # what must not come out ("" for files the sandbox makes up, see below)
    how: str  # cli | workspace | session


def _plant(path: Path, secret: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secret + "\n")
    path.chmod(0o644)


@pytest.fixture
def planted(user: User, project: Path) -> Iterator[tuple[list[Case], list[Path]]]:
    """Canaries in system dirs, /etc, the project, a grant and the home; removed after."""
    tag = secrets.token_hex(6)
    cleanup: list[Path] = []
    cases: list[Case] = []

    def canary(name: str, file: Path, deny: Path, how: str) -> None:
        s = f"STOCKADE-DENY-{name}-{secrets.token_hex(8)}"
        _plant(file, s)
        cases.append(Case(name, str(deny), str(file), s, how))

    share = Path(f"/usr/share/stockade-test-canary-{tag}")
    cleanup.append(share)
    canary("usr-share-dir", share / "canary.txt", share, "cli")
    binf = Path(f"/usr/bin/stockade-test-canary-{tag}")
    cleanup.append(binf)
    canary("usr-bin-file", binf, binf, "session")
    # a deny through a symlink names its target (why resolves it too)
    link = Path(f"/usr/bin/stockade-test-canary-link-{tag}")
    cleanup.append(link)
    lib = Path(f"/usr/lib/stockade-test-canary-{tag}")
    cleanup.append(lib)
    s = f"STOCKADE-DENY-link-{secrets.token_hex(8)}"
    _plant(lib, s)
    link.symlink_to(lib)
    cases.append(Case("usr-symlink", str(link), str(link), s, "workspace"))
    etc = Path(f"/etc/ssl/stockade-test-canary-{tag}")
    cleanup.append(etc)
    canary("etc-curated-dir", etc / "canary.txt", etc, "workspace")
    # the whole of a curated /etc directory
    etc2 = Path(f"/etc/python3/stockade-test-canary-{tag}.cfg")
    if Path("/etc/python3").is_dir():
        cleanup.append(etc2)
        s = f"STOCKADE-DENY-etcdir-{secrets.token_hex(8)}"
        _plant(etc2, s)
        cases.append(Case("etc-python3", "/etc/python3", str(etc2), s, "cli"))
    # project and home
    canary("project-file", project / "sub" / "canary.txt", project / "sub", "cli")
    user.own(project / "sub")
    canary("home-file", user.home / ".stockade-canary", user.home / ".stockade-canary", "cli")
    user.own(user.home / ".stockade-canary")
    # inside a read-only grant
    g = world_tmpdir("stockade-deny-grant-")
    cleanup.append(g)
    (g / "ok.txt").write_text("visible\n")
    canary("grant-file", g / "canary.txt", g / "canary.txt", "cli")
    # existing system files, no canary of ours: what must not come out is their content
    real = Path(os.path.realpath(shutil.which("base64") or "/usr/bin/base64"))  # not the reader (python)
    cases.append(Case("real-binary", str(real), str(real), "", "cli"))
    cases.append(Case("etc-passwd", "/etc/passwd", "/etc/passwd", "", "workspace"))
    try:
        yield cases, [g]
    finally:
        for p in cleanup:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                p.unlink()


def _reader(cases: list[Case]) -> list[str]:
    # prints each file's size and content in hex (a made-up /etc/passwd holds "root:x:0")
    code = (
        "import sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        b = open(p, 'rb').read()\n"
        "        print(p, len(b), b[:4096].hex())\n"
        "    except OSError as e:\n"
        "        print(p, 'ERR', e.errno)\n"
    )
    return ["/usr/bin/python3", "-I", "-c", code, *(c.read for c in cases)]


@pytest.mark.parametrize("serve", list(SERVE))
@pytest.mark.parametrize("start", list(START))
def test_every_denied_path_is_unreadable_inside(
    user: User, project: Path, planted: tuple[list[Case], list[Path]], start: str, serve: str
) -> None:
    cases, grants = planted
    env = {**START[start], **SERVE[serve]}
    flags = [f"--allow={g}" for g in grants]
    flags += [f"--deny={c.deny}" for c in cases if c.how == "cli"]
    ws = "".join(f'[[paths]]\npath = "{c.deny}"\naccess = "deny"\n' for c in cases if c.how == "workspace")
    (project / ".stockade.toml").write_text(ws)
    user.own(project / ".stockade.toml")
    r = user.cli(["run", "--session", "d", "--", "true"], cwd=project, env=env)
    assert r.returncode == 0, r.stderr
    for c in cases:
        if c.how == "session":
            r = user.cli(["deny", "--session", "d", c.deny], cwd=project, env=env)
            assert r.returncode == 0, r.stderr

    # `why` says DENIED for every path read
    for c in cases:
        r = user.cli(["policy", "why", "--session", "d", "--json", *flags, c.read], cwd=project, env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["access"] == "denied", (c.name, r.stdout)

    r = user.cli(["run", "--session", "d", *flags, "--", *_reader(cases)], cwd=project, env=env)
    assert r.returncode == 0, r.stderr
    seen = {line.split(" ", 1)[0]: line.split(" ")[1:] for line in r.stdout.decode().splitlines()}
    out = r.stdout + r.stderr
    for c in cases:
        got = seen[c.read]
        # unreadable: absent, or an empty file mounted over it
        assert got[0] == "ERR" or got[0] == "0", (c.name, got)
        if c.secret:
            assert c.secret.encode() not in out and c.secret.encode().hex().encode() not in out, c.name
    # the mask is precise: the grant's other file and the rest of /usr/bin stay readable
    ok = user.cli(["run", "--session", "d", *flags, "--", "sh", "-c", f"cat {grants[0]}/ok.txt && test -s /usr/bin/sh"],
                  cwd=project, env=env)
    assert ok.returncode == 0 and ok.stdout == b"visible\n", ok.stderr


def test_canaries_are_readable_without_the_denies(user: User, project: Path, planted: tuple[list[Case], list[Path]]) -> None:
    """The control: with no deny, each canary (but the home's, under an empty tmpfs) is read."""
    cases, grants = planted
    r = user.cli(["run", *[f"--allow={g}" for g in grants], "--", *_reader(cases)], cwd=project)
    assert r.returncode == 0, r.stderr
    for c in cases:
        if c.name == "home-file":
            continue
        if c.secret:
            assert c.secret.encode().hex().encode() in r.stdout, c.name
        else:
            assert f"{c.read} 0 ".encode() not in r.stdout and f"{c.read} ERR".encode() not in r.stdout, c.name


@pytest.mark.parametrize("path", ["/proc/cpuinfo", "/dev/null"])
def test_deny_in_the_sandboxes_own_proc_and_dev_is_refused(user: User, project: Path, path: str) -> None:
    """The sandbox has its own /proc and /dev: a deny there cannot be honoured, so it is an error."""
    r = user.cli(["run", f"--deny={path}", "--", "true"], cwd=project)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert len(err.strip().splitlines()) == 1 and path in err and "--deny" in err, err


@pytest.mark.parametrize("start", list(START))
def test_a_denied_system_path_created_after_a_run_is_hidden_in_the_next(user: User, project: Path, start: str) -> None:
    """The CLI reuses prepared plans across processes (stockade.fast.warm): the deny's target
    appearing must not be served by a plan made while it was absent."""
    d = Path(f"/usr/share/stockade-test-late-{secrets.token_hex(6)}")
    read = [*_reader([Case("late", str(d), str(d / "canary.txt"), "", "cli")])]
    # a config file's deny: runs with no policy flags are the ones that reuse kept plans
    (project / ".stockade.toml").write_text(f'[[paths]]\npath = "{d}"\naccess = "deny"\n')
    user.own(project / ".stockade.toml")
    # a plan is kept only when what it depends on is older than the timestamp granularity
    past = time.time() - 10
    for p in [project, *project.rglob("*")]:
        os.utime(p, (past, past), follow_symlinks=False)
    env = {**START[start], "STOCKADE_WARM": "1"}  # this is the kept plans' test, whatever the suite runs with
    try:
        for _ in range(2):  # the second run comes from the kept plan
            r = user.cli(["run", "--", *read], cwd=project, env=env)
            assert r.returncode == 0 and b" ERR " in r.stdout, r.stderr
        assert list((user.state / "cache").glob("warm-*.bin"))
        secret = f"STOCKADE-DENY-late-{secrets.token_hex(8)}"
        _plant(d / "canary.txt", secret)
        r = user.cli(["run", "--", *read], cwd=project, env=env)
        assert r.returncode == 0, r.stderr
        assert secret.encode().hex().encode() not in r.stdout and b" ERR " in r.stdout, r.stdout
    finally:
        shutil.rmtree(d, ignore_errors=True)
