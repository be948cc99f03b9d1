"""Sessions are collected (issue 19, part 2): anonymous sessions whose run changed
nothing go when the run ends; the others without unapplied changes after `[sessions]
keep`; never one in use, never unapplied changes unless asked; `stockade clean
--older-than`, `stockade status` as a list, `stockade.clean` / `stockade.sessions`.

Everything is checked from the host: the state dir's entries, its sessions' directories,
the run cgroups of its owner tag, the mount table. Ages are faked by setting a session's
timestamps, never by sleeping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import User

DAY = 86400.0


# --------------------------------------------------------------------------- host-side helpers


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (not within {timeout:g} s)")
        time.sleep(0.05)


def sessions(state: Path) -> set[str]:
    d = state / "sessions"
    return {n for n in os.listdir(d) if not n.startswith(".")} if d.is_dir() else set()


def entries(state: Path) -> set[str]:
    """Every path under the state dir, relative (lock files, sockets, trash included)."""
    out = set()
    for dp, ds, fs in os.walk(state):
        for n in ds + fs:
            out.add(os.path.relpath(os.path.join(dp, n), state))
    return out


def age(state: Path, sid: str, seconds: float) -> None:
    """Make session ``sid`` look unused for ``seconds`` (what `last used` reads)."""
    d = state / "sessions" / sid
    t = time.time() - seconds
    for p in (d / "meta.json", d / "events.jsonl", d / "runs", d / "changes-applied.json", d):
        if p.exists():
            os.utime(p, (t, t))


def run_cgroups(state: Path, uid: int) -> list[str]:
    """The run cgroups this state dir's runs made that are still there."""
    from stockade.cgroups import detect
    from stockade.cgroups.fs import owner_tag
    from stockade.cgroups.sweep import _is_run_dir, run_parents

    tag = owner_tag(uid, str(state))
    return [f"{parent}/{n}" for parent in run_parents(detect.detect()) for n in os.listdir(parent)
            if _is_run_dir(n, tag) is not None]


def mounts_under(state: Path) -> list[str]:
    return [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if str(state) in ln]


def ok(r: subprocess.CompletedProcess[bytes]) -> str:
    assert r.returncode == 0, (r.returncode, r.stdout.decode()[-2000:], r.stderr.decode()[-4000:])
    return r.stdout.decode()


def session_line(r: subprocess.CompletedProcess[bytes]) -> str:
    """The session a CLI run names on stderr (`stockade: session S ...`)."""
    for ln in r.stderr.decode().splitlines():
        if ln.startswith("stockade: session "):
            return ln.split()[2]
    raise AssertionError(r.stderr)


def clean_json(user: User, project: Path, *args: str) -> dict[str, object]:
    r = user.cli(["clean", *args, "--json"], cwd=project)
    assert r.returncode in (0, 1), r.stderr
    data: dict[str, object] = json.loads(r.stdout)
    return data


def skipped(data: dict[str, object]) -> dict[str, dict[str, object]]:
    return {str(s["id"]): s for s in data["skipped"]}  # type: ignore[attr-defined, union-attr]


# --------------------------------------------------------------------------- the API: nothing left behind


