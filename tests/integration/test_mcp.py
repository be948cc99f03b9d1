"""`stockade mcp` (issue 18, part 1): the real server (`python -m stockade mcp`, as root
and as uid 65534) driven over stdio by the MCP SDK's own client (``stdio_client`` +
``ClientSession``), or, where a test needs the server's process in hand (a client that
goes mid-exec), by hand-written JSON-RPC lines on its stdin.

What the sandbox did is checked from the host: the project's files (never changed
but by an allowed apply), the holder's record, the sandbox's PID namespace, its
overlay mounts and its cgroups (``test_live``'s helpers).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from ..conftest import User, tree_snapshot
from .test_live import alive, assert_all_gone, in_tree, observe, record, run_cgroups, wait_for

TOOLS = {"exec", "run", "start", "stop", "status", "diff", "snapshot", "restore", "discard", "apply"}
# names a tool argument must never have: what the server's command line and config decide
WIDENING = {"net", "network", "allow", "allow_host", "allow_hosts", "forward", "mount", "mounts", "grant",
            "grants", "memory", "cpus", "pids", "limits", "root", "user", "seccomp", "landlock", "read_only",
            "policy", "project", "session", "pass_fds", "deny", "unmask"}


def server_argv(user: User, project: Path, *args: str) -> list[str]:
    return [*user.prefix(), user.python, "-m", "stockade", "mcp", "--project", str(project), *args]


@asynccontextmanager
async def client(user: User, project: Path, *args: str) -> AsyncIterator[ClientSession]:
    """A ClientSession of the SDK on a real `stockade mcp` it spawned (stderr kept aside)."""
    argv = server_argv(user, project, *args)
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=user.env(), cwd=str(project))
    with tempfile.TemporaryFile("w+") as errlog:
        try:
            async with stdio_client(params, errlog=errlog) as (r, w), ClientSession(r, w) as s:
                await s.initialize()
                yield s
        except BaseException:
            errlog.seek(0)
            print("server stderr:", errlog.read())
            raise
        errlog.seek(0)
        err = errlog.read()
    # stderr is the server's log: lines of its own, never the protocol
    assert all(line.startswith(("stockade mcp: ", "stockade: ")) for line in err.splitlines()), err


def drive(body: Callable[[], Awaitable[None]]) -> None:
    """Run an async test body; a failure inside the SDK's task groups is raised bare."""
    try:
        anyio.run(body)
    except BaseExceptionGroup as g:
        leaf: BaseException = g
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        raise leaf from None


async def call(s: ClientSession, tool: str, **args: Any) -> tuple[str, dict[str, Any]]:
    """A call that must succeed: its text and its structured content."""
    res = await s.call_tool(tool, args)
    text = "".join(c.text for c in res.content if c.type == "text")
    assert not res.is_error, f"{tool} {args}: {text}"
    assert isinstance(res.structured_content, dict)
    return text, res.structured_content


async def fails(s: ClientSession, tool: str, **args: Any) -> str:
    """A call that must give an error result of one line."""
    res = await s.call_tool(tool, args)
    text = "".join(c.text for c in res.content if c.type == "text")
    assert res.is_error, f"{tool} {args} did not fail: {text}"
    assert text.startswith(f"{tool}: ") and "\n" not in text, text
    return text


# --------------------------------------------------------------------------- the tools


def test_tools_and_their_schemas(user: User, project: Path) -> None:
    async def body() -> None:
        async with client(user, project) as s:
            listed = {t.name: t for t in (await s.list_tools()).tools}
            assert set(listed) == TOOLS
            for t in listed.values():
                sch = t.input_schema
                assert sch["type"] == "object" and sch["additionalProperties"] is False, (t.name, sch)
                assert not set(sch["properties"]) & WIDENING, (t.name, sch["properties"])
                assert t.description and len(t.description) > 60, t.name
                for name, prop in sch["properties"].items():
                    assert prop.get("description"), (t.name, name)
            for name in ("exec", "run"):
                sch = listed[name].input_schema
                assert set(sch["properties"]) == {"command", "cwd", "env", "timeout", "stdin"}
                assert sch["required"] == ["command"]
                assert sch["properties"]["command"]["type"] == "string"
            assert set(listed["diff"].input_schema["properties"]) == {"paths", "stat"}
            assert listed["restore"].input_schema["required"] == ["name"]
            for name in ("start", "stop", "status"):
                assert listed[name].input_schema["properties"] == {}
            ann = {n: t.annotations for n, t in listed.items()}
            assert ann["status"] is not None and ann["status"].read_only_hint
            assert ann["diff"] is not None and ann["diff"].read_only_hint
            assert ann["apply"] is not None and ann["apply"].destructive_hint
            # before anything ran: no session, and nothing made
            text, data = await call(s, "status")
            assert data["session"] is None and "no session yet" in text
        assert not (user.state / "sessions").exists() or not [
            p for p in (user.state / "sessions").iterdir() if not p.name.startswith(".")]
    drive(body)


