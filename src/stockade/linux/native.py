"""Thin typed layer over the C core (stockade._native): lowers a Plan into C structs,
spawns, and turns the child's report records into Python values."""

from __future__ import annotations

import errno as _errno
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._native import ffi, lib  # type: ignore[import-not-found]
from ..errors import SandboxError
from ..plan import MountOp, Plan

_KIND = {
    "bind": lib.SK_OP_BIND,
    "tmpfs": lib.SK_OP_TMPFS,
    "overlay": lib.SK_OP_OVERLAY,
    "proc": lib.SK_OP_PROC,
    "devpts": lib.SK_OP_DEVPTS,
    "mqueue": lib.SK_OP_MQUEUE,
    "detach-host": lib.SK_OP_DETACH_HOST,
    "mkdir": lib.SK_OP_MKDIR,
    "symlink": lib.SK_OP_SYMLINK,
    "file": lib.SK_OP_FILE,
    "remount-ro": lib.SK_OP_REMOUNT_RO,
}
_FLAG = {
    "ro": lib.SK_F_RDONLY,
    "rec": lib.SK_F_REC,
    "optional": lib.SK_F_OPTIONAL,
    "dev": lib.SK_F_DEV,
    "file": lib.SK_F_FILE,
    "noexec": lib.SK_F_NOEXEC,
}
_NS_FLAG = {
    "user": 0x10000000,
    "mount": 0x00020000,
    "pid": 0x20000000,
    "net": 0x40000000,
    "ipc": 0x08000000,
    "uts": 0x04000000,
    "cgroup": 0x02000000,
}

STEP_NAMES = {
    getattr(lib, n): n[len("SK_STEP_"):].lower().replace("_", "-")
    for n in dir(lib)
    if n.startswith("SK_STEP_")
}

REPORT = struct.Struct("iiii240s")
assert REPORT.size == ffi.sizeof("struct sk_report")

OLD = "/oldroot"
NEW = "/newroot"


def landlock_abi() -> int:
    r: int = lib.sk_landlock_abi()
    return r if r > 0 else 0


def _overlay_escape(p: str) -> str:
    # overlayfs splits options on ',' and lower dirs on ':'; '\' escapes both.
    return p.replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


def _host(p: str) -> str:
    return OLD + p


def _sbx(p: str) -> str:
    return NEW if p == "/" else NEW + p


def overlay_options(m: MountOp) -> str:
    """An overlay op's mount options (its layers as the launcher's staging tree sees them)."""
    lowers = ":".join(_overlay_escape(_host(x)) for x in m.lower)
    opts = f"lowerdir={lowers}"
    if m.upper is not None and m.work is not None:
        opts += f",upperdir={_overlay_escape(_host(m.upper))},workdir={_overlay_escape(_host(m.work))}"
    return opts + ",userxattr"


