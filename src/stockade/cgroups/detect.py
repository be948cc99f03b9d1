"""Choose the cgroup backend once per process.

Per controller (memory, pids, cpu) the unified v2 hierarchy wins when our own v2
cgroup delegates it to us; otherwise the v1 hierarchy of that controller when our
own cgroup there is writable; otherwise nothing (rlimits). All from v2 = "v2", all
from v1 = "v1", a mix = "hybrid", none = "none".

v2 delegation: our own cgroup (``0::/path``) is the parent of run cgroups. Its
``cgroup.subtree_control`` must have the controllers enabled; if it does not, we
enable them, which the kernel allows only for the root cgroup or one with no
member processes ("no internal processes" rule). If we are the *only* process in
our cgroup (``systemd-run --user --scope -p Delegate=yes stockade ...``), we move
ourselves into a leaf ``stockade-supervisor`` child first, as crun and podman do,
so the parent can delegate to siblings. Anything else = not delegated.

``STOCKADE_CGROUP=none|v1|v2|hybrid`` forces a backend (tests, and users who want
rlimits only); a forced backend that is unusable is an error, never a silent
fallback.
"""

from __future__ import annotations

import errno as _errno
import os
from dataclasses import dataclass, field
from functools import lru_cache

from stockade.cgroups.base import Manager
from stockade.cgroups.fs import CgroupFS, cgroup_error
from stockade.cgroups.hybrid import HybridManager
from stockade.cgroups.none import NoneManager
from stockade.cgroups.rlimit import nproc_is_safe
from stockade.cgroups.v1 import V1_CONTROLLERS, Hierarchy, V1Manager
from stockade.cgroups.v2 import V2_CONTROLLERS, V2Manager
from stockade.errors import SandboxError, UsageError

ENV = "STOCKADE_CGROUP"
CHOICES = ("none", "v1", "v2", "hybrid")
SUPERVISOR_LEAF = "stockade-supervisor"


@dataclass(frozen=True)
class Mount:
    fstype: str  # "cgroup" | "cgroup2"
    root: str  # the mount's root inside the hierarchy (field 4 of mountinfo)
    mountpoint: str
    controllers: frozenset[str]  # v1: from super options; v2: empty


@dataclass
class HostView:
    """What detection reads, injectable for tests (fake /proc and a fake cgroupfs)."""

    proc_cgroup: str
    mountinfo: str
    pid: int = field(default_factory=os.getpid)
    release: str = field(default_factory=lambda: os.uname().release)


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline, backslash as \ooo
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        fstype = rf[0]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        ctrls: frozenset[str] = frozenset()
        if fstype == "cgroup":
            ctrls = frozenset(o for o in rf[2].split(",") if o in V1_CONTROLLERS or o == "cpuacct")
        mounts.append(Mount(fstype, _unescape(lf[3]), _unescape(lf[4]), ctrls))
    return mounts


def parse_proc_cgroup(text: str) -> tuple[str | None, dict[str, tuple[frozenset[str], str]]]:
    """(v2 path or None, {v1 controller: (co-mounted controllers, path)})."""
    v2: str | None = None
    v1: dict[str, tuple[frozenset[str], str]] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, path = parts
        if hid == "0" and ctrls == "":
            v2 = path
            continue
        names = frozenset(c for c in ctrls.split(",") if c)
        for c in names:
            v1[c] = (names, path)
    return v2, v1


def _join(mount: Mount, path: str) -> str | None:
    """Directory of cgroup ``path`` under ``mount`` (None if outside the mount's root)."""
    root = mount.root.rstrip("/")
    if root and not (path == root or path.startswith(root + "/")):
        return None
    rest = path[len(root) :].lstrip("/")
    return os.path.join(mount.mountpoint, rest) if rest else mount.mountpoint


@dataclass
class Detection:
    manager: Manager
    reasons: list[str]