def test_exec_diff_snapshot_restore_and_run(user: User, project: Path) -> None:
    before = tree_snapshot(project)

    async def body() -> None:
        async with client(user, project) as s:
            text, r = await call(s, "exec", command="echo one > new.txt && echo changed >> README.md && rm data.bin "
                                                   "&& echo out && echo err >&2; exit 3")
            sid = r["session"]
            assert r["exit_status"] == 3 and r["stdout"]["text"] == "out\n" and r["stderr"]["text"] == "err\n"
            assert text.startswith(f"exit status 3 (exited(3)) · session {sid}, run "), text
            lv = observe(user, sid)  # a living sandbox, started by the first exec
            try:
                assert lv.record["owner_pid"] > 0 and alive(lv.record["owner_pid"])
                # the next exec sees the files; the project does not
                _, r = await call(s, "exec", command="cat ../new.txt ../README.md; ls", cwd="src")
                assert r["stdout"]["text"] == "one\n# demo\nchanged\nmain.py\n" and r["session"] == sid
                assert tree_snapshot(project) == before
                # a variable added for one command; the sandbox's own stay
                _, r = await call(s, "exec", command="echo $GREETING-$HOME", env={"GREETING": "hi"})
                assert r["stdout"]["text"].startswith("hi-/")
                # stdin
                _, r = await call(s, "exec", command="tr a-z A-Z", stdin="quiet\n")
                assert r["stdout"]["text"] == "QUIET\n"
                # the diff: whole, per path, --stat
                text, d = await call(s, "diff")
                assert d["session"] == sid and f"session {sid}" in text
                assert "+++ b/new.txt" in text and "+one" in text and "+changed" in text
                assert "deleted file mode" in text and ("Binary files" in text or "GIT binary patch" in text)
                assert {c["path"]: c["kind"] for c in d["changes"]} == {
                    "new.txt": "added", "README.md": "modified", "data.bin": "deleted"}
                text, d = await call(s, "diff", paths=["new.txt"])
                assert "+one" in text and "README" not in text.split("\n", 1)[1]
                assert [c["path"] for c in d["changes"]] == ["new.txt"]
                text, _ = await call(s, "diff", stat=True)
                assert re.search(r"new\.txt +\| 1 \+", text) and "README.md" in text and "3 files changed" in text
                # a snapshot of the running sandbox, more changes, back to it
                _, d = await call(s, "snapshot", name="s1")
                assert d["snapshot"] == "s1"
                await call(s, "exec", command="echo two > later.txt && rm new.txt")
                _, d = await call(s, "status")
                assert {c["path"] for c in d["changes"]} == {"later.txt", "README.md", "data.bin"}
                assert d["snapshots"] == ["s1"]
                text, d = await call(s, "restore", name="s1")
                assert d["sandbox_stopped"] is True and "stopped first" in text
                assert_all_gone(lv, timeout=15, cgroups=False)
            finally:
                lv.close()
            _, d = await call(s, "status")
            assert {c["path"] for c in d["changes"]} == {"new.txt", "README.md", "data.bin"}
            assert d["sandbox"] == "not running"
            # a one-shot run, same session: it sees the restored files and leaves nothing running
            text, r = await call(s, "run", command="cat new.txt; test ! -e later.txt && echo gone >> new.txt")
            assert r["session"] == sid and r["stdout"]["text"] == "one\n" and r["exit_status"] == 0
            # exec again: a new living sandbox over the same files
            _, r = await call(s, "exec", command="cat new.txt")
            assert r["stdout"]["text"] == "one\ngone\n" and r["session"] == sid
            # run is refused while it lives, and says what to do
            msg = await fails(s, "run", command="true")
            assert "living sandbox" in msg and "stop" in msg
            text, d = await call(s, "stop")
            assert d["stopped"] is True
            _, r = await call(s, "run", command="echo ok")
            assert r["stdout"]["text"] == "ok\n"
            # discard one path: the project is untouched, the session loses it
            _, d = await call(s, "discard", paths=["data.bin"])
            assert d["discarded"] == ["data.bin"]
            _, d = await call(s, "status")
            assert {c["path"] for c in d["changes"]} == {"new.txt", "README.md"}
        assert tree_snapshot(project) == before
        st = json.loads(user.cli(["status", sid, "--json"], timeout=60).stdout)
        assert {c["path"] for c in st["changes"]} == {"new.txt", "README.md"}
        kinds = [r.get("kind") for r in st["runs"]]
        assert kinds.count("exec") >= 6 and kinds.count("sandbox") == 2
    drive(body)


