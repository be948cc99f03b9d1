"""Issue 13 items 1 and 5, the logic: the sandbox's /etc/hosts follows the host's
localhost lines; variables naming hidden paths are found; Landlock's TCP rules only
where a socket of the caller's namespace may be handed in; the audit log's plan denials."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from stockade import audit
from stockade import plan as P
from stockade.core.request import RunIO, inet_socket
from stockade.policy.env import hidden_refs, hidden_warning, path_refs
from tests.unit.test_plan import facts, req


def _hosts(plan: P.Plan) -> str:
    m = next(m for m in plan.mounts if m.target == "/etc/hosts")
    assert isinstance(m.data, bytes)
    return m.data.decode()


def _facts_with_hosts(text: bytes | None, abi: int = 7) -> P.HostFacts:
    f = facts(abi=abi)
    etc = f.etc if text is None else (*f.etc, ("hosts", "file", text))
    return P.HostFacts(f.euid, f.egid, f.system, etc, f.proc_entries, f.landlock_abi)


def test_hosts_keeps_the_hosts_localhost_lines_in_order() -> None:
    # the host lists only IPv4 for localhost: no ::1 localhost inside either
    assert P.hosts_file("sb", b"127.0.0.1 localhost\n127.0.0.1 runsc\n127.0.0.1 vm\n") == b"127.0.0.1\tlocalhost\n127.0.0.1\tsb\n"
    # ::1 first on the host: first inside; the host's own name (myhost) stays out
    got = P.hosts_file("sb", b"# c\n::1 localhost ip6-localhost  # six\n127.0.0.1 localhost\n127.0.1.1 myhost\nff02::1 ip6-allnodes\n")
    assert got == b"::1\tlocalhost ip6-localhost\n127.0.0.1\tlocalhost\n127.0.0.1\tsb\n"
    # nothing for localhost on the host (or no file): IPv4 localhost, ::1 only by its ip6- names
    for host in (None, b"", b"10.0.0.1 db\n"):
        assert P.hosts_file("sb", host) == b"127.0.0.1\tlocalhost\n::1\tip6-localhost ip6-loopback\n127.0.0.1\tsb\n"


def test_plan_hosts_from_host_facts_and_the_host_file_not_copied(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path), _facts_with_hosts(b"127.0.0.1 localhost\n::1 localhost\n10.1.1.1 secret-db\n"))
    assert _hosts(plan) == "127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.0.1\tstockade\n"
    assert sum(m.target == "/etc/hosts" for m in plan.mounts) == 1
    # etc.extra naming /etc/hosts: the host's file whole, as before
    plan = P.build(req(tmp_path, etc_extra=("/etc/hosts",)), _facts_with_hosts(b"10.1.1.1 db\n"))
    last = [m for m in plan.mounts if m.target == "/etc/hosts"][-1]
    assert last.data == b"10.1.1.1 db\n"


def test_path_refs() -> None:
    assert path_refs("/opt/wheels") == ["/opt/wheels"]
    assert path_refs("/opt/a  /opt/b") == ["/opt/a", "/opt/b"]
    assert path_refs("relative/x") == []
    assert path_refs("/usr/bin:/home/u/.local/bin") == []  # a search list
    assert path_refs("https://pypi.example/simple") == []
    assert path_refs("--flag /opt/x") == ["/opt/x"]


def test_hidden_refs(tmp_path: Path) -> None:
    shown, hidden = tmp_path / "shown", tmp_path / "hidden"
    shown.mkdir()
    hidden.mkdir()
    env = {
        "PIP_FIND_LINKS": f"{shown} {hidden}", "A_SHOWN": str(shown), "MISSING": str(tmp_path / "nope"),
        "PATH": str(hidden), "HOME": str(hidden), "STOCKADE_STATE_DIR": str(hidden), "TMPDIR": str(hidden),
        "HISTFILE": "/dev/null",
    }
    got = hidden_refs(env, lambda p: p == str(shown.resolve()))
    assert got == [("PIP_FIND_LINKS", str(hidden)), ("TMPDIR", str(hidden))]
    w = hidden_warning("PIP_FIND_LINKS", "/opt/wheels")
    assert "\n" not in w and "PIP_FIND_LINKS" in w and "/opt/wheels" in w and "passed unchanged" in w


def test_sees_follows_the_mount_plan(tmp_path: Path) -> None:
    (tmp_path / "g").mkdir()
    plan = P.build(req(tmp_path, env={"PATH": "/usr/bin"}, grants=((str(tmp_path / "g"), False),)), facts())
    proj = str(tmp_path / "home/u/proj")
    assert P.sees(plan.mounts, "/usr/lib/x") and P.sees(plan.mounts, "/bin/sh")  # /bin -> usr/bin
    assert P.sees(plan.mounts, proj + "/src") and P.sees(plan.mounts, str(tmp_path / "g/w"))
    assert P.sees(plan.mounts, "/tmp") and not P.sees(plan.mounts, "/tmp/host-file")
    assert not P.sees(plan.mounts, "/opt/wheels") and not P.sees(plan.mounts, "/etc/shadow")
    assert not P.sees(plan.mounts, "/proc/1/root")  # the sandbox's own procfs, not the host's


def test_plan_carries_the_env_warning(tmp_path: Path) -> None:
    (tmp_path / "opt").mkdir()
    plan = P.build(req(tmp_path, env={"PATH": "/usr/bin", "PIP_FIND_LINKS": str(tmp_path / "opt")}), facts())
    assert len(plan.env_warnings) == 1 and plan.env_warnings[0].startswith("PIP_FIND_LINKS points at")
    assert "warning:     PIP_FIND_LINKS" in plan.describe()


@pytest.mark.parametrize(("network", "fds", "abi", "net"), [
    ("none", (), 7, 0), ("none", (5,), 7, 3), ("host", (), 7, 0), ("host", (5,), 7, 0), ("none", (5,), 3, 0),
])
def test_tcp_rules_only_where_they_add_a_wall(tmp_path: Path, network: str, fds: tuple[int, ...], abi: int, net: int) -> None:
    plan = P.build(req(tmp_path, network=network, keep_fds=fds), facts(abi=abi))
    assert plan.landlock is not None and plan.landlock.handled_net == net
    note = next(n for n in plan.notes if n.startswith("network "))
    assert ("denied by Landlock" in note) == bool(net), note


def test_an_inet_socket_as_stdin_raises_the_wall(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path), facts())
    assert plan.landlock is not None and plan.landlock.handled_net == 0
    inet = socket.socket()
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        assert inet_socket(inet.fileno()) and not inet_socket(a.fileno()) and not inet_socket(r)
        assert RunIO(stdin=inet.fileno()).inet_stdin()
        assert not RunIO(stdin=a.fileno()).inet_stdin() and not RunIO(stdin=r).inet_stdin()
        assert RunIO(input=b"x").piped_stdin and RunIO(pty=True).piped_stdin  # stockade's own pipe or pty
        # built with it: the same wall a passed fd brings (plan.tcp_wall)
        walled = P.build(req(tmp_path, foreign_stdin=True), facts())
        assert walled.landlock is not None and walled.landlock.handled_net == P.LL_NET_BIND_TCP | P.LL_NET_CONNECT_TCP
        assert any("denied by Landlock" in n for n in walled.notes)
        host = P.build(req(tmp_path, network="host", foreign_stdin=True), facts())
        assert host.landlock is not None and host.landlock.handled_net == 0
    finally:
        for s in (inet, a, b):
            s.close()
        os.close(r)
        os.close(w)


class _Sess:
    def __init__(self, d: Path) -> None:
        self.id = "s1"
        self.events_path = d / "events.jsonl"


def test_plan_denials_are_blocked_events(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path, keep_fds=(5,), seccomp_name="default"), facts())
    log = audit.AuditLog(_Sess(tmp_path))
    log.plan_denials(1, plan)
    recs = [json.loads(ln) for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    blocked = [r for r in recs if audit.is_blocked(r)]
    assert {r["policy"] for r in blocked} == {"landlock-net", "seccomp"}
    net = next(r for r in blocked if r["policy"] == "landlock-net")
    assert "EACCES" in net["reason"] and "--pass-fd" in net["reason"]
    # no wall, no event
    (tmp_path / "events.jsonl").unlink()
    audit.AuditLog(_Sess(tmp_path)).plan_denials(1, P.build(req(tmp_path), facts()))
    assert not (tmp_path / "events.jsonl").exists()


def test_policy_env_names_the_hidden_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from stockade.cli import main

    hidden = tmp_path / "wheels"
    hidden.mkdir()
    proj = tmp_path / "proj"
    proj.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(hidden))
    monkeypatch.setenv("IN_PROJECT", str(proj))
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(proj)
    assert main(["policy", "env", "--json"], serve=False) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["PIP_FIND_LINKS"]["passed"] and rows["PIP_FIND_LINKS"]["hidden_path"] == str(hidden)
    assert "hidden inside the sandbox" in rows["PIP_FIND_LINKS"]["reason"]
    assert "hidden_path" not in rows["IN_PROJECT"]
