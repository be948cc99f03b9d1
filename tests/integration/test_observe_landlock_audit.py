"""Observe mode with Landlock's own denial records (kernel audit, Landlock ABI 7, Linux
6.15+): `stockade run --observe`, `log --observed`, `policy suggest`, the Python API,
root and unprivileged, in-process and served.

The canary: `echo x > /proc/self/comm`. The sandbox's procfs is mounted read-write and
the command may write its own comm (DAC), so only Landlock refuses it (its rule for
/proc grants reads): a denial the mount view cannot predict, seen here only through
the kernel's record. The host side checks the session's audit log.

Kernel audit is a host-wide setting that stockade never changes: these tests turn it
on themselves (root) for their duration and restore what they found.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import User, need
from .test_observe import observed_json, session_of

pytestmark = pytest.mark.cli_paths

CANARY = "echo x > /proc/self/comm; echo done"

# A Landlock-sandboxed process outside stockade: it restricts itself (writes handled,
# none allowed) and tries to write argv[1]; its denial goes to the same audit stream.
FOREIGN = r'''
import ctypes, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
attr = ctypes.create_string_buffer(struct.pack("Q", 1 << 1))  # handled: WRITE_FILE
rs = libc.syscall(444, attr, 8, 0)
assert rs >= 0, ctypes.get_errno()
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs
assert libc.syscall(446, rs, 0) == 0, ctypes.get_errno()
try:
    open(sys.argv[1], "w")
    print("written")
except PermissionError:
    print("denied")
'''


def _abi() -> int:
    from stockade.linux.native import landlock_abi

    return landlock_abi()


@pytest.fixture
def audit_on() -> Iterator[None]:
    """Kernel audit enabled for one test (root), then restored to what it was."""
    from stockade.linux import audit_netlink as an

    need(_abi() >= 7, f"Landlock ABI {_abi()}: denial records need ABI 7 (Linux 6.15+)")
    need(os.path.exists("/proc/self/loginuid"), "the kernel has no audit subsystem (CONFIG_AUDIT)")
    need(os.geteuid() == 0, "enabling kernel audit for the test needs root")
    was = an.audit_enabled()
    need(was is not None, "kernel audit's status is unreadable here (AUDIT_GET refused: not the initial namespaces?)")
    if was:
        yield
        return
    an.set_audit_enabled(True)
    try:
        yield
    finally:
        an.set_audit_enabled(False)
        assert an.audit_enabled() is False


def kernel_denials(obs: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in obs["denied"] + obs["hosts"] if d.get("operation") == "observed-landlock-denial"]


@pytest.mark.parametrize("launcher", ["1", "0"], ids=["launcher", "cold"])
def test_landlock_denial_comes_from_the_kernel_record(user: User, project: Path, audit_on: None,
                                                      tmp_path: Path, launcher: str) -> None:
    """Init's host pid names our domain: a shared launcher's init (its pid as the
    launcher reports it) and a cold start's alike."""
    from stockade.linux import audit_netlink as an

    foreign_target = tmp_path / "stockade-ll-foreign-canary"
    foreign_target.write_text("")
    # the test's own subscription: proves the foreign denial reached the stream the run read
    watch = an.Subscription.open(_abi())
    assert not isinstance(watch, str), watch
    try:
        proc = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--observe", "--", "sh", "-c",
                                 CANARY + "; sleep 1"], cwd=project, env=user.env({"STOCKADE_LAUNCHER": launcher}),
                                stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        time.sleep(0.3)
        f = subprocess.run([sys.executable, "-c", FOREIGN, str(foreign_target)], capture_output=True, text=True)
        assert f.stdout.strip() == "denied", f.stderr
        out, err = proc.communicate(timeout=120)
        time.sleep(0.1)
        watch.drain()
        foreign_seen = any(r.fields.get("path") == str(foreign_target) for r in list(watch.records))
    finally:
        watch.close()
    assert proc.returncode == 0, err.decode()
    assert b"Permission denied" in err and out == b"done\n"
    sess = session_of(err)
    obs = observed_json(user, project, sess)
    (summ,) = obs["summaries"]
    if user.name != "root":
        # the audit stream is root's: the run says why it has no kernel records
        assert "not root" in summ["landlock_audit"] and not kernel_denials(obs)
        text = user.cli(["log", "--observed", sess], cwd=project).stdout.decode()
        assert "Landlock's own denial records not read: not root" in text
        return
    assert foreign_seen, "the foreign process's denial never reached the audit stream"
    assert summ["landlock_audit"] == "on" and summ["landlock_denials"] >= 1
    # its end known from its domain's last record (or its own mark), not a wait
    assert summ["landlock_audit_end"] in ("deallocated", "mark")
    kd = kernel_denials(obs)
    comm = [d for d in kd if d["target"].startswith("/proc/") and d["target"].endswith("/comm")]
    assert comm, kd
    (d,) = comm
    assert d["basis"] == "kernel" and d["result"] == "blocked" and d["policy"] == "landlock"
    assert d["access"] == "write" and "fs.write_file" in d["blockers"]
    assert "(kernel audit record)" in d["reason"]
    assert d["exe"] in ("/usr/bin/dash", "/bin/dash", "/usr/bin/sh", "/bin/sh", "/usr/bin/bash", "/bin/bash")
    assert d["host_pids"] and all(p > 1 for p in d["host_pids"])
    # another process's Landlock denial never enters the session's log
    raw = (obs_session_dir(user, sess) / "events.jsonl").read_text()
    assert str(foreign_target) not in raw and "stockade-ll-foreign-canary" not in raw
    # the predicted entries keep saying so; the kernel's say theirs
    assert all(e.get("basis") == "predicted" for e in obs["denied"] if e.get("operation") != "observed-landlock-denial")

    text = user.cli(["log", "--observed", sess], cwd=project)
    assert text.returncode == 0
    s = text.stdout.decode()
    assert "denied by Landlock (kernel record): fs.write_file" in s and d["target"] in s
    # its own /proc: nothing a config line could grant
    sug = user.cli(["policy", "suggest", "--json", sess], cwd=project)
    assert sug.returncode == 0, sug.stderr.decode()
    assert d["target"] not in sug.stdout.decode()