def test_output_is_cut_past_the_cap_with_a_note(user: User, project: Path) -> None:
    async def body() -> None:
        async with client(user, project, "--max-output", "4K") as s:
            text, r = await call(s, "exec", command="seq 1 100000; seq 1 3 >&2")
            assert "bytes of stdout left out" in text and text.endswith("--- stderr ---\n1\n2\n3")
            so = r["stdout"]
            assert so["bytes"] == len("".join(f"{i}\n" for i in range(1, 100001))) and so["omitted_bytes"] > 0
            assert so["text"].startswith("1\n2\n3\n") and so["text"].endswith("99999\n100000\n")
            assert "bytes of stdout left out" in so["text"] and "--max-output" in so["text"]
            assert len(so["text"].encode()) < 4096 + 400
            assert r["stderr"] == {"text": "1\n2\n3\n", "bytes": 6, "omitted_bytes": 0}
            # the session keeps the whole stream
            log = user.state / "sessions" / r["session"] / "runs" / str(r["run"]) / "stdout.log"
            assert log.stat().st_size == so["bytes"]
            await call(s, "stop")
            _, r = await call(s, "run", command="head -c 100000 /dev/zero | tr '\\0' x")
            assert r["stdout"]["omitted_bytes"] == 100000 - 4096
    drive(body)


def test_the_server_options_bind_every_command(user: User, project: Path) -> None:
    """The sandbox is the server's: --read-only and --timeout hold whatever a call asks."""
    async def body() -> None:
        async with client(user, project, "--read-only", "--timeout", "1s") as s:
            _, r = await call(s, "run", command="sleep 30", timeout=60)
            assert r["exit_status"] == 124, r
            _, r = await call(s, "exec", command="touch x 2>&1; echo $?")
            assert "Read-only file system" in r["stdout"]["text"], r
            t0 = time.monotonic()
            _, r = await call(s, "exec", command="sleep 30", timeout=60)
            assert r["exit_status"] == 124 and time.monotonic() - t0 < 15, r
            _, r = await call(s, "exec", command="sleep 5", timeout=0.5)
            assert r["exit_status"] == 124, r
    drive(body)


def test_the_diff_names_the_risks(user: User, project: Path) -> None:
    async def body() -> None:
        async with client(user, project) as s:
            await call(s, "exec", command="mkdir -p .github/workflows && echo 'on: push' > .github/workflows/ci.yml "
                                          "&& printf '#!/bin/sh\\necho hi\\n' > run.sh && chmod +x run.sh")
            text, d = await call(s, "diff")
            rules = {r["rule"]: r for r in d["risks"]}
            assert {"ci-config", "executable"} <= set(rules), d["risks"]
            assert rules["ci-config"]["paths"] == [".github/workflows/ci.yml"]
            assert "risks: " in text and "ci-config" in text and "run.sh" in text
            assert d["risk_counts"] == {k: sum(1 for r in d["risks"] if r["severity"] == k)
                                        for k in ("high", "medium", "low")}
            _, d = await call(s, "diff", paths=["run.sh"])  # the risks of the paths asked for
            assert {r["rule"] for r in d["risks"]} == {"executable"}
    drive(body)


# --------------------------------------------------------------------------- apply


