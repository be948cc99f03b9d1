"""Bad input creates nothing (issue #12 items 9 and 10): each case exits 2 with one line
naming what was wrong, and the state dir lists exactly what it listed before, through
the in-process and the served CLI, as root and unprivileged."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ..conftest import User

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served

# (argv, what the one line must say); "existing" is a session of the project
CASES: list[tuple[list[str], str]] = [
    (["run", "--cwd", "/etc", "--", "true"], "--cwd '/etc' is outside the project"),
    (["run", "--session", "brandnew", "--cwd", "/etc", "--", "true"], "--cwd '/etc' is outside the project"),
    (["run", "--session", "existing", "--cwd", "/etc", "--", "true"], "--cwd '/etc' is outside the project"),
    (["run", "--session", "brandnew", "--pass-fd", "77", "--", "true"], "--pass-fd 77"),
    (["run", "--seccomp", "/nonexistent/profile.json", "--", "true"], "/nonexistent/profile.json"),
    (["run", "--allow-degraded", "bogus", "--", "true"], "--allow-degraded bogus"),
    (["run", "--no-landlock", "--", "true"], "--allow-degraded landlock"),
    (["run", "--memory", "-5M", "--", "true"], "--memory: invalid value '-5M'"),
    (["run", "--timeout", "-1s", "--", "true"], "--timeout: invalid value '-1s'"),
    (["run", "--user", "-5", "--", "true"], "--user: invalid value '-5'"),
    (["run", "--session", "bad/name", "--", "true"], "invalid session name 'bad/name'"),
    (["run", "--net", "bogus", "--", "true"], "--net: invalid choice"),
    (["run", "--"], "no command given"),
    (["run", "--", ""], "the command is an empty string; give a program name"),
    (["run", "--session", "brandnew", "--", ""], "the command is an empty string"),
    ([], "stockade: no command given; try `stockade run -- CMD`, or `stockade --help` for every verb"),
    (["run", "--project", "/nonexistent/p", "--", "true"], "/nonexistent/p"),
    (["explain", "--cwd", "/etc", "--", "true"], "--cwd '/etc' is outside the project"),
    (["deny", "--session", "nosuch", "/x"], "no session named 'nosuch'; list them with `stockade list`"),
    (["allow", "--session", "nosuch", "/usr"], "no session named 'nosuch'; list them with `stockade list`"),
    (["status", "nosuch"], "unknown session 'nosuch' (nor a path in session existing); list sessions with `stockade list`"),
    (["diff", "nosuch"], "unknown session 'nosuch'"),
    (["log", "nosuch"], "no session named 'nosuch'"),
]


def listing(state: Path) -> list[tuple[str, str, int]]:
    """Every entry of the state dir (type, size of files), but the sockets and locks of
    live servers and launchers, which come and go with their idle timeouts."""
    out = []
    for dirpath, dirnames, filenames in os.walk(state):
        rel = os.path.relpath(dirpath, state)
        if rel.split("/")[0] in ("servers", "launchers"):
            continue
        for n in dirnames:
            out.append((os.path.join(rel, n), "d", 0))
        for n in filenames:
            st = os.lstat(os.path.join(dirpath, n))
            out.append((os.path.join(rel, n), "f", st.st_size))
    return sorted(out)


def check_bad(user: User, project: Path, argv: list[str], says: str) -> None:
    """One line naming what was wrong, exit status 2, nothing on stdout, and the state
    dir exactly as it was."""
    before = listing(user.state)
    r = user.cli(argv, cwd=project)
    err = r.stderr.decode()
    assert r.returncode == 2, (argv, err)
    assert err.startswith("stockade: ") and err.count("\n") == 1 and says in err, (argv, err)
    assert r.stdout == b"", argv
    assert listing(user.state) == before, (argv, err)


def test_bad_input_creates_nothing(user: User, project: Path) -> None:
    r = user.cli(["run", "--session", "existing", "--", "true"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    cases = list(CASES)
    if user.name == "unpriv":  # (as root, --user is item 6's: a run that works)
        cases.append((["run", "--user", "1000", "--", "true"], "--user needs real root"))
    for argv, says in cases:
        check_bad(user, project, argv, says)


def test_a_run_that_fails_to_start_leaves_no_new_session(api_project: Path, state_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox that fails its setup (the kernel refused a step) in a session the run
    made: the session goes too. An existing session keeps the failed run's record."""
    import stockade
    from stockade.errors import SandboxError
    from stockade.launch import start as launch

    stockade.run(["true"], project=api_project, session="existing")
    before = listing(state_dir)

    def refuse(*_a: object, **_k: object) -> None:
        raise SandboxError("clone3", errno=errno.ENOSPC, remedy="(test)")

    monkeypatch.setattr(launch, "start", refuse)
    for session in (None, "fresh"):
        with pytest.raises(SandboxError):
            stockade.run(["true"], project=api_project, session=session)
        assert listing(state_dir) == before
    with pytest.raises(SandboxError):
        stockade.run(["true"], project=api_project, session="existing")
    assert (state_dir / "sessions" / "existing" / "runs" / "2").is_dir()
