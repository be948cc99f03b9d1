"""State dirs and projects under one directory (CI jobs put both in /tmp) never cross
wires: every run's writes land in a session of its own state dir, for its own
project, whatever ran before in another state dir or on a nested project; a project
and a state dir that nest are refused before anything is made (the sessions' layers
inside the tree they are stacked on is a loop overlayfs refuses); a relative state
dir means the same directory to every part of a run. Served and in-process alike;
checked on the host's side (the state dirs' sessions, their upper layers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import User, end_servers, need, sweep_cgroups, umount_when_free, world_tmpdir

pytestmark = pytest.mark.cli_paths


@pytest.fixture
def base() -> Iterator[Path]:
    need(os.geteuid() == 0, "the tests run as root (the root CLI path)")
    d = world_tmpdir("stockade-iso-")
    try:
        yield d
    finally:
        for st in d.glob("st*"):
            end_servers(st)
            sweep_cgroups(st, 0)
        shutil.rmtree(d, ignore_errors=True)


def _user(base: Path, state: Path, cli_path: str | None) -> User:
    home = base / "home"
    home.mkdir(exist_ok=True)
    u = User("root", 0, 0, home, state, sys.executable)
    u.path = cli_path
    return u


def _sessions(state: Path) -> dict[str, tuple[str, set[str]]]:
    """session id -> (its project, the names in its upper layer)."""
    out = {}
    for d in (state / "sessions").iterdir():
        if d.name.startswith("."):
            continue
        meta = json.loads((d / "meta.json").read_text())
        out[d.name] = (meta["project"], {p.name for p in (d / "upper").rglob("*")})
    return out


def test_two_state_dirs_and_nested_projects_never_share_sessions(base: Path, cli_path: str | None) -> None:
    a = base / "w" / "a"
    b = a / "b"  # a project inside another
    b.mkdir(parents=True)
    for p in (a, b):
        (p / ".env").write_text("SECRET=1\n")  # each gets a mask layer
        (p / "f").write_text("x\n")
    states = [base / "st1", base / "st2"]
    users = {st: _user(base, st, cli_path) for st in states}
    expected: dict[Path, dict[str, str]] = {st: {} for st in states}  # marker -> project
    n = 0
    for _round in range(3):  # the second and third rounds meet servers, launchers and caches the first made
        for st in states:
            for proj in (a, b):
                n += 1
                marker = f"m{n}-{st.name}"
                r = users[st].cli(["run", "--project", str(proj), "--", "sh", "-c",
                                   f"echo {marker} > {marker}; cat .env 2>/dev/null; true"], cwd=proj)
                assert r.returncode == 0, (st, proj, r.stderr.decode())
                assert b"SECRET" not in r.stdout
                expected[st][marker] = str(proj)
    for st in states:
        found = _sessions(st)
        assert len(found) == len(expected[st])  # one new session per run, none elsewhere
        for marker, proj in expected[st].items():
            holders = [(sid, p) for sid, (p, names) in found.items() if marker in names]
            assert holders == [(holders[0][0], proj)], (st, marker, holders)
        others = {m for s2 in states if s2 != st for m in expected[s2]}
        assert not any(names & others for _p, names in found.values()), "a run wrote into another state dir's session"
        for _p, names in found.values():
            assert not any(x.startswith(".stockade") for x in names)
    for proj in (a, b):
        assert sorted(x.name for x in proj.iterdir()) == sorted([".env", "f", *(["b"] if proj == a else [])])


@pytest.mark.parametrize("inside", ["state-in-project", "state-is-project", "project-in-state"])
def test_nested_state_dir_and_project_are_refused(base: Path, cli_path: str | None, inside: str) -> None:
    proj = base / "p"
    proj.mkdir()
    (proj / "f").write_text("x\n")
    if inside == "state-in-project":
        state, run_in = proj / "st", proj
    elif inside == "state-is-project":
        state, run_in = proj, proj
    else:
        state = base / "st"
        run_in = state / "proj"
        run_in.mkdir(parents=True)
    u = _user(base, state, cli_path)
    before = {str(p) for p in base.rglob("*")}
    try:
        r = u.cli(["run", "--project", str(run_in), "--", "sh", "-c", "echo x > new"], cwd=run_in)
    finally:
        end_servers(state)
    assert r.returncode == 2, r.stderr.decode()
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "STOCKADE_STATE_DIR" in err and str(state) in err, err
    made = {str(p) for p in base.rglob("*")} - before
    if cli_path == "served":
        # STOCKADE_SERVER=require (the tests' served path) makes <state>/servers to start
        # the server it insists on; the run it served made nothing
        made -= {str(state), str(state / "servers")}
        made = {m for m in made if not m.startswith(str(state / "servers") + "/")}
    assert made == set()  # no state dir, session or cache, nothing in the project


def test_a_relative_state_dir_is_the_same_dir_for_every_part_of_a_run(base: Path, cli_path: str | None) -> None:
    proj = base / "p"
    proj.mkdir()
    work = base / "cwd"
    work.mkdir()
    u = _user(base, Path("rel-st"), cli_path)
    for i in range(3):  # served: the first runs make the state dir and its server
        r = u.cli(["run", "--project", str(proj), "--", "sh", "-c", f"echo {i} > made{i}"], cwd=work)
        assert r.returncode == 0, r.stderr.decode()
    end_servers(work / "rel-st")
    sweep_cgroups(work / "rel-st", 0)
    found = _sessions(work / "rel-st")
    assert sorted(n for _p, names in found.values() for n in names) == ["made0", "made1", "made2"]
    assert {p for p, _n in found.values()} == {str(proj)}
    assert not (proj / "rel-st").exists() and not Path("/rel-st").exists()


@pytest.mark.parametrize("launcher", ["1", "0"])
def test_a_project_with_a_mount_inside_is_one_line_naming_the_mount(base: Path, cli_path: str | None, launcher: str) -> None:
    # overlayfs cannot clone a lower layer with mounts below it in the sandbox's user
    # namespace (they are locked): EINVAL, and the real reason only in dmesg
    proj = base / "p"
    sub = proj / "deep" / "mnt"
    sub.mkdir(parents=True)
    (proj / "f").write_text("x\n")
    state = base / "st"
    subprocess.run(["mount", "-t", "tmpfs", "stockade-test", str(sub)], check=True)
    try:
        u = _user(base, state, cli_path)
        for _ in range(2):  # served: the first run starts the server
            r = u.cli(["run", "--project", str(proj), "--", "true"], cwd=proj, env={"STOCKADE_LAUNCHER": launcher})
            err = r.stderr.decode()
            assert r.returncode == 2, err
            lines = [ln for ln in err.splitlines() if "warning" not in ln]
            assert len(lines) == 1, err
            assert "EINVAL" in lines[0] and f"mount points ({sub})" in lines[0] and "unmount them" in lines[0], err
            assert "state dir" not in lines[0], err  # not the session directory's filesystem
    finally:
        umount_when_free(sub, state)


def _overlay_layers(mountinfo: str, project: Path) -> list[str]:
    """The host paths of the project overlay's lower, upper and work dirs, as the
    kernel recorded the mount's options (the project itself left out)."""
    lines = [ln for ln in mountinfo.splitlines() if ln.split(" - ", 1)[-1].startswith("overlay ") and f" {project} " in ln]
    assert len(lines) == 1, mountinfo
    out: list[str] = []
    for opt in lines[0].split(" - ", 1)[1].split(" ", 2)[2].split(","):
        key, _, val = opt.partition("=")
        if key in ("lowerdir", "upperdir", "workdir"):
            out += [p.removeprefix("/oldroot") for p in val.split(":")]
    return [p for p in out if p != str(project)]


