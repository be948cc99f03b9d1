"""What a run leaves on record and prints (issue #12 items 4 and 12), through both CLI paths.

Item 4: a secret on the command line is redacted once, when the run is recorded, so no
sink shows it: run.json, events.jsonl, `status` (text and --json), `log` (text and
--json), the export bundle, the warm cache; nothing in the state dir but the command's
own output holds it.
Item 12: what `stockade run` writes to stderr, exactly, as the README says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ..conftest import ROOT, User

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served

# every form a secret takes on a command line; the command ignores its arguments, so
# its own output (stdout.log) holds none of them
RUNS: list[list[str]] = [
    ["true", "--password=hunter2a", "--token", "tok3n55", "API_KEY=k3yv4lue", "https://bob:pw9zzq@h.example/r.git"],
    ["sh", "-c", "true DB_PASSWORD=scr1ptpw --auth-token scr1pttok 'Authorization: Bearer hdr9xq'", "sh"],
]
SECRETS = [b"hunter2a", b"tok3n55", b"k3yv4lue", b"pw9zzq", b"scr1ptpw", b"scr1pttok", b"hdr9xq"]


def _no_secret(where: str, data: bytes) -> None:
    for s in SECRETS:
        assert s not in data, f"{s.decode()} in {where}: {data[:2000]!r}"


def test_no_sink_shows_a_secret_from_argv(user: User, project: Path) -> None:
    for argv in RUNS:
        r = user.cli(["run", "--session", "sec", "--", *argv], cwd=project)
        assert r.returncode == 0, r.stderr.decode()
        _no_secret("run's stderr", r.stderr)

    # the records themselves: redacted, and there
    run_dir = user.state / "sessions" / "sec" / "runs"
    recs = [json.loads((run_dir / n / "run.json").read_text()) for n in ("1", "2")]
    assert recs[0]["argv"] == ["true", "--password=[REDACTED]", "--token", "[REDACTED]", "API_KEY=[REDACTED]",
                               "https://bob:[REDACTED]@h.example/r.git"]
    assert recs[1]["argv"][2] == "true DB_PASSWORD=[REDACTED] --auth-token [REDACTED] 'Authorization: [REDACTED]"
    events = [json.loads(x) for x in (user.state / "sessions" / "sec" / "events.jsonl").read_text().splitlines()]
    assert [e["argv"] for e in events if e["operation"] == "run"] == [recs[0]["argv"], recs[1]["argv"]]

    # every file of the state dir but the command's own output (the warm cache, servers' logs...)
    files = [p for p in user.state.rglob("*") if p.is_file() and p.name not in ("stdout.log", "stderr.log")]
    assert any(p.name == "run.json" for p in files)
    for p in files:
        _no_secret(str(p), p.read_bytes())

    # a record is the caller's only, like the output logs
    assert [(run_dir / n / "run.json").stat().st_mode & 0o777 for n in ("1", "2")] == [0o600, 0o600]

    # every verb that shows a record, and the plan explain prints
    for args in (["status", "sec"], ["status", "--json", "sec"], ["log", "sec"], ["log", "--json", "sec"],
                 ["list"], ["list", "--json"], ["explain", "--", *RUNS[0]]):
        r = user.cli(args, cwd=project)
        assert r.returncode == 0, (args, r.stderr.decode())
        _no_secret(" ".join(args), r.stdout + r.stderr)
        if args[0] != "list":
            assert b"REDACTED" in r.stdout, (args, r.stdout.decode())
    bundle = user.home / "bundle"
    r = user.cli(["export", "sec", str(bundle)], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    exported = [p for p in bundle.rglob("*") if p.is_file()]
    assert {"status.json", "events.jsonl"} <= {p.name for p in exported}
    for p in exported:
        _no_secret(f"export {p.name}", p.read_bytes())
    status = json.loads((bundle / "status.json").read_text())
    assert [x["argv"] for x in status["runs"]] == [recs[0]["argv"], recs[1]["argv"]]


_ID = r"[0-9]{4}-[0-9a-f]{6}"


def test_run_stderr_is_exactly_what_the_readme_says(user: User, project: Path) -> None:
    # a new session, no changes: its id, so a script can find it
    r = user.cli(["run", "--", "true"], cwd=project)
    assert r.returncode == 0 and r.stdout == b""
    m = re.fullmatch(rf"stockade: session ({_ID})\n", r.stderr.decode())
    assert m, r.stderr
    sid = m.group(1)
    # a new named session: the same line
    r = user.cli(["run", "--session", "named", "--", "true"], cwd=project)
    assert (r.returncode, r.stderr) == (0, b"stockade: session named\n")
    # an existing session, no changes: nothing at all
    r = user.cli(["run", "--session", sid, "--", "true"], cwd=project)
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    # changes: the summary line (the command's own output first, untouched)
    r = user.cli(["run", "--session", sid, "--", "sh", "-c", "echo x > new.txt; echo out; echo err >&2"], cwd=project)
    assert r.returncode == 0 and r.stdout == b"out\n"
    want = f"stockade: session {sid} — 1 added, 0 modified, 0 deleted; review: stockade diff {sid}\n"
    assert r.stderr.decode() == "err\n" + want
    # a later run without changes of its own: the session's changes are still summed up
    r = user.cli(["run", "--session", sid, "--", "true"], cwd=project)
    assert r.stderr.decode() == want
    # the command could not start: that line (the session has no changes)
    r = user.cli(["run", "--session", "named", "--", "/nonexistent/cmd"], cwd=project)
    assert (r.returncode, r.stderr) == (127, b"stockade: /nonexistent/cmd: command not found\n")
    # a name that is not UTF-8: its bytes escaped, as the record has them (no traceback)
    r = user.cli(["run", "--session", "named", "--", b"\x9bx"], cwd=project)  # type: ignore[list-item]
    assert (r.returncode, r.stderr) == (127, b"stockade: \\x9bx: command not found\n")


def test_readme_states_the_stderr_contract() -> None:
    """The README's words for the cases above (it once said "nothing when the run changed nothing")."""
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "or nothing when the run changed nothing" not in text
    assert "else, on a session's first run only, its id, so a script can find it: `stockade: session 1122-a2427f`" in text
    assert "a later run that leaves the session without changes prints nothing" in text
    assert re.search(rf"stockade: session {_ID} — 3 added, 1 modified, 2 deleted; review: stockade diff {_ID}", text)
