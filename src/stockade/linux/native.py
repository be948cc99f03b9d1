"""The one owner of the C core (stockade._native): spawning a lowered plan, the
parent's side of the handshake (stages), the child's report records, probes.

Nothing here knows a Plan: launch/lower.py turns one into the C structs, and
launch/start.py chooses how a run starts (a launcher, or a cold start here)."""

from __future__ import annotations

import enum
import errno as _errno
import os
import struct
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._native import ffi as ffi  # type: ignore[import-not-found]  # launch/lower.py builds structs with it
from .._native import lib as lib  # type: ignore[import-not-found]
from ..errors import SandboxError

STEP_NAMES = {
    getattr(lib, n): n[len("SK_STEP_"):].lower().replace("_", "-")
    for n in dir(lib)
    if n.startswith("SK_STEP_")
}

REPORT = struct.Struct("iiii240s")
assert REPORT.size == ffi.sizeof("struct sk_report")

CData = Any  # a cffi object (cffi has no static types)


class Stage(enum.IntEnum):
    """What the parent releases its child into, one byte on the sync pipe (``enum
    sk_stage``; the child checks each is the one it waits for)."""

    IDMAP = lib.SK_STAGE_IDMAP  # its uid/gid maps are written (a cold start's, a launcher's)
    ATTACHED = lib.SK_STAGE_ATTACHED  # it is in the run's cgroups (hold_before_exec)


def landlock_abi() -> int:
    r: int = lib.sk_landlock_abi()
    return r if r > 0 else 0


@dataclass
class Report:
    kind: int
    step: str
    err: int
    value: int
    path: str


def parse_reports(buf: bytes) -> tuple[list[Report], bytes]:
    out: list[Report] = []
    n = REPORT.size
    while len(buf) >= n:
        kind, step, err, value, path = REPORT.unpack_from(buf)
        out.append(Report(kind, STEP_NAMES.get(step, str(step)), err, value, os.fsdecode(path.split(b"\0", 1)[0])))
        buf = buf[n:]
    return out, buf


REP_ERROR = lib.SK_REP_ERROR
REP_STARTED = lib.SK_REP_STARTED
REP_EXEC_FAILED = lib.SK_REP_EXEC_FAILED
REP_EXIT = lib.SK_REP_EXIT
REP_INIT = lib.SK_REP_INIT
REP_INIT_EXIT = lib.SK_REP_INIT_EXIT
REP_READY = lib.SK_REP_READY


@dataclass
class Child:
    pid: int
    pidfd: int
    report_fd: int
    sync_fd: int
    awaits: list[Stage] = field(default_factory=list)  # the stages it still waits for, in order

    @property
    def exit_fd(self) -> int:
        """Readable once the sandbox's init has ended."""
        return self.pidfd

    def reap(self) -> int | None:
        """Init's exit: its status (>= 0) or minus the signal; None if unknown."""
        try:
            info = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED)
        except ChildProcessError:
            return None
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def close(self) -> None:
        for fd in (self.pidfd, self.report_fd, self.sync_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.pidfd = self.report_fd = self.sync_fd = -1


C = TypeVar("C", bound=Child)


def cap_mask(names: tuple[str, ...]) -> int:
    """Capability names (CAP_CHOWN, ...) as the kernel's bit mask."""
    if not names:
        return 0
    import prctl

    mask = 0
    for n in names:
        mask |= 1 << int(getattr(prctl, n))
    return mask


def spawn(plan: CData, make: type[C]) -> C:
    """Clone a child for a lowered ``struct sk_plan`` (its run fields applied). It
    waits for Stage.IDMAP, then (hold_before_exec) Stage.ATTACHED."""
    out = ffi.new("struct sk_child *")
    step = ffi.new("int *")
    r = lib.sk_spawn(plan, out, step)
    if r < 0:
        name = STEP_NAMES.get(step[0], str(step[0]))
        raise spawn_error(name, -r, None)
    awaits = [Stage.IDMAP] + ([Stage.ATTACHED] if plan.hold_before_exec else [])
    return make(out.pid, out.pidfd, out.report_fd, out.sync_fd, awaits)


def release(child: Child, stage: Stage) -> bool:
    """Release the child into ``stage``, the next one it waits for. False when it
    already died: its report pipe says why."""
    if not child.awaits or child.awaits[0] != stage:
        # both sides follow one order; the C child would refuse it too (stage-order)
        raise ValueError(f"the child waits for {child.awaits[0].name if child.awaits else 'no stage'}, not {stage.name}")
    child.awaits.pop(0)
    r = lib.sk_release(child.sync_fd, int(stage))
    if r == -_errno.EPIPE:
        return False
    if r < 0:
        from .remedies import detect
        from .remedies import release as why  # error path only

        rem = why(-r, detect())
        raise SandboxError("release child", errno=-r, detail=rem.cause, remedy=rem.fix)
    return True


def recv_console(sock_fd: int) -> int:
    """The pty master the sandbox sends over the console socket (EOF: setup failed)."""
    import socket

    with socket.socket(fileno=os.dup(sock_fd)) as s:
        _msg, fds, _flags, _addr = socket.recv_fds(s, 1, 1)
    if not fds:
        return -1
    os.set_inheritable(fds[0], False)  # recv_fds ignores MSG_CMSG_CLOEXEC
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]


