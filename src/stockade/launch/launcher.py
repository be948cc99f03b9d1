"""Pre-spawned launchers: start sandboxes without cloning the Python process.

A cold start clones this (large) process into new namespaces and builds the
whole tree. A launcher (csrc/launcher/) is made once per *base* — the
part of a plan that does not change from run to run: the id maps and the
read-only tree of system binds, curated /etc and /dev. It keeps that tree at
/newroot of its staging namespace; for each run it forks a small child that
unshares fresh mount, pid, net, ipc and uts namespaces and finishes the tree
there (proc, devpts, /tmp, $HOME, the project overlay, masks), then runs the
same confinement steps as a cold start. Nothing of one run is visible to
another: each has its own mount namespace, overlay, tmpfs instances, procfs,
devpts, network namespace and PID namespace. The user namespace is shared by
the runs of one launcher (same ids, same maps), as it is by the runs of a
warm sandbox.

``STOCKADE_LAUNCHER=0`` turns launchers off (every run starts cold).

Shared launchers (the CLI, where every command is a new process): the first
``stockade run`` makes a launcher that also listens on a socket in the state
dir (``launchers/<digest of the base>.sock``, mode 0700 directory, peers
checked to be the same user) and outlives it; later commands connect to it.
It exits after ``STOCKADE_LAUNCHER_IDLE`` seconds (default 300) without clients
or runs. A run it starts still ends with the process that asked for it.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SandboxError
from ..linux import native
from ..plan import MountOp, Plan
from . import lower
from .lower import LoweredPlan, LoweredRun, RunChild

# struct sk_msg_hdr (csrc/launcher/launcher.h): magic, type, flags, plan_len, run_len, idle_seconds
_MSG = struct.Struct("6I")
_MAGIC = 0x324C4B53
_BASE, _RUN, _HELLO = 1, 2, 3
_NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2), linux/nsfs.h
_PLAN_IN_FD = 1
_INLINE_MAX = 200 * 1024
_IDLE_MAX = 4  # launchers kept for bases no run uses any more

_MOUNT_KINDS = frozenset({"bind", "tmpfs", "overlay", "proc", "devpts", "mqueue"})

PATH = Path(__file__).resolve().parent.parent / "stockade-launcher"


SHARED = False  # the CLI sets this: launchers outlive the process and are found by socket


def enabled() -> bool:
    if os.environ.get("STOCKADE_LAUNCHER", "1") == "0":
        return False
    try:
        os.stat(PATH)
    except OSError:  # not built, or not reachable by this user: cold starts
        return False
    return True


def _under(p: str, roots: list[str]) -> bool:
    return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)


def split(plan: Plan) -> tuple[tuple[MountOp, ...], tuple[MountOp, ...]] | None:
    """(base ops, per-run ops), or None when this plan cannot be split.

    Per run: every fresh instance (procfs, devpts, tmpfs, overlay, mqueue),
    everything from the new procfs on, the host detach and the read-only
    remounts. The base pre-creates the per-run mount points, so a run never
    writes into the tmpfs it shares with other runs.
    """
    ops = plan.mounts
    first = next((i for i, m in enumerate(ops) if m.target == "/proc"), None)  # a procfs, or an empty tmpfs
    if first is None:
        return None
    base: list[MountOp] = []
    run: list[MountOp] = []
    run_targets: list[str] = []
    for i, m in enumerate(ops):
        per_run = (
            i >= first
            or m.kind in ("devpts", "mqueue", "overlay", "detach-host", "remount-ro")
            or (m.kind == "tmpfs" and m.target != "/dev")
            or m.source_in_sandbox
            or m.source_in_stage
        )
        if not per_run and _under(m.target, run_targets):
            return None  # a base op inside a per-run mount: keep the plan's order
        if per_run:
            run.append(m)
            if m.kind in _MOUNT_KINDS:
                run_targets.append(m.target)
        else:
            base.append(m)
    # mount points of the per-run mounts, made once in the shared tree
    made: list[str] = []
    # a point inside a base bind or on a base file exists already (a mask over a denied
    # system file): making it again would truncate through a read-only bind (EROFS)
    present = [m.target for m in base if m.kind in ("bind", "file")]
    for m in run:
        if m.kind not in _MOUNT_KINDS or _under(m.target, made) or _under(m.target, present):
            continue
        if m.target in ("/", "/dev"):
            return None
        is_file = "file" in m.flags
        if m.kind == "bind" and not is_file and m.source and not (m.source_in_sandbox or m.source_in_stage):
            try:
                is_file = not os.path.isdir(m.source)
            except OSError:
                is_file = False
        if is_file:
            base.append(MountOp("file", m.target, data=b"", mode=0o644, why="mount point"))
        else:
            base.append(MountOp("mkdir", m.target, why="mount point"))
            made.append(m.target)
    return tuple(base), tuple(run)


def userns() -> tuple[int, int]:
    """This process's user namespace (st_dev, st_ino): a launcher serves one namespace's
    processes only, so it is part of its key (and of its socket's name)."""
    st = os.stat("/proc/self/ns/user")
    return (st.st_dev, st.st_ino)


def _key(plan: Plan, base: tuple[MountOp, ...]) -> tuple[Any, ...]:
    return (base, plan.uid_map, plan.gid_map, plan.deny_setgroups, userns())


def _hello(s: socket.socket) -> None:
    """Show a shared launcher that we can reach its user namespace, after checking
    that it is a child of ours (one made in another namespace sharing this state dir,
    e.g. inside `unshare -U`, would start our runs there). Raises OSError otherwise."""
    import errno
    import fcntl

    pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    # only a process with ptrace rights over the launcher opens this: one in the
    # namespace it was made from (ours, if it is ours) or an ancestor of that
    ns = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        parent = fcntl.ioctl(ns, _NS_GET_PARENT)
        try:
            st = os.fstat(parent)
        finally:
            os.close(parent)
        if (st.st_dev, st.st_ino) != userns():
            raise OSError(errno.EPERM, "the launcher was made in another user namespace")
        # A sibling namespace made from ours (`bwrap --unshare-user` sharing the state
        # dir) passes that check too: its process must not be mistaken for a launcher,
        # nor may it run the real one among processes that hold capabilities over it.
        exe, real = os.stat(f"/proc/{pid}/exe"), os.stat(PATH)
        if (exe.st_dev, exe.st_ino) != (real.st_dev, real.st_ino):
            raise OSError(errno.EPERM, "the process listening on the launcher's socket is not a stockade launcher")
        st = os.fstat(ns)
        if not only_its_own(pid, (st.st_dev, st.st_ino)):
            raise OSError(errno.EPERM, "processes other than the launcher's own share its user namespace")
        socket.send_fds(s, [_MSG.pack(_MAGIC, _HELLO, 0, 0, 0, 0)], [ns])
    finally:
        os.close(ns)


def only_its_own(pid: int, ns: tuple[int, int]) -> bool:
    """Whether every process in the user namespace ``ns`` (st_dev, st_ino) is ``pid``
    or a descendant of it: a launcher's namespace holds only the launcher, its run
    children and their sandboxes."""
    parents: dict[int, int] = {}
    members: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{name}/ns/user")
        except OSError:
            continue  # gone, or another user's (never in a namespace of ours)
        if (st.st_dev, st.st_ino) == ns:
            members.append(int(name))

    def parent(p: int) -> int:
        if p not in parents:
            try:
                with open(f"/proc/{p}/stat", "rb") as f:
                    parents[p] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                parents[p] = -1  # gone meanwhile
        return parents[p]

    for p in members:
        if parent(p) < 0:
            continue  # exited since: it holds nothing any more
        for _ in range(4096):
            if p == pid:
                break
            p = parent(p)
            if p <= 1:
                return False  # an ancestor outside the launcher's tree (or gone: not vouched for)
        else:
            return False
    return True


class LauncherChild(RunChild):
    """A sandbox started by a launcher: init is the launcher's grandchild, so its
    exit status comes over the status socket instead of waitid."""

    status_sock: socket.socket | None = None
    owner: Launcher | None = None
    runner_fd: int = -1  # pidfd of the run child: readable once it (and its mount namespace) is gone

    @property
    def exit_fd(self) -> int:
        # the status arrives once init is reaped and the session's overlay unmounted
        return self.status_sock.fileno() if self.status_sock is not None else self.pidfd

    def reap(self) -> int | None:
        s = self.status_sock
        if s is None:
            return None
        try:
            data = s.recv(native.REPORT.size)
        except OSError:
            data = b""
        reps, _ = native.parse_reports(data)
        unmounted = any(r.kind == native.REP_INIT_EXIT and r.err == 0 for r in reps)
        if self.runner_fd >= 0 and not unmounted:
            # the run child could not unmount the session's overlay itself: it goes
            # with the child's mount namespace, so wait for the child to be gone
            import select

            p = select.poll()
            p.register(self.runner_fd, select.POLLIN)
            p.poll()
        for r in reps:
            if r.kind == native.REP_INIT_EXIT:
                st = r.value
                return os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)
        return None

    def close(self) -> None:
        super().close()
        if self.runner_fd >= 0:
            os.close(self.runner_fd)
            self.runner_fd = -1
        if self.status_sock is not None:
            self.status_sock.close()
            self.status_sock = None
        if self.owner is not None:
            self.owner.release()
            self.owner = None