def test_every_layer_of_a_run_is_its_own_sessions(base: Path, cli_path: str | None) -> None:
    # The same project in two state dirs (equal prepared-run keys, equal launcher bases:
    # whatever one state dir's server, launcher or cache holds, the other's runs would
    # meet it) and a project nested in it: each run's overlay is made of its own
    # session's mask layer, upper and work dirs, never another session's or state dir's.
    a = base / "w" / "a"
    b = a / "b"
    b.mkdir(parents=True)
    for p in (a, b):
        (p / ".env").write_text("SECRET=1\n")
    for p in (a, b, a / ".env", b / ".env"):
        os.utime(p, (1e9, 1e9))  # not changed just now: the prepared runs are kept (stockade.fast.warm) and reused
    states = [base / "st1", base / "st2"]
    users = {st: _user(base, st, cli_path) for st in states}
    seen: set[str] = set()
    for _round in range(3):
        for proj in (a, b, a):
            for st in (states if _round % 2 == 0 else states[::-1]):
                r = users[st].cli(["run", "--project", str(proj), "--", "cat", "/proc/self/mountinfo"], cwd=proj)
                assert r.returncode == 0, r.stderr.decode()
                sid = [ln.split()[-1] for ln in r.stderr.decode().splitlines() if ln.startswith("stockade: session ")]
                assert len(sid) == 1, r.stderr.decode()
                own = st / "sessions" / sid[0]
                layers = _overlay_layers(r.stdout.decode(), proj)
                assert any(x.startswith(f"{own}/masks/") for x in layers), layers  # the .env is masked
                assert layers[-2:] == [f"{own}/upper", f"{own}/work"], layers
                stray = [x for x in layers if not x.startswith(f"{own}/")]
                assert stray == [], (st, proj, stray)
                assert sid[0] not in seen  # a new session each run
                seen.add(sid[0])