def pidfd_pid(pidfd: int) -> int:
    """The pid a pidfd refers to, as its fdinfo says (-1 once that process has exited):
    a peer checked by pid is still the process that connected."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
            for line in f:
                if line.startswith(b"Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def has_exited(child: Child) -> bool:
    """The sandbox's init is gone (its pidfd polls readable)."""
    import select

    p = select.poll()
    p.register(child.pidfd, select.POLLIN)
    return bool(p.poll(0))


REMEDIES: dict[str, str] = {
    # the steps linux/remedies.py has no environment to weigh for
    "chdir": "the working directory does not exist inside the sandbox; pass --cwd with a directory inside the project",
    "lo-up": "bringing up loopback failed in the new network namespace",
    "rlimit": "a resource limit is above the hard limit of the caller; lower it",
    "launcher": "the sandbox launcher could not start; set STOCKADE_LAUNCHER=0 to start each sandbox directly",
    "observe": "observe mode's filter was refused (EBUSY: a seccomp filter this process runs under already has a "
               "listener, as some container engines install; EPERM/EACCES: the run's seccomp profile denies "
               "seccomp(2)): run without --observe, allow seccomp in your --seccomp profile, or run in a "
               "container started without a seccomp profile of its own",
}


def mounts_under(dirs: tuple[str, ...] | list[str]) -> list[str]:
    """Mount points strictly below any of ``dirs`` (host paths), from /proc/self/mountinfo."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    import re  # only on this error path

    roots = [d.rstrip("/") + "/" for d in dirs]
    out: list[str] = []
    for line in lines:
        fields = line.split(b" ")
        if len(fields) < 5:
            continue
        # the mount point, with space, tab, newline and backslash octal-escaped
        mp = os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4]))
        if any(mp.startswith(r) for r in roots) and mp not in out:
            out.append(mp)
    return out


def spawn_error(step: str, err: int, path: str | None, *, op_kind: str | None = None,
                upper: str | None = None) -> SandboxError:
    """The cause and fix come from linux/remedies.py, which `stockade doctor` uses too."""
    from . import remedies  # error path only

    rem = remedies.for_step(step, err, op_kind=op_kind, state=upper)
    if step == "clone":
        step = "clone3 (new user, mount, pid, net, ipc, uts, cgroup namespaces)"
    if rem is None:
        return SandboxError(step, path=path, errno=err, remedy=REMEDIES.get(step))
    return SandboxError(step, path=path, errno=err, detail=rem.cause, remedy=rem.fix)
