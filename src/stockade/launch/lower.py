"""A Plan lowered into the C core's structs (csrc/stockade_native.h).

Two parts, as on the wire (csrc/wire.c): ``LoweredPlan`` (a ``struct sk_plan``
without its run fields: kept for the next run of an equal plan) and
``LoweredRun`` (a ``struct sk_run``: the command, environment, cwd, the overlay's
layers, fd slots, made per run). A cold start applies the run to the plan in C
(``sk_run_apply``) and spawns it; a launcher gets both packed by C and applies
them the same way. Python never writes or edits the packed format.
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SandboxError
from ..linux.native import C, CData, Child, Report, cap_mask, ffi, lib, mounts_under, spawn_error
from ..linux.native import spawn as native_spawn
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
NS_FLAG = {
    "user": 0x10000000,
    "mount": 0x00020000,
    "pid": 0x20000000,
    "net": 0x40000000,
    "ipc": 0x08000000,
    "uts": 0x04000000,
    "cgroup": 0x02000000,
}

OLD = "/oldroot"
NEW = "/newroot"


def _overlay_escape(p: str) -> str:
    # overlayfs splits options on ',' and lower dirs on ':'; '\' escapes both.
    return p.replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


def _host(p: str) -> str:
    return OLD + p


def _sbx(p: str) -> str:
    return NEW if p == "/" else NEW + p


def overlay_options(m: MountOp) -> str:
    """An overlay op's mount options (its layers as the staging tree sees them)."""
    lowers = ":".join(_overlay_escape(_host(x)) for x in m.lower)
    opts = f"lowerdir={lowers}"
    if m.upper is not None and m.work is not None:
        opts += f",upperdir={_overlay_escape(_host(m.upper))},workdir={_overlay_escape(_host(m.work))}"
    return opts + ",userxattr"


def plan_key(plan: Plan, mounts: tuple[MountOp, ...]) -> Hashable:
    """Equal for two plans whose ``LoweredPlan`` (with these ops) is equal: every
    field ``LoweredPlan`` reads, the overlay ops without their layers (a run's)."""
    ops = tuple((m.kind, m.target, m.flags, m.mode) if m.kind == "overlay" else m for m in mounts)
    ll = plan.landlock if plan.landlock is not None and plan.landlock.abi > 0 else None
    return (ops, plan.namespaces, plan.uid_map, plan.gid_map, plan.deny_setgroups, plan.drop_groups,
            plan.uid, plan.gid, plan.hostname, plan.rlimits, plan.keep_fds, plan.keep_caps, ll, plan.seccomp_bpf)


class _Keep:
    """Owns the cffi buffers a struct points into."""

    def __init__(self) -> None:
        self.keep: list[Any] = []

    def s(self, v: str | bytes | None) -> CData:
        if v is None:
            return ffi.NULL
        b = v.encode("utf-8", "surrogateescape") if isinstance(v, str) else v
        c = ffi.new("char[]", b)
        self.keep.append(c)
        return c

    def new(self, ctype: str, init: Any) -> CData:
        c = ffi.new(ctype, init)
        self.keep.append(c)
        return c


class LoweredPlan(_Keep):
    """A ``struct sk_plan`` for ``mounts`` (the plan's own, or a launcher's base or
    run part), without the run's fields."""

    def __init__(self, plan: Plan, mounts: tuple[MountOp, ...], *, stage_dir: str = "/tmp",
                 clone_flags: int | None = None) -> None:
        super().__init__()
        s = self.s
        self.mounts = mounts  # what a mount step's op index refers to
        ops = self.new("struct sk_mount_op[]", max(1, len(mounts)))
        for i, m in enumerate(mounts):
            o = ops[i]
            o.kind = _KIND[m.kind]
            fl = 0
            for f in m.flags:
                fl |= _FLAG[f]
            o.flags = fl
            o.target = s(OLD if m.kind == "detach-host" else _sbx(m.target))
            if m.source is not None:
                if m.source_in_stage:
                    o.source = s(m.source)
                else:
                    o.source = s(_sbx(m.source) if m.source_in_sandbox else _host(m.source))
            if m.kind != "overlay" and m.data is not None:  # an overlay's layers are the run's
                data = m.data.encode("utf-8", "surrogateescape") if isinstance(m.data, str) else m.data
                o.data = s(data)
                o.data_len = len(data)
            o.mode = m.mode

        p = self.new("struct sk_plan *", None)
        flags = 0
        for n in plan.namespaces:
            flags |= NS_FLAG[n]
        p.clone_flags = flags if clone_flags is None else clone_flags
        p.cgroup_fd = p.console_sock = p.serve_fd = p.launcher_exec_fd = p.launcher_ctl_fd = p.observe_sock = -1
        p.stdio = [-1, -1, -1]
        # newuidmap/newgidmap write a subordinate range's maps (spawn below, before Stage.IDMAP)
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
        if plan.rlimits:
            rl = self.new("struct sk_rlimit[]", len(plan.rlimits))
            for i, (res, soft, hard) in enumerate(plan.rlimits):
                rl[i].resource = res
                rl[i].soft = soft
                rl[i].hard = hard
            p.rlimits = rl
            p.n_rlimits = len(plan.rlimits)
        if plan.keep_fds:
            p.keep_fds = self.new("int[]", list(plan.keep_fds))
            p.n_keep_fds = len(plan.keep_fds)
        p.drop_caps = 1
        p.keep_caps = cap_mask(plan.keep_caps)
        p.no_new_privs = 1
        if plan.landlock is not None and plan.landlock.abi > 0:
            ll = plan.landlock
            rules = self.new("struct sk_landlock_rule[]", max(1, len(ll.rules)))
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
            p.landlock.restrict_flags = ll.restrict_flags
            for attr, ports in (("bind_ports", ll.bind_ports), ("connect_ports", ll.connect_ports)):
                if ports:
                    setattr(p.landlock, attr, self.new("unsigned short[]", list(ports)))
                    setattr(p.landlock, "n_" + attr, len(ports))
        if plan.seccomp_bpf:
            p.seccomp_bpf = self.new("unsigned char[]", plan.seccomp_bpf)
            p.seccomp_len = len(plan.seccomp_bpf)
        self.plan = p

    def pack(self) -> bytes:
        """The plan part of the wire format (wire.c's sk_plan_pack)."""
        n = lib.sk_plan_pack(self.plan, ffi.NULL, 0)
        buf = ffi.new("unsigned char[]", n)
        lib.sk_plan_pack(self.plan, buf, n)
        return bytes(ffi.buffer(buf, n))