def obs_session_dir(user: User, sess: str) -> Path:
    d = user.state / "sessions" / sess
    assert (d / "events.jsonl").exists(), f"session {sess} not found under {user.state}"
    return d


def test_explain_shows_the_flag_only_in_observe_mode(user: User, project: Path) -> None:
    need(_abi() >= 7, f"Landlock ABI {_abi()}: the flag needs ABI 7 (Linux 6.15+)")
    plain = user.cli(["explain", "--", "true"], cwd=project)
    watched = user.cli(["explain", "--observe", "--", "true"], cwd=project)
    assert plain.returncode == watched.returncode == 0, (plain.stderr, watched.stderr)
    assert b"denials logged" not in plain.stdout
    assert b"denials logged (landlock_restrict_self LOG_NEW_EXEC_ON" in watched.stdout
    # an unobserved run still runs (no flag passed): the same canary, refused the same way
    r = user.cli(["run", "--", "sh", "-c", CANARY], cwd=project)
    assert r.returncode == 0 and b"Permission denied" in r.stderr, r.stderr.decode()


def test_python_api(api_project: Path, audit_on: None) -> None:
    import stockade
    from stockade import audit
    from stockade.session import store

    r = stockade.run(["sh", "-c", CANARY], project=api_project, observe=True, capture_output=True)
    assert r.returncode == 0 and b"Permission denied" in r.stderr
    evs = list(audit.read_events(store.open_session(r.session).events_path))
    kd = [e for e in evs if e.get("operation") == "observed-landlock-denial"]
    assert any(e["target"].endswith("/comm") and e["basis"] == "kernel" for e in kd), kd
    (summ,) = [e for e in evs if e.get("operation") == "observed-summary"]
    assert summ["landlock_audit"] == "on"
    with stockade.Sandbox(api_project, observe=True) as sb:
        r2 = sb.run(["sh", "-c", "echo y > /proc/self/oom_score_adj; true"])
        assert r2.returncode == 0
        evs = list(audit.read_events(sb.session.events_path))
        assert any(e.get("operation") == "observed-landlock-denial" and str(e.get("target")).endswith("/oom_score_adj")
                   for e in evs), [e for e in evs if str(e.get("operation", "")).startswith("observed")]
    # without observe mode: no subscription, no kernel events
    with stockade.Sandbox(api_project) as sb:
        r3 = sb.run(["sh", "-c", CANARY], capture_output=True)
        assert r3.returncode == 0 and b"Permission denied" in r3.stderr
        evs = list(audit.read_events(sb.session.events_path))
        assert not [e for e in evs if str(e.get("operation", "")).startswith("observed")]


@pytest.mark.parametrize("launcher", ["1", "0"], ids=["launcher", "cold"])
def test_a_run_with_no_denial_ends_on_its_mark(user: User, project: Path, audit_on: None, launcher: str) -> None:
    """No Landlock denial: the run knows every record of its has come when its own mark
    (a TRUSTED_APP record with its token) comes back, not after a wait for records that
    never come. Seen from the host: the mark is in the audit stream, once, after the run
    ended, with no Landlock record of the run's."""
    from stockade.linux import audit_netlink as an

    watch = an.Subscription.open(_abi())
    assert not isinstance(watch, str), watch
    try:
        r = user.cli(["run", "--observe", "--", "sh", "-c", "cat /etc/hostname >/dev/null; echo ok"], cwd=project,
                     env={"STOCKADE_LAUNCHER": launcher})
        time.sleep(0.2)
        out: list[tuple[int, bytes]] = []
        while True:
            try:
                out += an.split_messages(watch.sock.recv(1 << 16))
            except BlockingIOError:
                break
    finally:
        watch.close()
    assert r.returncode == 0 and r.stdout == b"ok\n", r.stderr.decode()
    obs = observed_json(user, project, session_of(r.stderr))
    (summ,) = obs["summaries"]
    if user.name != "root":
        assert "not root" in summ["landlock_audit"] and "landlock_audit_end" not in summ
        assert not [p for t, p in out if t == an.MARK_TYPE and an.MARK_TEXT in p]  # (CAP_AUDIT_WRITE is root's)
        return
    assert summ["landlock_audit"] == "on" and summ["landlock_denials"] == 0 and not kernel_denials(obs)
    assert summ["landlock_audit_end"] == "mark"
    marks = [p for t, p in out if t == an.MARK_TYPE and an.MARK_TEXT in p]
    assert len(marks) == 1, out


