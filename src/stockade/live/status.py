"""A living sandbox's resource figures: its process tree (psutil, the figures /proc
gives each process) and its cgroup's own counters where it has one."""

from __future__ import annotations

import time
from typing import Any

import psutil


def _size(n: int) -> str:
    """The seed's form: ``1.2g``, ``340m``, ``12k``."""
    for unit, mult in (("g", 1 << 30), ("m", 1 << 20), ("k", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.1f}{unit}"
    return str(n)


def tree(init_pid: int) -> list[psutil.Process]:
    """The sandbox's processes, its init first (host pids)."""
    try:
        init = psutil.Process(init_pid)
        return [init, *init.children(recursive=True)]
    except psutil.Error:
        return []


def _cpu(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_seconds(init_pid: int, cg: object | None) -> float | None:
    """The sandbox's CPU time so far: its cgroup's counter, else its processes' times."""
    usage = getattr(cg, "usage", None)
    if callable(usage):
        try:
            _m, cpu = usage()
            if cpu is not None:
                return float(cpu)
        except OSError:
            pass
    times = _cpu(tree(init_pid))
    return sum(times.values()) if times else None


def resources(init_pid: int, cg: object | None, sample: float = 0.2,
              since: tuple[float, float] | None = None) -> dict[str, Any]:
    """Memory in use (the tree's resident set), CPU use over ``sample`` seconds (the
    cgroup's counter, else the tree's CPU times), the pids; the cgroup's own figures.
    ``since``: (monotonic time, ``cpu_seconds``) of an earlier mark: CPU use since then,
    without waiting (the holder's loop must not sleep)."""
    if since is not None:
        res = resources(init_pid, cg, 0.0)
        now_cpu = cpu_seconds(init_pid, cg)
        elapsed = time.monotonic() - since[0]
        if now_cpu is not None and elapsed > 0.05:
            res["cpu_percent"] = round(max(0.0, now_cpu - since[1]) / elapsed * 100, 1)
            res["cpu_window"] = round(elapsed, 2)
        return res
    procs = tree(init_pid)
    rss = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            pass
    usage = getattr(cg, "usage", None)
    cg_mem: int | None = None
    cg_cpu0: float | None = None
    if callable(usage):
        try:
            cg_mem, cg_cpu0 = usage()
        except OSError:
            cg_mem = cg_cpu0 = None
    before = _cpu(procs)
    t0 = time.monotonic()
    cpu_percent: float | None = None
    if sample > 0:
        time.sleep(sample)
        elapsed = time.monotonic() - t0
        cg_cpu1: float | None = None
        if callable(usage) and cg_cpu0 is not None:
            try:
                _m, cg_cpu1 = usage()
            except OSError:
                cg_cpu1 = None
        if cg_cpu0 is not None and cg_cpu1 is not None:
            cpu_percent = round((cg_cpu1 - cg_cpu0) / elapsed * 100, 1)
        else:
            after = _cpu(tree(init_pid))
            used = sum(max(0.0, after[pid] - before.get(pid, 0.0)) for pid in after)
            cpu_percent = round(used / elapsed * 100, 1)
    out: dict[str, Any] = {
        "memory_used": _size(rss),
        "memory_used_bytes": rss,
        "cpu_percent": cpu_percent,
        "pids": [p.pid for p in procs],
        "processes": len(procs),
        "source": "cgroup" if cg_cpu0 is not None else "psutil",
    }
    if cg_mem is not None or cg_cpu0 is not None:
        out["cgroup"] = {"memory_current": cg_mem, "cpu_time": cg_cpu0}
    return out


def stragglers(init_pid: int) -> list[int]:
    """Processes of the sandbox still alive (host pids), init excluded."""
    return [p.pid for p in tree(init_pid)[1:]]


def living_status(sid: str) -> dict[str, Any] | None:
    """The provider status schema of session ``sid``'s living sandbox, asked of its holder
    while it runs, else its last record; None: the session never had one."""
    from . import registry
    from .client import Channel

    lv = registry.read(sid)
    if lv is None:
        return None
    if lv.status in ("running", "warm"):
        try:
            st = Channel(lv).request("status")["status"]
            if isinstance(st, dict):
                return st
        except Exception:  # gone meanwhile: the record says what is known
            pass
    return {**lv.data, "status": lv.status}