class Launcher:
    pid = -1
    pidfd = -1

    @classmethod
    def connect(cls, path: str) -> Launcher:
        """A client of a shared launcher (not our child: nothing to reap)."""
        la = cls.__new__(cls)
        la.inflight = 0
        la.retired = False
        la.lock = threading.Lock()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(path)
            _hello(s)
        except OSError:
            s.close()
            raise
        la.ctl = s
        return la

    def __init__(self, plan: Plan, base: tuple[MountOp, ...], listen: socket.socket | None = None, idle: int = 0) -> None:
        self.inflight = 0
        self.retired = False
        self.lock = threading.Lock()
        ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ctl = ctl
        child_fd = theirs.detach()
        if child_fd < 3:
            fd = os.dup(child_fd)  # CPython dup() is close-on-exec
            while fd < 3:
                fd = os.dup(fd)
            os.close(child_fd)
            child_fd = fd
        exe = os.open(PATH, os.O_PATH | os.O_CLOEXEC)
        child: native.Child | None = None
        try:
            os.set_inheritable(child_fd, True)
            low = LoweredPlan(plan, (), clone_flags=lower.NS_FLAG["user"] | lower.NS_FLAG["mount"])
            low.plan.launcher_exec_fd = exe
            low.plan.launcher_ctl_fd = child_fd
            child = lower.spawn(plan, low, native.Child)
            self.pid, self.pidfd, child.pidfd = child.pid, child.pidfd, -1  # ours to reap
            os.close(child_fd)
            child_fd = -1
            native.release(child, native.Stage.IDMAP)  # it execs the launcher
            # the report pipe closes on a successful exec; a record means it failed
            data = b""
            while d := os.read(child.report_fd, 4096):
                data += d
            for r in native.parse_reports(data)[0]:
                if r.kind == native.REP_ERROR:
                    raise lower.report_error(r, ())
            self._send(_BASE, LoweredPlan(plan, base).pack(), b"", [listen.fileno()] if listen is not None else [],
                       idle_seconds=idle)
            reps, _ = native.parse_reports(ctl.recv(native.REPORT.size))
            if not reps:
                raise SandboxError("launcher", errno=0, remedy=native.REMEDIES["launcher"])
            if reps[0].kind == native.REP_ERROR:
                raise lower.report_error(reps[0], base)
        except BaseException:
            self.ctl.close()  # a launcher still waiting for its base ends on EOF
            self._reap()
            raise
        finally:
            os.close(exe)
            if child_fd >= 0:
                os.close(child_fd)
            if child is not None:
                child.close()

    def _send(self, kind: int, plan: bytes, run: bytes, fds: list[int], idle_seconds: int = 0) -> None:
        """One request: the header, then the plan part and the run part as C packed
        them (two buffers of one message), or both in a memfd when large."""
        extra: list[int] = []
        flags = 0
        body = [plan, run]
        if len(plan) + len(run) > _INLINE_MAX:
            mfd = os.memfd_create("stockade-plan", os.MFD_CLOEXEC)
            os.writev(mfd, body)  # memfd writes are whole
            extra = [mfd]
            flags = _PLAN_IN_FD
            body = []
        try:
            hdr = _MSG.pack(_MAGIC, kind, flags, len(plan), len(run), idle_seconds)
            socket.send_fds(self.ctl, [hdr, *body], fds + extra)
        finally:
            for fd in extra:
                os.close(fd)

    def start(self, plan: bytes, run: bytes, mounts: tuple[MountOp, ...], fds: list[int],
              hold_before_exec: bool) -> LauncherChild:
        """Send one run (the packed plan and run parts, whose fd fields index ``fds``,
        followed by its pass-through fds); ``mounts`` are the ops a mount step's index
        refers to."""
        rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
        sync_r, sync_w = os.pipe2(os.O_CLOEXEC)
        st, st_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ok = False
        try:
            with self.lock:
                self.inflight += 1
            try:
                self._send(_RUN, plan, run, [rep_w, sync_r, st_theirs.fileno(), *fds])
            finally:
                os.close(rep_w)
                os.close(sync_r)
                st_theirs.close()
            msg, got, _flags, _addr = socket.recv_fds(st, native.REPORT.size, 2)
            for fd in got:
                os.set_inheritable(fd, False)
            reps, _ = native.parse_reports(msg)
            r = reps[0] if reps else None
            if r is None or r.kind != native.REP_INIT or not got:
                for fd in got:
                    os.close(fd)
                if r is not None and r.kind == native.REP_ERROR:
                    raise lower.report_error(r, ())
                raise SandboxError("launcher", errno=0, remedy=native.REMEDIES["launcher"])
            # no Stage.IDMAP for a run: the launcher's maps were written once
            child = LauncherChild(r.value, got[0], rep_r, sync_w, [native.Stage.ATTACHED] if hold_before_exec else [],
                                  mounts)
            if len(got) > 1:
                child.runner_fd = got[1]
            child.status_sock = st
            child.owner = self
            ok = True
            return child
        finally:
            if not ok:
                os.close(rep_r)
                os.close(sync_w)
                st.close()
                self.release()

    def release(self) -> None:
        with self.lock:
            self.inflight -= 1
            done = self.retired and self.inflight == 0
        if done:
            self.close()

    def retire(self) -> None:
        with self.lock:
            self.retired = True
            done = self.inflight == 0
        if done:
            self.close()

    def close(self) -> None:
        """EOF on the control socket ends the launcher (and anything it still runs)."""
        self.ctl.close()
        self._reap()

    def _reap(self) -> None:
        fd, self.pidfd = self.pidfd, -1
        if fd < 0:
            return
        try:
            os.waitid(os.P_PIDFD, fd, os.WEXITED)
        except ChildProcessError:
            pass
        finally:
            os.close(fd)