@pytest.mark.slow
def test_a_thousand_runs_leave_nothing_behind(user: User, project: Path) -> None:
    """1,000 `stockade.run(["true"])` calls in a row, then 1,000 from 4 threads: the state
    dir holds exactly what it held after one run (no session, lock, trash or stamp more),
    no run cgroup and no mount is left."""
    warm = f"import stockade; assert stockade.run(['true'], project={str(project)!r}).session_removed"
    ok(user.py(warm))
    before = entries(user.state)
    assert sessions(user.state) == set()
    code = textwrap.dedent(f"""
        import time, stockade
        from concurrent.futures import ThreadPoolExecutor
        def one(i):
            r = stockade.run(["true"], project={str(project)!r})
            if not r.session_removed:  # why: its state now, and what is in it
                import os
                from stockade.changes import retention
                from stockade.session import store
                s = store.open_session(r.session)
                raise AssertionError((i, r, retention._judge(s, retention._pending(), set()),
                                      sorted(os.path.join(d, n) for d, ds, fs in os.walk(s.dir) for n in ds + fs)))
            assert r.returncode == 0, (i, r)
        t = time.monotonic()
        for i in range(1000):
            one(i)
        t1 = time.monotonic()
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(one, range(1000)))
        print(f"{{t1 - t:.1f}} {{time.monotonic() - t1:.1f}}")
    """)
    r = user.py(code, timeout=900)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    print(f"1000 runs in a row, 1000 from 4 threads ({user.name}): {r.stdout.decode().split()} s")
    assert sessions(user.state) == set()
    wait_for(lambda: entries(user.state) == before, 15,
             f"the state dir went back to its entries: {sorted(entries(user.state) ^ before)[:10]}")
    wait_for(lambda: not run_cgroups(user.state, user.uid), 15, "the runs' cgroups went")
    assert mounts_under(user.state) == []


def test_api_keeps_what_changed_and_drops_what_did_not(user: User, project: Path) -> None:
    code = textwrap.dedent(f"""
        import json, subprocess, stockade
        P = {str(project)!r}
        out = {{}}
        r = stockade.run(["sh", "-c", "echo x > new.txt"], project=P)
        out["changed"] = [r.session, r.session_removed]
        r = stockade.run(["sh", "-c", "exit 3"], project=P)
        out["failed"] = [r.session, r.session_removed, r.returncode]
        try:
            stockade.run(["false"], project=P, check=True)
        except subprocess.CalledProcessError:
            out["check"] = True
        try:
            stockade.run(["sleep", "5"], project=P, timeout=0.5)
        except subprocess.TimeoutExpired:
            out["timeout"] = True
        r = stockade.run(["sh", "-c", "echo x > t; rm t"], project=P)  # written and removed: no change
        out["restored"] = [r.session, r.session_removed]
        with stockade.Sandbox(P) as sb:  # a Sandbox's session is the caller's: kept until its age
            out["sandbox"] = [sb.id, sb.run(["true"]).session_removed]
        r = stockade.run(["true"], project=P, session="named")
        out["named"] = [r.session, r.session_removed]
        print(json.dumps(out))
    """)
    out = json.loads(ok(user.py(code)))
    assert out["changed"][1] is False and out["failed"][1:] == [True, 3]
    assert out["check"] and out["timeout"] and out["restored"][1] is True
    assert out["sandbox"][1] is False and out["named"] == ["named", False]
    assert sessions(user.state) == {out["changed"][0], out["sandbox"][0], "named"}
    assert (user.state / "sessions" / out["changed"][0] / "upper" / "new.txt").read_text() == "x\n"
    assert not (project / "new.txt").exists()


def test_api_clean_and_sessions(user: User, project: Path) -> None:
    code = textwrap.dedent(f"""
        import json, stockade
        P = {str(project)!r}
        a = stockade.run(["sh", "-c", "echo a > a"], project=P).session
        stockade.run(["true"], project=P, session="empty")
        states = {{i.id: i.state for i in stockade.sessions()}}
        dry = [(o.id, o.action) for o in stockade.clean("0s", dry_run=True)]
        kept = [(o.id, o.action, o.state) for o in stockade.clean(0)]
        left = sorted(i.id for i in stockade.sessions())
        gone = sorted(o.id for o in stockade.clean("0s", include_unapplied=True))
        try:
            stockade.clean("7x")
        except stockade.UsageError as e:
            bad = str(e)
        print(json.dumps([a, states, sorted(dry), sorted(kept), left, gone, bad]))
    """)
    a, states, dry, kept, left, gone, bad = json.loads(ok(user.py(code)))
    assert states == {a: "has-changes", "empty": "empty"}
    assert dry == sorted([[a, "skipped"], ["empty", "would-remove"]])
    assert kept == sorted([[a, "skipped", "has-changes"], ["empty", "removed", "empty"]])
    assert left == [a] and gone == [a] and sessions(user.state) == set()
    assert bad.startswith("older_than: invalid duration '7x'")


