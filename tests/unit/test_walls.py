"""Walls a container can refuse (issue 14 item 2), no privileges: what a plan without
its own procfs or hostname holds, and that prepare drops a wall only when allowed and
only when this environment refuses it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stockade import plan as P
from stockade.core import prepare
from stockade.core.request import RunRequest
from stockade.errors import UsageError
from stockade.launch import launcher
from stockade.linux import walls
from tests.unit.test_plan import facts, req

PROC_GONE = "proc (a new procfs is refused here: EPERM; /proc is empty inside)"
HOST_GONE = "hostname (sethostname is refused here: EPERM)"


def test_without_procfs_proc_is_an_empty_readonly_tmpfs_never_a_bind(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path, degraded=(PROC_GONE,)), facts())
    at = [m for m in plan.mounts if m.target == "/proc" or m.target.startswith("/proc/")]
    assert [(m.kind, m.data, "ro" in m.flags) for m in at] == [("tmpfs", "mode=0555,size=0", True)], at
    assert not any(m.kind == "proc" for m in plan.mounts)
    # nothing of this process's /proc reaches the sandbox, under any name
    assert not any(m.source and (m.source == "/proc" or m.source.startswith("/proc/")) for m in plan.mounts)
    assert plan.hostname == "stockade" and plan.degraded == (PROC_GONE,)
    # the launcher splits it as it does a procfs: the tmpfs is per run
    parts = launcher.split(plan)
    assert parts is not None
    base, run = parts
    assert any(m.target == "/proc" and m.kind == "tmpfs" for m in run)
    assert not any(m.target == "/proc" and m.kind == "tmpfs" for m in base)


def test_a_full_plan_keeps_its_procfs_and_masks(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path), facts())
    assert [m.kind for m in plan.mounts if m.target == "/proc"] == ["proc"]
    assert any(m.target == "/proc/sys" for m in plan.mounts) and any(m.target == "/proc/kcore" for m in plan.mounts)
    assert plan.hostname == "stockade"


def test_kept_hostname_is_not_set_and_etc_names_it(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path, degraded=(HOST_GONE,)), facts())
    assert plan.hostname == ""  # spawn.c: no sethostname
    node = os.uname().nodename
    (etc_hostname,) = [m for m in plan.mounts if m.target == "/etc/hostname"]
    assert etc_hostname.data == (node + "\n").encode()
    (hosts,) = [m for m in plan.mounts if m.target == "/etc/hosts"]
    assert isinstance(hosts.data, bytes) and f"\t{node}".encode() in hosts.data
    assert "uts" in plan.namespaces  # still its own UTS namespace
    assert "hostname:    (kept: --allow-degraded hostname)" in plan.describe()
    assert [m.kind for m in plan.mounts if m.target == "/proc"] == ["proc"]


def test_degraded_lists_only_the_allowed_walls_this_environment_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = {walls.PROC: 1, walls.HOSTNAME: 0}
    monkeypatch.setattr(walls, "refused", lambda what: refused[what])
    assert walls.degraded(frozenset()) == []
    assert walls.degraded(frozenset({"hostname"})) == []  # sethostname works here: nothing dropped
    (d,) = walls.degraded(frozenset({"proc", "hostname"}))
    assert d.startswith("proc (") and "EPERM" in d
    refused[walls.HOSTNAME] = 1
    names = [d.split(" ", 1)[0] for d in walls.degraded(frozenset({"proc", "hostname"}))]
    assert names == ["proc", "hostname"]


def test_probe_on_this_host_is_cached_per_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade._native import lib

    calls: list[int] = []
    real = lib.sk_probe
    walls.clear_cache()

    class Lib:
        SK_PROBE_PROC = lib.SK_PROBE_PROC
        SK_PROBE_HOSTNAME = lib.SK_PROBE_HOSTNAME

        @staticmethod
        def sk_probe(what: int) -> int:
            calls.append(what)
            return int(real(what))

    import stockade._native as native

    monkeypatch.setattr(native, "lib", Lib)
    first = walls.refused(walls.PROC)
    assert walls.refused(walls.PROC) == first and calls == [lib.SK_PROBE_PROC]
    assert first >= 0
    walls.clear_cache()


def test_unknown_degradation_names_the_accepted_ones(tmp_path: Path) -> None:
    from stockade.session import store

    sess = store.Session.__new__(store.Session)
    with pytest.raises(UsageError, match="accepted: landlock, seccomp, limits, proc, hostname"):
        prepare.prepare(sess, tmp_path, RunRequest(["true"], allow_degraded=("pid",)))