class LoweredRun(_Keep):
    """A ``struct sk_run``: what differs between runs of one plan. fd fields are this
    process's fds (a cold start) or slots of a launcher request."""

    def __init__(
        self,
        plan: Plan,
        mounts: tuple[MountOp, ...],
        stdio: tuple[int, int, int],
        cgroup_fd: int,
        *,
        pty: bool = False,
        console_sock: int = -1,
        join_fds: tuple[int, ...] = (),
        hold_before_exec: bool = False,
        hold_fd: int = -1,
        serve_fd: int = -1,
        observe_sock: int = -1,
        observe_bpf: bytes = b"",
    ) -> None:
        super().__init__()
        s = self.s
        r = self.new("struct sk_run *", None)
        r.argv = self.new("char *[]", [s(a) for a in plan.argv] + [ffi.NULL])
        r.envp = self.new("char *[]", [s(f"{k}={v}") for k, v in plan.env] + [ffi.NULL])
        r.path_env = s(plan.path_env)
        r.cwd = s(plan.cwd)
        overlays = [(i, m) for i, m in enumerate(mounts) if m.kind == "overlay"]
        if overlays:
            ov = self.new("struct sk_overlay_data[]", len(overlays))
            for j, (i, m) in enumerate(overlays):
                ov[j].op = i
                ov[j].data = s(overlay_options(m))
            r.overlays = ov
            r.n_overlays = len(overlays)
        r.stdio = list(stdio)
        r.cgroup_fd = cgroup_fd
        if join_fds:
            r.cgroup_join_fds = self.new("int[]", list(join_fds))
            r.n_cgroup_join_fds = len(join_fds)
        r.pty = int(pty)
        r.console_sock = console_sock
        r.hold_before_exec = int(hold_before_exec)
        r.serve_fd = serve_fd
        r.hold_fd = hold_fd
        r.observe_sock = observe_sock
        if observe_bpf:
            r.observe_bpf = self.new("unsigned char[]", observe_bpf)
            r.observe_len = len(observe_bpf)
        self.run = r

    def apply(self, lowered: LoweredPlan) -> None:
        """Put this run in the plan (wire.c's sk_run_apply, as the launcher does)."""
        if lib.sk_run_apply(lowered.plan, self.run) < 0:
            raise ValueError("a run's overlay names an op that is not an overlay")
        lowered.keep.append(self)  # the plan now points into our buffers

    def pack(self) -> bytes:
        """The run part of the wire format (wire.c's sk_run_pack)."""
        n = lib.sk_run_pack(self.run, ffi.NULL, 0)
        buf = ffi.new("unsigned char[]", n)
        lib.sk_run_pack(self.run, buf, n)
        return bytes(ffi.buffer(buf, n))


@dataclass
class RunChild(Child):
    """A started sandbox; ``mounts``: the ops a mount step's report index refers to."""

    mounts: tuple[MountOp, ...] = ()


def spawn(plan: Plan, lowered: LoweredPlan, make: type[C]) -> C:
    """Clone a child for ``lowered`` (made from ``plan``) and write the id maps a
    helper must (newuidmap/newgidmap: a subordinate range); the C core wrote the
    others. It then waits for Stage.IDMAP."""
    child = native_spawn(lowered.plan, make)
    maps = (plan.uid_map, plan.gid_map)
    if any(m.helper for m in maps):
        from ..linux import idmap

        try:
            for m, what in zip(maps, ("uid_map", "gid_map"), strict=True):
                if m.helper:
                    idmap.write_with_helper(child.pid, m.helper, m.entries, what)
        except BaseException:
            os.kill(child.pid, 9)
            child.reap()
            child.close()
            raise
    return child


def report_error(rep: Report, ops: Sequence[MountOp], cgroup_paths: Sequence[str] = ()) -> SandboxError:
    """The error a child's failure record describes; ``ops`` are the mount ops its
    step index refers to (``RunChild.mounts``), ``cgroup_paths`` the tasks files a
    cgroup-join index does. Paths are given as the sandbox (or host) names them."""
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