# --------------------------------------------------------------------------- the CLI


@pytest.mark.cli_paths
def test_cli_keeps_only_its_latest_empty_session(user: User, project: Path) -> None:
    """A CLI run that changed nothing keeps its session as the project's latest (`stockade
    log`, `status --latest` reach it) until the next CLI run of the project ends."""
    firsts = [session_line(ok_run) for ok_run in
              [user.cli(["run", "--", "true"], cwd=project) for _ in range(3)]]
    assert len(set(firsts)) == 3 and sessions(user.state) == {firsts[-1]}
    log = ok(user.cli(["log", "--json"], cwd=project))
    assert firsts[-1] in log
    st = ok(user.cli(["status", "--latest"], cwd=project))
    assert st.startswith(f"session {firsts[-1]} ") and "no changes" in st
    r = user.cli(["run", "--", "sh", "-c", "echo x > made.txt"], cwd=project)
    changed = session_line(r)
    assert sessions(user.state) == {changed}  # the empty one went; the change stays
    r = user.cli(["run", "--", "true"], cwd=project)
    empty = session_line(r)
    assert sessions(user.state) == {changed, empty}
    # a session named on the command line is the caller's: kept
    ok(user.cli(["run", "--session", "mine", "--", "true"], cwd=project))
    ok(user.cli(["run", "--", "true"], cwd=project))
    assert "mine" in sessions(user.state) and changed in sessions(user.state)
    assert empty not in sessions(user.state)
    # the pointer to the project's latest empty session goes with it
    assert [n for n in os.listdir(user.state / "sessions") if n.startswith(".latest-empty-")] != []
    left = sessions(user.state)
    assert len(left) == 3  # mine, the changed one, the latest empty one
    data = clean_json(user, project, "--older-than", "0s", "--include-unapplied")
    assert sorted(data["removed"]) == sorted(left)  # type: ignore[arg-type]
    assert sessions(user.state) == set()
    assert [n for n in os.listdir(user.state / "sessions") if n.startswith((".latest-empty-", ".clean-"))] == []


@pytest.mark.cli_paths
def test_status_lists_sessions_with_age_size_and_state(user: User, project: Path) -> None:
    ok(user.cli(["run", "--session", "chg", "--", "sh", "-c", "echo x > f"], cwd=project))
    ok(user.cli(["run", "--session", "emp", "--", "true"], cwd=project))
    ok(user.cli(["run", "--session", "app", "--", "sh", "-c", "echo y > g"], cwd=project))
    ok(user.cli(["apply", "app"], cwd=project))
    age(user.state, "emp", 3 * DAY)
    rows = {r["id"]: r for r in json.loads(ok(user.cli(["status", "--json"], cwd=project)))}
    assert {k: v["state"] for k, v in rows.items()} == {"chg": "has-changes", "emp": "empty", "app": "applied"}
    assert 3 * DAY - 60 < rows["emp"]["age_s"] < 3 * DAY + 60 and rows["chg"]["age_s"] < 60
    assert all(r["size"] > 0 and r["runs"] == 1 and r["project"] == str(project) for r in rows.values())
    assert rows["chg"]["changes"] == {"added": 1, "modified": 0, "deleted": 0}
    text = ok(user.cli(["status"], cwd=project)).splitlines()
    assert text[0].split() == ["SESSION", "AGE", "SIZE", "STATE", "RUNS", "CHANGES", "PROJECT"]
    line = {ln.split()[0]: ln.split() for ln in text[1:]}
    assert line["emp"][1] == "3d" and line["emp"][3] == "empty" and line["app"][3] == "applied"
    # one session: by name, or the latest
    assert ok(user.cli(["status", "chg"], cwd=project)).startswith("session chg ")
    assert ok(user.cli(["status", "--latest"], cwd=project)).startswith("session app ")
    assert json.loads(ok(user.cli(["status", "chg", "--json"], cwd=project)))["session"] == "chg"