_lock = threading.Lock()
_launchers: OrderedDict[tuple[Any, ...], Launcher] = OrderedDict()
_unavailable: dict[tuple[Any, ...], str] = {}  # bases whose launcher could not start, and why


@dataclass(frozen=True)
class Packed:
    """A plan made ready for a launcher: the launcher's base ops and key, where its run
    ops sit in ``plan.mounts``, and its plan part as C packed it. Kept for the next run
    of the same plan, or of an equal one (another command, session or environment:
    those are the run part's, packed per run)."""

    plan: Plan  # kept alive: the cache by id() relies on it
    base: tuple[MountOp, ...]
    key: tuple[Any, ...]
    run_idx: tuple[int, ...]
    packed: bytes


_by_id: OrderedDict[int, Packed] = OrderedDict()  # the same plan object (a Sandbox's next run)
_by_value: OrderedDict[Hashable, Packed] = OrderedDict()  # lower.plan_key: equal but for the run's fields


def packed(plan: Plan) -> Packed | None:
    """The plan part for this plan, made once per distinct plan (lowering and packing
    costs ~0.2 ms); None when the plan cannot be split into base and run."""
    hit = _by_id.get(id(plan))
    if hit is not None and hit.plan is plan:
        return hit
    vkey = lower.plan_key(plan, plan.mounts)
    got = _by_value.get(vkey)
    if got is None:
        parts = split(plan)
        if parts is None:
            return None
        base, run = parts
        at = {id(m): i for i, m in enumerate(plan.mounts)}
        got = Packed(plan, base, _key(plan, base), tuple(at[id(m)] for m in run), LoweredPlan(plan, run).pack())
    mine = got if got.plan is plan else Packed(plan, got.base, got.key, got.run_idx, got.packed)
    with _lock:
        _by_value[vkey] = got
        _by_id[id(plan)] = mine
        for d in (_by_value, _by_id):
            while len(d) > 16:
                d.popitem(last=False)
    return mine