def _v1_part(view: HostView, fs: CgroupFS, want: set[str], reasons: list[str]) -> dict[str, Hierarchy]:
    _v2path, own = parse_proc_cgroup(view.proc_cgroup)
    mounts = [m for m in parse_mountinfo(view.mountinfo) if m.fstype == "cgroup"]
    out: dict[str, Hierarchy] = {}
    for ctrl in V1_CONTROLLERS:
        if ctrl not in want:
            continue
        mount = next((m for m in mounts if ctrl in m.controllers), None)
        if mount is None or ctrl not in own:
            continue
        names, path = own[ctrl]
        d = _join(mount, path)
        if d is None or not fs.isdir(d):
            reasons.append(f"v1 {ctrl}: own cgroup {path} is not visible under {mount.mountpoint}")
            continue
        if not fs.writable(d):
            reasons.append(f"v1 {ctrl}: {d} is not writable by uid {os.geteuid()}")
            continue
        out[ctrl] = Hierarchy(controllers=names, own_dir=d, own_rel=path)
    return out


def _v2_part(
    view: HostView, fs: CgroupFS, reasons: list[str], *, move_self: bool
) -> tuple[str, str, frozenset[str]] | None:
    """(parent dir, parent rel path, delegated controllers) or None."""
    v2path, _ = parse_proc_cgroup(view.proc_cgroup)
    mount = next((m for m in parse_mountinfo(view.mountinfo) if m.fstype == "cgroup2"), None)
    if mount is None or v2path is None:
        reasons.append("v2: no cgroup2 mount")
        return None
    own = _join(mount, v2path)
    if own is None or not fs.isdir(own):
        reasons.append(f"v2: own cgroup {v2path} not visible under {mount.mountpoint}")
        return None
    try:
        available = frozenset(fs.read(os.path.join(own, "cgroup.controllers")).split())
        enabled = frozenset(fs.read(os.path.join(own, "cgroup.subtree_control")).split())
    except OSError as e:
        reasons.append(f"v2: cannot read {own}: {os.strerror(e.errno or 0)}")
        return None
    wanted = frozenset(V2_CONTROLLERS) & available
    if not wanted:
        reasons.append(f"v2: {own} has none of {', '.join(V2_CONTROLLERS)} (has: {' '.join(sorted(available)) or 'nothing'})")
        return None
    if not fs.writable(own) or not fs.writable(os.path.join(own, "cgroup.subtree_control")):
        reasons.append(f"v2: {own} is not delegated to uid {os.geteuid()}")
        return None
    missing = wanted - enabled
    if missing and v2path == "/":
        reasons.append(
            f"v2: {' '.join(sorted(missing))} not enabled in the root cgroup's subtree_control "
            "(stockade does not change the root cgroup)"
        )
        return _partial(own, v2path, enabled & wanted, reasons)
    if missing:
        enable = " ".join("+" + c for c in sorted(missing))
        try:
            fs.write(os.path.join(own, "cgroup.subtree_control"), enable)
        except OSError as e:
            if e.errno != _errno.EBUSY or not move_self:
                reasons.append(f"v2: cannot enable {enable} in {own}: {os.strerror(e.errno or 0)}")
                return _partial(own, v2path, enabled & wanted, reasons)
            if not _move_self_to_leaf(view, fs, own, reasons):
                return _partial(own, v2path, enabled & wanted, reasons)
            try:
                fs.write(os.path.join(own, "cgroup.subtree_control"), enable)
            except OSError as e2:
                reasons.append(f"v2: cannot enable {enable} in {own}: {os.strerror(e2.errno or 0)}")
                return _partial(own, v2path, enabled & wanted, reasons)
        enabled = frozenset(fs.read(os.path.join(own, "cgroup.subtree_control")).split())
    return own, v2path, enabled & wanted


def _partial(
    own: str, rel: str, enabled: frozenset[str], reasons: list[str]
) -> tuple[str, str, frozenset[str]] | None:
    return (own, rel, enabled) if enabled else None


def _move_self_to_leaf(view: HostView, fs: CgroupFS, own: str, reasons: list[str]) -> bool:
    """If we are the only process in ``own``, move into ``own/stockade-supervisor``."""
    try:
        procs = fs.read(os.path.join(own, "cgroup.procs")).split()
    except OSError:
        return False
    if procs != [str(view.pid)]:
        reasons.append(
            f"v2: {own} has other processes ({len(procs)} in cgroup.procs); cannot delegate from it"
        )
        return False
    leaf = os.path.join(own, SUPERVISOR_LEAF)
    try:
        if not fs.isdir(leaf):
            fs.mkdir(leaf)
        fs.write(os.path.join(leaf, "cgroup.procs"), str(view.pid))
    except OSError as e:
        reasons.append(f"v2: cannot move the supervisor to {leaf}: {os.strerror(e.errno or 0)}")
        return False
    reasons.append(f"v2: moved the supervisor (pid {view.pid}) into {leaf} to delegate {own}")
    return True