@pytest.mark.cli_paths
def test_a_session_in_use_is_never_removed(user: User, project: Path) -> None:
    """A run holding a session (a `sleep` in it): `clean --older-than 0s
    --include-unapplied` and `clean --all` skip it with the reason; `clean S` refuses."""
    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--session", "busy", "--",
                          "sh", "-c", "echo x > f; sleep 60"], cwd=project, env=user.env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        upper = user.state / "sessions" / "busy" / "upper"
        wait_for(lambda: (upper / "f").exists(), 60, "the run wrote its file")
        age(user.state, "busy", 30 * DAY)
        data = clean_json(user, project, "--older-than", "0s", "--include-unapplied")
        s = skipped(data)["busy"]
        assert s["state"] == "running" and "in use: a run is in progress" in str(s["reason"])
        r = user.cli(["clean", "--all"], cwd=project)
        assert r.returncode == 1 and "kept busy (running): in use: a run is in progress" in r.stderr.decode()
        r = user.cli(["clean", "busy"], cwd=project)
        assert r.returncode != 0 and "session 'busy' was not removed: in use" in r.stderr.decode()
        rows = {x["id"]: x for x in json.loads(ok(user.cli(["status", "--json"], cwd=project)))}
        assert rows["busy"]["state"] == "running"
        assert (upper / "f").read_text() == "x\n" and p.poll() is None
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    # free now, older than asked: goes
    age(user.state, "busy", 30 * DAY)
    data = clean_json(user, project, "--older-than", "1d", "--include-unapplied")
    assert data["removed"] == ["busy"] and sessions(user.state) == set()


def test_a_living_sandbox_session_is_never_removed(user: User, project: Path) -> None:
    ok(user.cli(["start", "--name", "lv"], cwd=project, timeout=90))
    try:
        age(user.state, "lv", 30 * DAY)
        s = skipped(clean_json(user, project, "--older-than", "0s", "--include-unapplied"))["lv"]
        assert s["state"] == "idle" and "living sandbox lv" in str(s["reason"])
        r = user.cli(["clean", "--all"], cwd=project)
        assert r.returncode == 1 and "kept lv (idle)" in r.stderr.decode()
        assert "lv" in sessions(user.state)
    finally:
        ok(user.cli(["stop", "lv"], cwd=project, timeout=90))
    data = clean_json(user, project, "--older-than", "0s")
    assert data["removed"] == ["lv"] and not (user.state / "live" / "lv").exists()


def test_sessions_go_by_age_but_unapplied_changes_stay(user: User, project: Path) -> None:
    """`[sessions] keep`: a session without unapplied changes (empty, or applied)
    survives until its age and then goes, in the collection a run starts now and then;
    unapplied changes stay until `clean --older-than --include-unapplied`."""
    cfg = user.home / ".config" / "stockade"
    cfg.mkdir(parents=True)
    (cfg / "config.toml").write_text('[sessions]\nkeep = "2d"\n')
    user.own(user.home / ".config")
    ok(user.cli(["run", "--session", "emp", "--", "true"], cwd=project))
    ok(user.cli(["run", "--session", "app", "--", "sh", "-c", "echo y > applied.txt"], cwd=project))
    ok(user.cli(["apply", "app"], cwd=project))
    ok(user.cli(["run", "--session", "chg", "--", "sh", "-c", "echo x > unapplied.txt"], cwd=project))
    stamp = user.state / "sessions" / ".collected"
    assert stamp.exists()  # made by the first run: nothing is old in a new state dir

    def collect() -> None:
        """A run after the stamp aged: it starts the collection (in a process of its own)."""
        old = time.time() - 3600
        os.utime(stamp, (old, old))
        ok(user.cli(["run", "--session", "trigger", "--", "true"], cwd=project))
        wait_for(lambda: stamp.stat().st_mtime > old + 1800, 10, "the run renewed the stamp")

    for sid in ("emp", "app", "chg"):
        age(user.state, sid, 1 * DAY)
    collect()
    time.sleep(3)  # the collector had its chance: all stay (younger than keep)
    assert sessions(user.state) >= {"emp", "app", "chg"}
    for sid in ("emp", "app", "chg"):
        age(user.state, sid, 3 * DAY)
    collect()
    wait_for(lambda: not sessions(user.state) & {"emp", "app"}, 30, "the collector removed emp and app")
    assert "chg" in sessions(user.state) and (project / "applied.txt").read_text() == "y\n"
    # unapplied changes: only when asked, and only when old enough
    data = clean_json(user, project, "--older-than", "2d")
    assert skipped(data)["chg"]["state"] == "has-changes" and "--include-unapplied" in str(skipped(data)["chg"]["reason"])
    data = clean_json(user, project, "--older-than", "4d", "--include-unapplied")
    assert "chg" not in data["removed"]  # type: ignore[operator]
    data = clean_json(user, project, "--older-than", "2d", "--include-unapplied", "--dry-run")
    assert data["would_remove"] == ["chg"] and data["removed"] == [] and "chg" in sessions(user.state)
    data = clean_json(user, project, "--older-than", "2d", "--include-unapplied")
    assert data["removed"] == ["chg"] and sessions(user.state) == {"trigger"}
    assert not (project / "unapplied.txt").exists()