class Lowered:
    """cffi objects for one plan; keeps every buffer alive while the parent needs it."""

    def __init__(
        self,
        plan: Plan,
        stdio: tuple[int, int, int],
        cgroup_fd: int | None,
        pty: bool,
        stage_dir: str = "/tmp",
        console_sock: int = -1,
        hold_before_exec: bool = False,
        mounts: tuple[MountOp, ...] | None = None,
        skip_first_go: bool = False,
        join_fds: tuple[int, ...] = (),
    ) -> None:
        keep: list[Any] = []
        self._keep = keep
        mounts = plan.mounts if mounts is None else mounts
        self.mounts = mounts  # what a mount step's op index refers to
        self.maps = (plan.uid_map, plan.gid_map)  # spawn: the ones a helper writes

        def s(v: str | bytes | None) -> Any:
            if v is None:
                return ffi.NULL
            b = v.encode("utf-8", "surrogateescape") if isinstance(v, str) else v
            c = ffi.new("char[]", b)
            keep.append(c)
            return c

        ops = ffi.new("struct sk_mount_op[]", max(1, len(mounts)))
        keep.append(ops)
        for i, m in enumerate(mounts):
            o = ops[i]
            o.kind = _KIND[m.kind]
            fl = 0
            for f in m.flags:
                fl |= _FLAG[f]
            o.flags = fl
            o.target = s("/oldroot" if m.kind == "detach-host" else _sbx(m.target))
            if m.source is not None:
                if m.source_in_stage:
                    o.source = s(m.source)
                else:
                    o.source = s(_sbx(m.source) if m.source_in_sandbox else _host(m.source))
            if m.kind == "overlay":
                o.data = s(overlay_options(m))
            elif m.data is not None:
                data = m.data.encode("utf-8", "surrogateescape") if isinstance(m.data, str) else m.data
                o.data = s(data)
                o.data_len = len(data)
            o.mode = m.mode

        p = ffi.new("struct sk_plan *")
        keep.append(p)
        flags = 0
        for n in plan.namespaces:
            flags |= _NS_FLAG[n]
        p.clone_flags = flags
        p.cgroup_fd = -1 if cgroup_fd is None else cgroup_fd
        if join_fds:
            jf = ffi.new("int[]", list(join_fds))
            keep.append(jf)
            p.cgroup_join_fds = jf
            p.n_cgroup_join_fds = len(join_fds)
        # newuidmap/newgidmap write a subordinate range's maps (spawn, before "go")
        p.uid_map = ffi.NULL if plan.uid_map.helper else s(plan.uid_map.line())
        p.gid_map = ffi.NULL if plan.gid_map.helper else s(plan.gid_map.line())
        p.deny_setgroups = int(plan.deny_setgroups)
        p.drop_groups = int(plan.drop_groups)
        p.uid = plan.uid
        p.gid = plan.gid
        p.stage_dir = s(stage_dir)
        p.ops = ops
        p.n_ops = len(mounts)
        p.hostname = s(plan.hostname)
        p.lo_up = int("net" in plan.namespaces)
        p.cwd = s(plan.cwd)
        if plan.rlimits:
            rl = ffi.new("struct sk_rlimit[]", len(plan.rlimits))
            keep.append(rl)
            for i, (res, soft, hard) in enumerate(plan.rlimits):
                rl[i].resource = res
                rl[i].soft = soft
                rl[i].hard = hard
            p.rlimits = rl
            p.n_rlimits = len(plan.rlimits)
        p.stdio = list(stdio)
        if plan.keep_fds:
            kf = ffi.new("int[]", list(plan.keep_fds))
            keep.append(kf)
            p.keep_fds = kf
            p.n_keep_fds = len(plan.keep_fds)
            from ..callerfds import sources

            src = sources(plan.keep_fds)  # a server's supervisor: its client's fds, not its own numbers
            if src is not None:
                ks = ffi.new("int[]", list(src))
                keep.append(ks)
                p.keep_src = ks
        p.pty = int(pty)
        p.console_sock = console_sock
        p.drop_caps = 1
        p.keep_caps = cap_mask(plan.keep_caps)
        p.no_new_privs = 1
        if plan.landlock is not None and plan.landlock.abi > 0:
            ll = plan.landlock
            rules = ffi.new("struct sk_landlock_rule[]", max(1, len(ll.rules)))
            keep.append(rules)
            for i, (path, acc, opt) in enumerate(ll.rules):
                rules[i].path = s(path)
                rules[i].access = acc
                rules[i].optional = int(opt)
            p.landlock.abi = ll.abi
            p.landlock.handled_fs = ll.handled_fs
            p.landlock.handled_net = ll.handled_net
            p.landlock.scoped = ll.scoped
            p.landlock.rules = rules
            p.landlock.n_rules = len(ll.rules)
            for attr, ports in (("bind_ports", ll.bind_ports), ("connect_ports", ll.connect_ports)):
                if ports:
                    arr = ffi.new("unsigned short[]", list(ports))
                    keep.append(arr)
                    setattr(p.landlock, attr, arr)
                    setattr(p.landlock, "n_" + attr, len(ports))
        if plan.seccomp_bpf:
            bpf = ffi.new("unsigned char[]", plan.seccomp_bpf)
            keep.append(bpf)
            p.seccomp_bpf = bpf
            p.seccomp_len = len(plan.seccomp_bpf)
        argv = [s(a) for a in plan.argv] + [ffi.NULL]
        envp = [s(f"{k}={v}") for k, v in plan.env] + [ffi.NULL]
        c_argv = ffi.new("char *[]", argv)
        c_envp = ffi.new("char *[]", envp)
        keep.extend((c_argv, c_envp))
        p.argv = c_argv
        p.envp = c_envp
        p.path_env = s(plan.path_env)
        p.hold_before_exec = int(hold_before_exec)
        p.skip_first_go = int(skip_first_go)
        p.launcher_exec_fd = -1
        p.launcher_ctl_fd = -1
        self.plan = p

    def pack(self) -> bytes:
        n = lib.sk_plan_pack(self.plan, ffi.NULL, 0)
        buf = ffi.new("unsigned char[]", n)
        lib.sk_plan_pack(self.plan, buf, n)
        return bytes(ffi.buffer(buf, n))


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
    lowered: Any  # a Lowered (or anything with .mounts: what a mount step's index refers to)
    free_gos: int = 0  # "go" messages the child does not wait for

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


def cap_mask(names: tuple[str, ...]) -> int:
    """Capability names (CAP_CHOWN, ...) as the kernel's bit mask."""
    if not names:
        return 0
    import prctl

    mask = 0
    for n in names:
        mask |= 1 << int(getattr(prctl, n))
    return mask