def _forget_after_fork() -> None:
    # The child of a fork must not share (or end) its parent's own launchers. A
    # connection to a shared launcher it may keep: each run has its own status
    # socket (what the launcher watches), and a run request is one atomic message.
    global _lock
    _lock = threading.Lock()
    for key, la in list(_launchers.items()):
        if la.pid < 0 and la.inflight == 0 and not la.retired:
            la.lock = threading.Lock()
            continue
        try:
            la.ctl.close()
        except OSError:
            pass
        if la.pidfd >= 0:
            os.close(la.pidfd)
            la.pidfd = -1
        del _launchers[key]
    _unavailable.clear()


def preconnect(plan: Plan) -> bool:
    """Connect to the running shared launcher for this plan's base (never make one):
    a CLI server does this once, and the supervisors it forks inherit the connection."""
    parts = split(plan)
    if parts is None or not enabled():
        return False
    key = _key(plan, parts[0])
    with _lock:
        old = _launchers.get(key)
    if old is not None:
        import select

        p = select.poll()
        p.register(old.ctl, select.POLLRDHUP)
        if not p.poll(0):
            return True
        with _lock:  # that launcher is gone (idled out, killed): join its successor
            if _launchers.get(key) is old:
                del _launchers[key]
        old.retire()
    try:
        la = _shared(plan, parts[0], create=False)
    except (OSError, SandboxError):
        return False
    with _lock:
        _launchers.setdefault(key, la)
    return True