def test_a_snapshot_holding_changes_a_later_run_undid_keeps_its_session(user: User, project: Path) -> None:
    """The merged view equals the project (a later run removed what an earlier one made),
    but snapshot `good` still holds it, and `snapshot restore` brings it back: the session
    holds unapplied changes (it was judged empty and went by age, the snapshot with it)."""
    ok(user.cli(["run", "--session", "snap", "--", "sh", "-c", "echo precious > out.txt"], cwd=project))
    ok(user.cli(["snapshot", "create", "good", "-s", "snap"], cwd=project))
    ok(user.cli(["run", "--session", "snap", "--", "rm", "out.txt"], cwd=project))
    age(user.state, "snap", 3 * DAY)
    data = clean_json(user, project, "--older-than", "2d")
    got = skipped(data)["snap"]
    assert got["state"] == "has-changes" and "snapshot" in str(got["reason"]), got
    assert "snap" in sessions(user.state)
    ok(user.cli(["snapshot", "restore", "good", "-s", "snap"], cwd=project))
    ok(user.cli(["apply", "snap"], cwd=project))
    assert (project / "out.txt").read_text() == "precious\n"


@pytest.mark.cli_paths
def test_rollback_after_its_session_was_collected(user: User, project: Path) -> None:
    """An apply's journal is the state dir's, not the session's: collecting the applied
    session keeps `stockade rollback` able to restore the project exactly."""
    before = (project / "README.md").read_bytes()
    ok(user.cli(["run", "--session", "ap", "--", "sh", "-c", "echo changed > README.md; echo n > new.txt"],
                cwd=project))
    ok(user.cli(["apply", "ap"], cwd=project))
    assert (project / "README.md").read_text() == "changed\n"
    age(user.state, "ap", 10 * DAY)
    data = clean_json(user, project, "--older-than", "7d")  # applied: nothing unapplied left
    assert data["removed"] == ["ap"] and "ap" not in sessions(user.state)
    # a new session under the same name is another one: the rollback's entries stay out of it
    ok(user.cli(["run", "--session", "ap", "--", "sh", "-c", "echo mine > mine.txt"], cwd=project))
    r = user.cli(["rollback"], cwd=project)
    assert r.returncode == 0, r.stderr
    assert "session ap was removed since (the session of that name now is a later one)" in r.stderr.decode()
    assert (project / "README.md").read_bytes() == before and not (project / "new.txt").exists()
    diff = json.loads(ok(user.cli(["status", "ap", "--json"], cwd=project)))
    assert sorted(c["path"] for c in diff["changes"]) == ["mine.txt"], diff