def test_apply_is_gated_then_allowed_by_config(user: User, project: Path) -> None:
    before = tree_snapshot(project)
    got: dict[str, str] = {}

    async def gated() -> None:
        async with client(user, project) as s:
            _, r = await call(s, "exec", command="echo applied > new.txt && echo more >> README.md")
            sid = got["sid"] = r["session"]
            text, d = await call(s, "apply")
            assert d["applied"] is False and d["gated"] is True
            assert d["apply_command"] == f"stockade apply -s {sid}" and f"stockade apply -s {sid}" in text
            assert d["review_command"] == f"stockade review {sid}" and f"`stockade review {sid}`" in text
            _, d = await call(s, "apply", paths=["new.txt"])
            assert d["apply_command"] == f"stockade apply -s {sid} new.txt"
            _, d = await call(s, "status")
            assert d["apply_allowed"] is False and len(d["changes"]) == 2
        assert tree_snapshot(project) == before

    drive(gated)
    sid = got["sid"]
    conf = user.home / ".config" / "stockade" / "config.toml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("[mcp]\nallow_apply = true\n")
    user.own(user.home / ".config")

    async def allowed() -> None:
        async with client(user, project, "--session", sid) as s:
            _, d = await call(s, "status")
            assert d["session"] == sid and d["apply_allowed"] is True
            _, r = await call(s, "exec", command="cat new.txt")  # the sandbox over the named session
            assert r["stdout"]["text"] == "applied\n" and r["session"] == sid
            text, d = await call(s, "apply", paths=["new.txt"])
            assert d["applied"] == ["new.txt"] and d["apply_id"] and d["sandbox_stopped"] is True
            assert f"stockade rollback {d['apply_id']}" in text
            assert (project / "new.txt").read_text() == "applied\n"
            assert (project / "README.md").read_text() == "# demo\n"
            text, d = await call(s, "apply")
            assert d["applied"] == ["README.md"]
            msg = await fails(s, "apply")  # nothing left
            assert sid in msg or "nothing" in msg
    drive(allowed)
    assert (project / "README.md").read_text() == "# demo\nmore\n"
    r = user.cli(["status", sid, "--json"], timeout=60)
    assert json.loads(r.stdout)["changes"] == []