os.register_at_fork(after_in_child=_forget_after_fork)


def shutdown() -> None:
    with _lock:
        las = list(_launchers.values())
        _launchers.clear()
    for la in las:
        la.retire()


def _sweep(dfd: int, via: str) -> None:
    """Remove the sockets of launchers that idled out (nobody listens any more)."""
    for n in os.listdir(via):
        if not n.endswith(".sock"):
            continue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(via + n)
        except ConnectionRefusedError:
            try:
                os.unlink(n, dir_fd=dfd)
            except FileNotFoundError:
                pass
        except OSError:
            pass
        finally:
            s.close()


def _shared(plan: Plan, base: tuple[MountOp, ...], create: bool = True) -> Launcher:
    """Connect to the shared launcher for this base, or make it."""
    import hashlib  # only here: the CLI's import time counts

    from ..paths import state_dir

    st = os.stat(PATH)
    h = hashlib.sha256()
    for m in base:  # the base only: not the command, its environment or its session
        h.update(repr((m.kind, m.target, m.source, m.data, sorted(m.flags), m.mode, m.lower,
                       m.source_in_sandbox, m.source_in_stage)).encode())
    h.update(repr((plan.uid_map, plan.gid_map, plan.deny_setgroups, st.st_ino, st.st_mtime_ns, st.st_size, userns())).encode())
    d = Path(state_dir()) / "launchers"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = h.hexdigest()[:24] + ".sock"
    # a socket path is at most 107 bytes: reach the directory through an fd
    dfd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        via = f"/proc/self/fd/{dfd}/"
        try:
            return Launcher.connect(via + name)
        except (FileNotFoundError, ConnectionRefusedError):
            if not create:
                raise
        _sweep(dfd, via)
        tmp = f"{name}.{os.getpid()}.{threading.get_ident() % 100000}"
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            lst.bind(via + tmp)
            lst.listen(64)
            idle = int(os.environ.get("STOCKADE_LAUNCHER_IDLE", "300") or 300)
            la = Launcher(plan, base, listen=lst, idle=max(1, idle))
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # atomic: a racing creator's launcher idles out
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        finally:
            lst.close()
    finally:
        os.close(dfd)
    return la