@pytest.mark.cli_paths
def test_bare_clean_removes_the_latest_session_of_the_project_here(user: User, project: Path) -> None:
    """`stockade clean` with no name removes the latest session of the project it is run
    in (from a subdirectory too), never another project's, however recently that one was
    used: its unapplied changes would go with it. Where no project has a session: exit 2,
    one line, nothing removed."""
    other = project.parent / "other"
    (other / "sub").mkdir(parents=True)
    user.own(other)
    ok(user.cli(["run", "--session", "here", "--", "sh", "-c", "echo x > f"], cwd=project))
    ok(user.cli(["run", "--session", "there", "--", "sh", "-c", "echo y > g"], cwd=other))  # the latest overall
    ok(user.cli(["clean"], cwd=project / "src"))
    assert sessions(user.state) == {"there"}
    before = entries(user.state)
    r = user.cli(["clean"], cwd=project)
    err = r.stderr.decode()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "no sessions of a project at or above" in err, err
    assert entries(user.state) == before
    ok(user.cli(["clean"], cwd=other / "sub"))
    assert sessions(user.state) == set()


@pytest.mark.cli_paths
def test_clean_bad_input_removes_nothing(user: User, project: Path) -> None:
    ok(user.cli(["run", "--session", "keepme", "--", "sh", "-c", "echo x > f"], cwd=project))
    age(user.state, "keepme", 30 * DAY)
    before = entries(user.state)
    for args, msg in [
        (["--older-than", "7x"], "--older-than: invalid duration '7x': expected a number and a unit: 30s, 30m, "
                                 "12h, 7d or 2w"),
        (["--older-than", "-1d"], "--older-than: invalid duration '-1d'"),
        (["--older-than", "1d", "--all"], "give one of SESSION, --all or --older-than AGE, not --all and "
                                          "--older-than"),
        (["keepme", "--all"], "give one of SESSION, --all or --older-than AGE"),
        (["--include-unapplied"], "--include-unapplied goes with --older-than AGE"),
    ]:
        r = user.cli(["clean", *args], cwd=project)
        err = r.stderr.decode()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and msg in err, (args, err)
    assert entries(user.state) == before
    # clean S and clean --all still remove unapplied changes (as they always did)
    ok(user.cli(["clean", "keepme", "--dry-run"], cwd=project))
    assert "keepme" in sessions(user.state)
    ok(user.cli(["clean", "keepme"], cwd=project))
    assert sessions(user.state) == set()


def test_bad_sessions_config_is_one_line(user: User, project: Path) -> None:
    cfg = user.home / ".config" / "stockade"
    cfg.mkdir(parents=True)
    (cfg / "config.toml").write_text('[sessions]\nkeep = "7x"\n')
    user.own(user.home / ".config")
    r = user.cli(["run", "--", "true"], cwd=project)
    err = r.stderr.decode()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert f"{cfg / 'config.toml'}:2: sessions.keep: invalid value '7x'" in err and "2w" in err
    assert sessions(user.state) == set()
    (cfg / "config.toml").write_text("")
    (project / ".stockade.toml").write_text('[sessions]\nkeep = "1s"\n')
    r = user.cli(["run", "--", "true"], cwd=project)
    assert r.returncode == 2 and "[sessions] is read from the global config only" in r.stderr.decode()


def test_locked_and_interrupted_apply_sessions_are_skipped(api_project: Path, state_dir: Path) -> None:
    """A session another stockade command holds (its lock), and one an interrupted apply
    still needs (its journal's layers, for `stockade recover`), stay, with the reason."""
    import stockade
    from stockade.session import store

    for name in ("held", "journaled", "free"):
        stockade.run(["sh", "-c", "echo x > f"], project=api_project, session=name)
        age(state_dir, name, 30 * DAY)
    adir = state_dir / "applies" / "20260101-000000-abcd"
    adir.mkdir(parents=True)
    (adir / "plan.json").write_text(json.dumps({"session": "journaled", "project": str(api_project),
                                             "created": 0, "paths": []}))
    (state_dir / "applies" / "pending").mkdir()
    (state_dir / "applies" / "pending" / adir.name).touch()
    with store.open_session("held").lock(wait=False):
        rows = {i.id: i for i in stockade.sessions()}
        assert rows["held"].state == "locked" and "locked by another stockade command" in rows["held"].reason
        assert rows["journaled"].state == "locked" and "stockade recover" in rows["journaled"].reason
        out = {o.id: o for o in stockade.clean("1d", include_unapplied=True)}
    assert out["held"].action == "skipped" and out["held"].state == "locked", out
    assert out["journaled"].action == "skipped" and "interrupted apply" in out["journaled"].reason
    assert out["free"].action == "removed"
    assert sessions(state_dir) == {"held", "journaled"}