_ONE_PROCESS = """
import json, os, sys
import stockade
out = []
for st, proj in json.loads(sys.argv[1]):
    os.environ["STOCKADE_STATE_DIR"] = st  # one process, state dirs one after another
    r = stockade.run(["cat", "/proc/self/mountinfo"], project=proj, capture_output=True)
    out.append((st, proj, r.session, r.returncode, r.stdout.decode(), r.session_removed))
print(json.dumps(out))
"""


def test_one_process_running_in_two_state_dirs_keeps_them_apart(base: Path) -> None:
    # The library in one process (its caches of plans, policies, scans, packed launcher
    # plans, sessions made ahead, private launchers all live on between runs): runs in
    # two state dirs and on nested projects, interleaved, each on its own session's layers.
    a = base / "w" / "a"
    b = a / "b"
    b.mkdir(parents=True)
    for p in (a, b):
        (p / ".env").write_text("SECRET=1\n")
    states = [base / "st1", base / "st2"]
    order = [(str(st), str(proj)) for _ in range(2) for proj in (a, b, a) for st in states]
    u = _user(base, states[0], None)
    res = subprocess.run([u.python, "-c", _ONE_PROCESS, json.dumps(order)], env=u.env(), capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr.decode()
    runs = json.loads(res.stdout)
    assert len(runs) == len(order)
    sids = set()
    for st, proj, sid, rc, mountinfo, removed in runs:
        assert rc == 0
        own = f"{st}/sessions/{sid}"
        # it changed nothing: its anonymous session went after it (README: How long sessions stay)
        assert removed and not Path(own).exists()
        layers = _overlay_layers(mountinfo, Path(proj))
        assert layers[-2:] == [f"{own}/upper", f"{own}/work"], layers
        assert any(x.startswith(f"{own}/masks/") for x in layers), layers
        assert [x for x in layers if not x.startswith(own + "/")] == [], (st, proj, layers)
        sids.add(sid)
    assert len(sids) == len(order)
    for st in states:
        assert [d for d in (st / "sessions").iterdir() if not d.name.startswith(".")] == []