def spawn(lowered: Lowered) -> Child:
    out = ffi.new("struct sk_child *")
    step = ffi.new("int *")
    r = lib.sk_spawn(lowered.plan, out, step)
    if r < 0:
        name = STEP_NAMES.get(step[0], str(step[0]))
        raise spawn_error(name, -r, None)
    child = Child(out.pid, out.pidfd, out.report_fd, out.sync_fd, lowered)
    if any(m.helper for m in lowered.maps):
        from . import idmap

        try:
            for m, what in zip(lowered.maps, ("uid_map", "gid_map"), strict=True):
                if m.helper:
                    idmap.write_with_helper(out.pid, m.helper, m.entries, what)
        except BaseException:
            os.kill(out.pid, 9)
            child.reap()
            child.close()
            raise
    return child


def start(
    plan: Plan,
    stdio: tuple[int, int, int],
    cgroup_fd: int | None,
    *,
    pty: bool = False,
    console_sock: int = -1,
    hold_before_exec: bool = False,
    hold_fd: int = -1,
    join_fds: tuple[int, ...] = (),
) -> Child:
    """Start a sandbox for the plan: through a pre-spawned launcher when possible
    (linux/launcher.py), else by cloning this process. ``hold_fd``: the session's
    overlay lock (``Session.lock``; a cold start's overlay is gone once its init is
    reaped). ``join_fds``: cgroup v1 ``tasks`` files the sandbox's init enters first
    (``RunCgroup.placement``)."""
    from . import launcher

    if launcher.enabled():
        child = launcher.start(plan, stdio, cgroup_fd, pty=pty, console_sock=console_sock,
                               hold_before_exec=hold_before_exec, hold_fd=hold_fd, join_fds=join_fds)
        if child is not None:
            return child
    if hold_fd >= 0:
        # an earlier run's overlay on this session may not be unmounted yet
        import fcntl

        fcntl.flock(hold_fd, fcntl.LOCK_EX)
    lowered = Lowered(plan, stdio, cgroup_fd, pty=pty, console_sock=console_sock, hold_before_exec=hold_before_exec,
                      join_fds=join_fds)
    return spawn(lowered)


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


def go(child: Child) -> bool:
    """Release the child. False when it already died: its report pipe says why."""
    import errno as _e

    if child.free_gos > 0:
        child.free_gos -= 1
        return True
    c = ffi.new("struct sk_child *")
    c.sync_fd = child.sync_fd
    r = lib.sk_go(c)
    if r == -_e.EPIPE:
        return False
    if r < 0:
        from .remedies import detect, release  # error path only

        rem = release(-r, detect())
        raise SandboxError("release child", errno=-r, detail=rem.cause, remedy=rem.fix)
    return True


def has_exited(child: Child) -> bool:
    """The sandbox's init is gone (its pidfd polls readable)."""
    import select

    p = select.poll()
    p.register(child.pidfd, select.POLLIN)
    return bool(p.poll(0))


_REMEDIES: dict[str, str] = {
    # the steps linux/remedies.py has no environment to weigh for
    "chdir": "the working directory does not exist inside the sandbox; pass --cwd with a directory inside the project",
    "lo-up": "bringing up loopback failed in the new network namespace",
    "rlimit": "a resource limit is above the hard limit of the caller; lower it",
    "launcher": "the sandbox launcher could not start; set STOCKADE_LAUNCHER=0 to start each sandbox directly",
}


def report_error(rep: Report, ops: Sequence[MountOp], cgroup_paths: Sequence[str] = ()) -> SandboxError:
    """The error a child's failure record describes; ``ops`` are the mount ops its
    step index refers to, ``cgroup_paths`` the tasks files a cgroup-join index does.
    Paths are given as the sandbox (or host) names them."""
    path = rep.path
    if rep.step == "cgroup-join" and 0 <= rep.value < len(cgroup_paths):
        path = cgroup_paths[rep.value]
    for pre in (NEW, OLD):
        if path.startswith(pre):
            path = path[len(pre):] or "/"
    op = ops[rep.value] if rep.step == "mount" and 0 <= rep.value < len(ops) else None
    if op is not None and op.kind == "overlay" and rep.err == _errno.EINVAL:
        inside = mounts_under(op.lower)
        if inside:
            # the kernel's own words are only in dmesg ("overlayfs: failed to clone
            # lowerpath"): a layer with mounts below it is locked in our user namespace
            shown = ", ".join(inside[:5]) + (f" and {len(inside) - 5} more" if len(inside) > 5 else "")
            return SandboxError("mount", path=path or None, errno=rep.err, remedy=(
                f"the project contains mount points ({shown}); overlayfs cannot use a tree with mounts inside it "
                "as a layer of the sandbox: unmount them, or pass a --project that contains none"))
    return spawn_error(rep.step, rep.err, path or None, op_kind=op.kind if op is not None else None,
                       upper=op.upper if op is not None else None)


def mounts_under(dirs: Sequence[str]) -> list[str]:
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
        return SandboxError(step, path=path, errno=err, remedy=_REMEDIES.get(step))
    return SandboxError(step, path=path, errno=err, detail=rem.cause, remedy=rem.fix)