# --------------------------------------------------------------------------- a session's trouble never stops a collection


def _gone_project(user: User, project: Path, sid: str, cmd: str) -> Path:
    """Session ``sid`` made by a run of ``cmd`` in a project of its own, which is then deleted."""
    gone = project.parent / f"gone-{sid}"
    gone.mkdir()
    (gone / "f").write_text("x\n")
    user.own(gone)
    ok(user.cli(["run", "--session", sid, "--", "sh", "-c", cmd], cwd=gone))
    subprocess.run(["rm", "-rf", str(gone)], check=True)
    return gone


@pytest.mark.cli_paths
def test_a_session_whose_project_is_gone(user: User, project: Path) -> None:
    """Its layers are judged without the project: entries are changes that can never be
    applied (kept until asked: --include-unapplied, `clean S`, `clean --all`), none make
    it an empty session (goes by age). Sessions after it in name order are collected
    all the same, by `clean --older-than` and by the automatic collector."""
    _gone_project(user, project, "a-gone", "echo y > new; rm f")
    _gone_project(user, project, "b-gone-empty", "true")
    ok(user.cli(["run", "--session", "z-empty", "--", "true"], cwd=project))
    for sid in ("a-gone", "b-gone-empty", "z-empty"):
        age(user.state, sid, 10 * DAY)

    rows = {r["id"]: r for r in json.loads(ok(user.cli(["status", "--json"], cwd=project)))}
    assert rows["a-gone"]["state"] == "project-gone" and rows["a-gone"]["changes"] is None
    assert "no longer exists" in rows["a-gone"]["reason"] and "stockade clean a-gone" in rows["a-gone"]["reason"]
    assert rows["b-gone-empty"]["state"] == "project-gone"
    assert rows["b-gone-empty"]["changes"] == {"added": 0, "modified": 0, "deleted": 0}
    assert rows["z-empty"]["state"] == "empty"
    r = user.cli(["status"], cwd=project)
    line = {ln.split()[0]: ln.split() for ln in ok(r).splitlines()[1:]}
    assert line["a-gone"][3] == "project-gone" and "stockade: a-gone: project " in r.stderr.decode()

    # the automatic collector (the process a run starts now and then)
    r = user.py("from stockade.changes import retention\n"
                "import json; print(json.dumps([o.to_json() for o in retention.collect_auto()]))")
    outs = {o["id"]: o for o in json.loads(ok(r))}
    assert outs["z-empty"]["action"] == "removed" and outs["b-gone-empty"]["action"] == "removed", outs
    assert outs["a-gone"]["action"] == "skipped" and outs["a-gone"]["state"] == "project-gone"
    assert sessions(user.state) == {"a-gone"}

    # `clean --older-than`: the same rule; --include-unapplied takes its changes too
    ok(user.cli(["run", "--session", "z-empty", "--", "true"], cwd=project))
    age(user.state, "z-empty", 10 * DAY)
    data = clean_json(user, project, "--older-than", "7d")
    assert data["removed"] == ["z-empty"]
    s = skipped(data)["a-gone"]
    assert s["state"] == "project-gone" and "--include-unapplied" in str(s["reason"])
    r = user.cli(["clean", "--older-than", "7d"], cwd=project)
    assert r.returncode == 0 and "kept a-gone (project-gone): project " in r.stderr.decode()
    data = clean_json(user, project, "--older-than", "7d", "--include-unapplied", "--dry-run")
    assert data["would_remove"] == ["a-gone"] and sessions(user.state) == {"a-gone"}

    # `clean S` and `clean --all` remove it
    r = user.cli(["clean", "a-gone"], cwd=project)
    assert r.returncode == 0 and "removed 1 session(s): a-gone" in r.stderr.decode(), r.stderr
    _gone_project(user, project, "c-gone", "echo y > new")
    ok(user.cli(["run", "--session", "d-kept", "--", "sh", "-c", "echo x > g"], cwd=project))
    data = clean_json(user, project, "--all")
    assert sorted(data["removed"]) == ["c-gone", "d-kept"] and sessions(user.state) == set()  # type: ignore[arg-type]