def detect_from(
    view: HostView,
    fs: CgroupFS | None = None,
    *,
    force: str | None = None,
    move_self: bool = True,
) -> Detection:
    """Pure-ish detection over an injected view (tests) or the real host."""
    fs = fs or CgroupFS()
    reasons: list[str] = []
    nproc = nproc_is_safe(view.release)
    if force is not None and force not in CHOICES:
        raise UsageError(f"{ENV}: invalid value {force!r}: expected one of {', '.join(CHOICES)}")
    if force == "none":
        return Detection(NoneManager(reason=f"forced by {ENV}=none", nproc_safe=nproc), reasons)

    v2 = None
    if force in (None, "v2", "hybrid"):
        v2 = _v2_part(view, fs, reasons, move_self=move_self)
    v2_ctrls = v2[2] if v2 else frozenset()
    want_v1 = set(V1_CONTROLLERS) - set(v2_ctrls)
    if v2:
        want_v1 -= {"cpuacct", "freezer"}  # v2 has cpu.stat and cgroup.kill
    v1h: dict[str, Hierarchy] = {}
    if force in (None, "v1", "hybrid") and want_v1 & {"memory", "pids", "cpu"}:
        v1h = _v1_part(view, fs, want_v1, reasons)
    limiting_v1 = set(v1h) & {"memory", "pids", "cpu"}

    manager: Manager
    if v2 and limiting_v1:
        manager = HybridManager(
            V2Manager(parent=v2[0], rel_parent=v2[1], controllers=v2_ctrls, fs=fs),
            V1Manager(hierarchies=v1h, fs=fs),
        )
    elif v2 and force != "hybrid":
        manager = V2Manager(parent=v2[0], rel_parent=v2[1], controllers=v2_ctrls, fs=fs, note="; ".join(reasons))
    elif limiting_v1 and force != "hybrid":
        manager = V1Manager(hierarchies=v1h, fs=fs, note="; ".join(reasons))
    elif force is not None:
        raise SandboxError(
            f"use cgroup backend {force} ({ENV}={force})",
            detail="; ".join(reasons) or "not available on this host",
            remedy=f"unset {ENV} to let stockade choose, or set {ENV}=none",
        )
    else:
        manager = NoneManager(reason="; ".join(reasons) or "no usable cgroup controllers", nproc_safe=nproc)
    return Detection(manager, reasons)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def host_view() -> HostView:
    from .. import paths

    # a CLI server's supervisor places runs as its client would have, under the client's cgroup
    pid = paths.CGROUP_OWNER or os.getpid()
    return HostView(proc_cgroup=_read(paths.proc_cgroup_path()), mountinfo=_read("/proc/self/mountinfo"), pid=pid)


@lru_cache(maxsize=1)
def _detect_cached(force: str | None) -> Detection:
    try:
        view = host_view()
    except OSError as e:
        if force not in (None, "none"):
            raise cgroup_error("read /proc/self/cgroup", "/proc/self/cgroup", e) from e
        return Detection(NoneManager(reason=f"cannot read /proc: {e}"), [])
    return detect_from(view, force=force)


def detect() -> Manager:
    """The backend for this process (chosen once, cached; ``STOCKADE_CGROUP`` forces)."""
    force = os.environ.get(ENV) or None
    return _detect_cached(force).manager


def detection() -> Detection:
    """``detect()`` plus the reasons behind the choice (for ``stockade doctor``)."""
    return _detect_cached(os.environ.get(ENV) or None)


def reset() -> None:
    """Forget the cached choice (tests)."""
    _detect_cached.cache_clear()


from stockade.cgroups.sweep import run_parents, sweep_stale  # noqa: E402  (re-exported)

__all__ = ["CHOICES", "ENV", "Detection", "HostView", "detect", "detect_from", "detection", "reset", "run_parents", "sweep_stale"]