def test_audit_off_says_why(user: User, project: Path) -> None:
    """With kernel audit off (this host's default), the run says so and adds nothing."""
    from stockade.linux import audit_netlink as an

    need(_abi() >= 7, f"Landlock ABI {_abi()}")
    if os.geteuid() == 0 and an.audit_enabled():
        pytest.skip("kernel audit is on here (someone else's setting: not turned off by a test)")
    r = user.cli(["run", "--observe", "--", "sh", "-c", CANARY], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    obs = observed_json(user, project, session_of(r.stderr))
    (summ,) = obs["summaries"]
    want = "not root" if user.name != "root" else "kernel audit is off"
    assert want in summ["landlock_audit"] and not kernel_denials(obs) and "landlock_audit_end" not in summ


@pytest.mark.vm(once=True)
def test_the_flag_follows_the_kernels_abi(user: User, project: Path) -> None:
    """Below ABI 7 the kernel refuses restrict flags (EINVAL): an observed run passes
    none and says why it reads no records; from 7 on, explain shows the flag."""
    abi = _abi()
    need(abi > 0, "Landlock is unavailable here")
    watched = user.cli(["explain", "--observe", "--", "true"], cwd=project)
    assert watched.returncode == 0, watched.stderr.decode()
    assert (b"denials logged" in watched.stdout) is (abi >= 7)
    r = user.cli(["run", "--observe", "--", "sh", "-c", "echo x > /proc/self/comm; echo done"], cwd=project)
    assert r.returncode == 0 and r.stdout == b"done\n", r.stderr.decode()
    (summ,) = observed_json(user, project, session_of(r.stderr))["summaries"]
    if abi < 7:
        assert summ["landlock_audit"] == f"Landlock ABI {abi}: denial records need ABI 7 (Linux 6.15+)"
    else:
        assert summ["landlock_audit"] in ("on", "not root: the kernel audit stream is root's (CAP_AUDIT_READ)") or \
            "kernel audit is off" in summ["landlock_audit"]


def test_the_probe_agrees_with_audit_get_and_logs_nothing() -> None:
    """Whether audit is on is read from the ACK of an empty user message (no kernel
    thread, unlike AUDIT_GET's answer): it agrees with AUDIT_GET with audit off and on,
    and it leaves no record in the stream, where a user message with text, sent after
    it as a control, comes back (kauditd delivers in order)."""
    import select
    import socket

    from stockade.linux import audit_netlink as an

    need(os.path.exists("/proc/self/loginuid"), "the kernel has no audit subsystem (CONFIG_AUDIT)")
    need(os.geteuid() == 0, "enabling kernel audit for the test needs root")
    st = an.audit_status()
    need(st is not None, "kernel audit's status is unreadable here (AUDIT_GET refused: not the initial namespaces?)")
    assert st is not None
    was = bool(st[1])
    mc = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK,
                       an.NETLINK_AUDIT)
    try:
        mc.bind((0, 1 << (an.AUDIT_NLGRP_READLOG - 1)))
        for on in (not was, was):
            an.set_audit_enabled(on)
            with an._control() as s:
                assert an._probe(s) is on
            now = an.audit_status()
            assert now is not None and bool(now[1]) is on
            assert an.audit_enabled() is on
            if not on:
                continue
            tok = os.urandom(6).hex()
            with an._control() as s:
                assert an._probe(s) is True
                assert an._request(s, an.PROBE_TYPE, f"stockade probe control {tok}\0".encode()) is not None
            seen: list[bytes] = []
            deadline = time.monotonic() + 5
            while not any(tok.encode() in p for p in seen) and time.monotonic() < deadline:
                select.select([mc], [], [], 0.1)
                with contextlib.suppress(BlockingIOError):
                    seen += [p for t, p in an.split_messages(mc.recv(1 << 16)) if t == an.PROBE_TYPE
                             and f" pid={os.getpid()} ".encode() in p]
            assert len(seen) == 1 and tok.encode() in seen[0], seen
    finally:
        mc.close()
        an.set_audit_enabled(was)
        end = an.audit_status()
        assert end is not None and bool(end[1]) is was