def test_a_broken_session_is_skipped_with_its_reason(user: User, project: Path) -> None:
    """An unreadable meta.json, one that names no project, and (unprivileged) a session
    directory the caller may not rename are each skipped with the reason; the sessions
    after them are collected. `clean S` removes an unreadable one."""
    for sid in ("a-bad-json", "b-no-project", "c-not-mine", "z-empty"):
        ok(user.cli(["run", "--session", sid, "--", "true"], cwd=project))
    d = user.state / "sessions"
    (d / "a-bad-json" / "meta.json").write_text("{")
    (d / "b-no-project" / "meta.json").write_text('{"note": "no project"}')
    if user.name != "root":  # a directory of another owner: its rename is refused (EACCES)
        os.chown(d / "c-not-mine", 0, 0)
    for sid in ("a-bad-json", "b-no-project", "c-not-mine", "z-empty"):
        age(user.state, sid, 10 * DAY)

    rows = {r["id"]: r for r in json.loads(ok(user.cli(["status", "--json"], cwd=project)))}
    assert rows["a-bad-json"]["state"] == "unreadable" and "meta.json is unreadable" in rows["a-bad-json"]["reason"]
    assert rows["b-no-project"]["state"] == "unreadable" and "names no project" in rows["b-no-project"]["reason"]
    # `list`: an unreadable record has no creation time, so no age (not one since 1970)
    listed = {r["session"]: r for r in json.loads(ok(user.cli(["list", "--json"], cwd=project)))}
    assert listed["a-bad-json"]["age_s"] is None and "error" in listed["a-bad-json"]["changes"], listed
    assert 0 <= listed["z-empty"]["age_s"] < 3600, listed
    table = ok(user.cli(["list"], cwd=project)).splitlines()
    assert next(ln for ln in table if ln.startswith("a-bad-json")).split()[1] == "?", table

    r = user.py("from stockade.changes import retention\n"
                "import json; print(json.dumps([o.to_json() for o in retention.collect_auto()]))")
    outs = {o["id"]: o for o in json.loads(ok(r))}
    assert outs["z-empty"]["action"] == "removed", outs
    for sid, why in (("a-bad-json", "meta.json is unreadable"), ("b-no-project", "names no project")):
        assert outs[sid]["action"] == "skipped" and why in outs[sid]["reason"], outs
        assert f"stockade clean {sid}" in outs[sid]["reason"]
    if user.name != "root":
        assert outs["c-not-mine"]["action"] == "skipped" and outs["c-not-mine"]["state"] == "error"
        assert "Permission denied" in outs["c-not-mine"]["reason"], outs
        r = user.cli(["clean", "c-not-mine"], cwd=project)
        err = r.stderr.decode()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and "Permission denied" in err, err
        os.chown(d / "c-not-mine", user.uid, user.gid)
    else:
        assert outs["c-not-mine"]["action"] == "removed"
    r = user.cli(["clean", "a-bad-json"], cwd=project)
    assert r.returncode == 0 and "removed 1 session(s): a-bad-json" in r.stderr.decode(), r.stderr
    data = clean_json(user, project, "--older-than", "7d", "--include-unapplied")
    assert "b-no-project" in data["removed"]  # type: ignore[operator]
    assert sessions(user.state) <= {"c-not-mine"}