def test_held_back_paths_never_apply_through_mcp_even_named(user: User, project: Path) -> None:
    """The security review's repro: with allow_apply on, the agent writes a git hook, an
    .envrc and a .stockade.toml that widens its network, and names them in apply. They
    stay held back (the host project unchanged for them, checked from the host); a plain
    file in the same call is applied; the answer names the person's command for the rest."""
    (project / ".git" / "hooks").mkdir(parents=True)
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    user.own(project / ".git")
    conf = user.home / ".config" / "stockade" / "config.toml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("[mcp]\nallow_apply = true\n")
    user.own(user.home / ".config")
    before = tree_snapshot(project)
    held = [".git/hooks/pre-commit", ".envrc", ".stockade.toml"]

    async def body() -> None:
        async with client(user, project) as s:
            _, r = await call(s, "exec", command=(
                "printf '#!/bin/sh\\ntouch /tmp/pwned\\n' > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit"
                " && echo 'export PWNED=1' > .envrc && printf '[network]\\nmode = \"host\"\\n' > .stockade.toml"
                " && echo fine > ok.txt"))
            assert r["exit_status"] == 0, r
            sid = r["session"]
            _, d = await call(s, "diff", stat=True)
            assert set(held) <= set(d["held_back"]), d["held_back"]
            text, d = await call(s, "apply", paths=[*held, "ok.txt"])
            assert d["applied"] == ["ok.txt"], d
            assert set(held) <= set(d["held_back"]), d
            assert "held back (3): a person applies these after review" in text, text
            assert f"stockade apply -s {sid} " in text and f"`stockade review {sid}`" in text, text
            assert (project / "ok.txt").read_text() == "fine\n"
            # named alone, or the whole .git, or everything: still nothing, and said how a person does it
            for paths in ([".git/hooks/pre-commit"], [".git"], [".stockade.toml", ".envrc"], []):
                msg = await fails(s, "apply", paths=paths)
                assert "nothing to apply" in msg and "held back" in msg, msg
                assert "a person applies these after review" in msg and f"stockade review {sid}" in msg, msg
                assert "name them explicitly" not in msg, msg
            _, d = await call(s, "status")  # still in the session, for a person's review
            assert {c["path"] for c in d["changes"]} >= set(held), d["changes"]
    drive(body)
    after = tree_snapshot(project)
    assert after.pop("ok.txt")[1] == b"fine\n"
    assert after == before  # the hook, .envrc and .stockade.toml never reached the project
    assert not (project / ".git" / "hooks" / "pre-commit").exists() and not (project / ".stockade.toml").exists()
    # the next run gets the policy as it was: no host network
    r = user.cli(["policy", "show", "--json"], cwd=project, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["network"]["mode"] != "host"


def test_allow_apply_from_the_project_config_is_refused_at_start(user: User, project: Path) -> None:
    """A cloned repo's committed config cannot open the apply gate: [mcp] allow_apply in the
    project's .stockade.toml (or pyproject.toml) stops the server before it serves, naming
    the file and the global config; nothing is created."""
    state_before = sorted(p.name for p in (user.state / "sessions").iterdir()) if (user.state / "sessions").exists() \
        else []
    before = tree_snapshot(project)
    for name, text in ((".stockade.toml", "[mcp]\nallow_apply = true\n"),
                       ("pyproject.toml", '[project]\nname = "x"\n\n[tool.stockade.mcp]\nallow_apply = true\n')):
        f = project / name
        f.write_text(text)
        user.own(f)
        r = subprocess.run(server_argv(user, project), env=user.env(), capture_output=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        err = r.stderr.decode()
        assert r.returncode == 2 and r.stdout == b"", err
        assert err.startswith("stockade: ") and str(f) in err and "mcp.allow_apply" in err, err
        assert "global config only" in err and len(err.strip().splitlines()) == 1, err
        f.unlink()
    assert tree_snapshot(project) == before
    state_after = sorted(p.name for p in (user.state / "sessions").iterdir()) if (user.state / "sessions").exists() \
        else []
    assert state_after == state_before


def test_a_tool_env_cannot_reach_the_servers_config(user: User, project: Path) -> None:
    """The tools' env goes into the sandbox only: pointing XDG_CONFIG_HOME or HOME at a
    config that turns allow_apply on leaves the server's gate closed."""
    evil = project.parent / "evil-config"
    (evil / "stockade").mkdir(parents=True)
    (evil / "stockade" / "config.toml").write_text("[mcp]\nallow_apply = true\n")
    (evil / ".config" / "stockade").mkdir(parents=True)
    (evil / ".config" / "stockade" / "config.toml").write_text("[mcp]\nallow_apply = true\n")
    user.own(evil)
    before = tree_snapshot(project)

    async def body() -> None:
        async with client(user, project) as s:
            await call(s, "exec", command="echo x > new.txt")
            for tool in ("exec", "run"):
                for env in ({"XDG_CONFIG_HOME": str(evil)}, {"HOME": str(evil)}):
                    # refused by the environment rules, or given to the sandbox's command only
                    await s.call_tool(tool, {"command": "echo y >> new.txt", "env": env})
                    _, d = await call(s, "status")
                    assert d["apply_allowed"] is False, (tool, env)
                    text, d = await call(s, "apply", paths=["new.txt"])
                    assert d["applied"] is False and d["gated"] is True, text
    drive(body)
    assert tree_snapshot(project) == before


# --------------------------------------------------------------------------- bad input


def test_bad_arguments_are_one_line_errors_and_the_server_stays_up(user: User, project: Path) -> None:
    async def body() -> None:
        async with client(user, project) as s:
            msg = await fails(s, "exec", command="id", network="host")
            assert "unknown argument 'network'" in msg and "never by a tool call" in msg
            for extra in ({"allow": ["/etc"]}, {"memory": "8G"}, {"root": True}, {"mounts": ["/:/host"]}):
                msg = await fails(s, "exec", command="id", **extra)
                assert f"unknown argument {next(iter(extra))!r}" in msg
            msg = await fails(s, "start", net="host")
            assert "start takes no arguments" in msg
            assert "'command' is required" in await fails(s, "exec")
            assert "'timeout'" in await fails(s, "exec", command="true", timeout="5")
            assert "'timeout'" in await fails(s, "exec", command="true", timeout=-1)
            assert "'command'" in await fails(s, "exec", command=["ls", "-l"])
            assert "outside the project" in await fails(s, "exec", command="true", cwd="/etc")
            assert "outside the project" in await fails(s, "exec", command="true", cwd="../..")
            assert "no such directory" in await fails(s, "exec", command="true", cwd="nope")
            msg = await fails(s, "exec", command="true", env={"GITHUB_TOKEN": "x"})
            assert "'GITHUB_TOKEN'" in msg and "policy" in msg
            assert "no session yet" in await fails(s, "diff")
            res = await s.call_tool("nosuchtool", {})
            assert res.is_error and "unknown tool 'nosuchtool'" in res.content[0].text  # type: ignore[union-attr]
            # the server is up: a following call works
            _, r = await call(s, "exec", command="echo still here")
            assert r["stdout"]["text"] == "still here\n"
            msg = await fails(s, "restore", name="nope")
            assert "nope" in msg
            msg = await fails(s, "diff", paths=["no/such/path"])
            assert "no/such/path" in msg
            _, r = await call(s, "exec", command="echo and here")
            assert r["exit_status"] == 0
    drive(body)


def test_bad_server_options_are_refused_before_serving(user: User, project: Path) -> None:
    for args, want in ((["--max-output", "1"], "--max-output"), (["--net", "bogus"], "--net"),
                       (["--", "ls"], "takes no command"), (["--pass-fd", "3"], "--pass-fd"),
                       (["--session", "../x"], "session")):
        r = subprocess.run(server_argv(user, project, *args), env=user.env(), capture_output=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        err = r.stderr.decode()
        assert r.returncode == 2 and err.startswith("stockade: ") and want in err, (args, err)
        assert r.stdout == b""
    # a session of another project
    other = project.parent / "other"
    other.mkdir()
    user.own(other)
    r = user.cli(["run", "--session", "theirs", "--", "true"], cwd=other, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    r = subprocess.run(server_argv(user, project, "--session", "theirs"), env=user.env(), capture_output=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "belongs to project" in r.stderr.decode(), r.stderr.decode()
    conf = user.home / ".config" / "stockade" / "config.toml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("[mcp]\nallow_apply = \"yes\"\n")
    user.own(user.home / ".config")
    r = subprocess.run(server_argv(user, project), env=user.env(), capture_output=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "mcp.allow_apply" in r.stderr.decode(), r.stderr.decode()


# --------------------------------------------------------------------------- the client goes


class RawClient:
    """`stockade mcp` with JSON-RPC written by hand: the test holds the server's process."""

    def __init__(self, user: User, project: Path) -> None:
        self.p = subprocess.Popen(server_argv(user, project), env=user.env(), cwd=project, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.buf = b""
        self.n = 0
        self.send({"jsonrpc": "2.0", "id": self.next(), "method": "initialize",
                   "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                              "clientInfo": {"name": "test", "version": "0"}}})
        assert "result" in self.recv(), "no initialize result"
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def next(self) -> int:
        self.n += 1
        return self.n

    def send(self, msg: dict[str, Any]) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg).encode() + b"\n")
        self.p.stdin.flush()

    def call(self, tool: str, **args: Any) -> None:
        self.send({"jsonrpc": "2.0", "id": self.next(), "method": "tools/call",
                   "params": {"name": tool, "arguments": args}})

    def recv(self, timeout: float = 90) -> dict[str, Any]:
        assert self.p.stdout is not None
        fd = self.p.stdout.fileno()
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            r, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
            if not r:
                pytest.fail(f"the server said nothing within {timeout:g} s")
            data = os.read(fd, 1 << 16)
            if not data:
                pytest.fail(f"the server ended: {self.stderr()}")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def stderr(self) -> str:
        assert self.p.stderr is not None
        if self.p.poll() is None:
            return "(running)"
        return self.p.stderr.read().decode(errors="replace")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()


def _sleeping(user: User, how: str, project: Path) -> None:
    c = RawClient(user, project)
    try:
        c.call("exec", command="sleep 1000")
        sid = wait_for(lambda: next((p.parent.name for p in (user.state / "live").glob("*/holder.json")), None)
                       if (user.state / "live").exists() else None, 60, "no living sandbox started")
        assert isinstance(sid, str)
        wait_for(lambda: record(user, sid).get("status") == "running", 60, "the sandbox never ran")
        lv = observe(user, sid)
        try:
            wait_for(lambda: in_tree(lv.init, ["sleep", "1000"]), 20, "the exec'd sleep never started")
            assert lv.record["owner_pid"] == c.p.pid
            if how == "eof":  # the client closes its end: the server ends everything and exits by itself
                assert c.p.stdin is not None
                c.p.stdin.close()
                c.p.wait(timeout=20)
                assert c.p.returncode == 0, c.stderr()
                assert f"session {sid} kept for review" in c.stderr()
            else:  # the server killed outright: its sandbox ends with it (the holder watches its owner)
                c.p.send_signal(signal.SIGKILL)
                c.p.wait(timeout=30)
            assert_all_gone(lv, timeout=20)
        finally:
            lv.close()
        rec = record(user, sid)
        assert rec["status"] in ("stopped", "failed"), rec
        # the session stays for review, with the exec on record
        runs = json.loads(user.cli(["status", sid, "--json"], timeout=60).stdout)["runs"]
        assert any(r.get("kind") == "exec" and r.get("argv") == ["/bin/sh", "-c", "sleep 1000"] for r in runs), runs
    finally:
        c.kill()


def test_a_client_that_goes_mid_exec_leaves_nothing_running(user: User, project: Path) -> None:
    _sleeping(user, "eof", project)


def test_a_killed_server_takes_its_sandbox_with_it(user: User, project: Path) -> None:
    _sleeping(user, "sigkill", project)


def test_a_client_that_goes_mid_run_leaves_nothing_running(user: User, project: Path) -> None:
    """A one-shot run in flight when the client goes: its command killed, its cgroups
    removed, the run on record; the server exits by itself."""
    def marked() -> list[int]:
        out = subprocess.run(["pgrep", "-f", "^mcp-run-marker"], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    c = RawClient(user, project)
    try:
        c.call("run", command="exec bash -c 'exec -a mcp-run-marker sleep 1000'")
        wait_for(marked, 60, "the run's command never started")
        server = c.p.pid
        assert run_cgroups(user, server) or not run_cgroups(user), "a run's cgroups are its supervisor's"
        assert c.p.stdin is not None
        c.p.stdin.close()
        c.p.wait(timeout=20)
        assert c.p.returncode == 0, c.stderr()
        wait_for(lambda: not marked(), 10, "the run's command outlived the server")
        wait_for(lambda: not run_cgroups(user), 10, f"cgroups left: {run_cgroups(user)}")
        sid = next(p.name for p in (user.state / "sessions").iterdir() if not p.name.startswith("."))
        runs = json.loads(user.cli(["status", sid, "--json"], timeout=60).stdout)["runs"]
        assert len(runs) == 1 and runs[0].get("status") == "done" and runs[0].get("exit_status") != 0, runs
    finally:
        c.kill()


def test_a_cancelled_call_ends_its_command(user: User, project: Path) -> None:
    """A request the client cancels (its own timeout) ends the command; the server goes on."""
    async def body() -> None:
        async with client(user, project) as s:
            _, r = await call(s, "exec", command="true")
            lv = observe(user, r["session"])
            try:
                with anyio.move_on_after(3):
                    await s.call_tool("exec", {"command": "sleep 1001"})
                # (waiting with the event loop free: the client sends its cancellation from it)
                for _ in range(300):
                    if not in_tree(lv.init, ["sleep", "1001"]):
                        break
                    await anyio.sleep(0.05)
                else:
                    pytest.fail("the cancelled command still runs 15 s later")
                _, r = await call(s, "exec", command="echo next")
                assert r["stdout"]["text"] == "next\n"
            finally:
                lv.close()
            # a one-shot run's too
            await call(s, "stop")
            with anyio.move_on_after(3):
                await s.call_tool("run", {"command": "exec bash -c 'exec -a mcp-cancel-marker sleep 1002'"})
            for _ in range(300):
                if not subprocess.run(["pgrep", "-f", "^mcp-cancel-marker"], capture_output=True).stdout:
                    break
                await anyio.sleep(0.05)
            else:
                pytest.fail("the cancelled run still runs 15 s later")
            _, r = await call(s, "run", command="echo after")
            assert r["stdout"]["text"] == "after\n"
    drive(body)