def start(
    plan: Plan,
    stdio: tuple[int, int, int],
    cgroup_fd: int | None,
    *,
    pty: bool,
    console_sock: int,
    hold_before_exec: bool,
    hold_fd: int = -1,
    join_fds: tuple[int, ...] = (),
    serve_fd: int = -1,
    observe_sock: int = -1,
    observe_bpf: bytes = b"",
) -> LauncherChild | None:
    """Start the plan through a launcher; None when this plan has to start cold.

    ``hold_fd``: the session's overlay lock (``Session.lock``): the sandbox takes it
    before it mounts the overlay and its run child keeps it until the overlay is
    gone, so the run's status need not wait for the unmount."""
    # fd slots: 0..2 are the report pipe, sync pipe and status socket (added by Launcher.start)
    fds: list[int] = []

    def slot(fd: int | None) -> int:
        if fd is None or fd < 0:
            return -1
        fds.append(fd)
        return 3 + len(fds) - 1

    slots = (slot(stdio[0]), slot(stdio[1]), slot(stdio[2]))
    cg_slot = slot(cgroup_fd)
    con_slot = slot(console_sock)
    join_slots = tuple(slot(fd) for fd in join_fds)
    hold_slot = slot(hold_fd)
    serve_slot = slot(serve_fd)
    observe_slot = slot(observe_sock)
    from ..callerfds import sources

    fds.extend(sources(plan.keep_fds) or plan.keep_fds)  # the caller's fds (a server's supervisor: as received)
    got = packed(plan)
    if got is None:
        return None
    mounts = tuple(plan.mounts[i] for i in got.run_idx)
    run = LoweredRun(plan, mounts, slots, cg_slot, pty=pty, console_sock=con_slot, join_fds=join_slots,
                     hold_before_exec=hold_before_exec, hold_fd=hold_slot, serve_fd=serve_slot,
                     observe_sock=observe_slot, observe_bpf=observe_bpf).pack()
    base, key = got.base, got.key
    for attempt in (0, 1):
        with _lock:
            la = _launchers.get(key)
            if la is not None:
                _launchers.move_to_end(key)
        if la is None:
            if key in _unavailable:
                return None
            try:
                la = _shared(plan, base) if SHARED else Launcher(plan, base)
            except (OSError, SandboxError) as e:
                # No launcher for this base (its executable unreachable, a base mount
                # refused...): start cold, which is as strong and reports any real
                # failure of the plan with its own step and remedy.
                _unavailable[key] = str(e)
                return None
            with _lock:
                old = _launchers.get(key)
                if old is not None:  # another thread made one meanwhile: use it
                    la.retire()
                    la = old
                else:
                    _launchers[key] = la
                    while len(_launchers) > _IDLE_MAX:
                        _k, victim = _launchers.popitem(last=False)
                        victim.retire()
        try:
            return la.start(got.packed, run, mounts, fds, hold_before_exec)
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError):
            # the launcher died (killed from outside): make a new one, once
            with _lock:
                if _launchers.get(key) is la:
                    del _launchers[key]
            la.retire()
            if attempt:
                raise
    return None
