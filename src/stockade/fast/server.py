"""The CLI's warm server: every module imported once, a forked supervisor per run.

A `stockade run` spends most of its time importing stockade. The first CLI run
of a user starts this server (``client.spawn``, with the CLI's entry: ``main(handler)``);
later ones hand it their arguments, environment, working directory and stdio
(``client.run``). For each, the server forks; the child takes on the client's whole
context and runs the same CLI code as the client would have in-process (``handler``),
then reports the exit status.

Serving is exact or declined. The server declines, before anything runs, a client
that differs from it in anything a fork would not carry over: uid/gids,
capabilities, no_new_privs, seccomp, LSM label, any namespace or root directory,
the interpreter, package or interpreter environment (``PYTHON*``, ``LC_*``,
``LANG``), rlimits it cannot match; the client then runs in-process. A server
whose code changed on disk tells the client and exits. Peers must be the same uid
in the same namespaces: a sandbox given the state directory cannot use it.

Process roles: the server (``stockade-server``) leads its own session, holds no
threads, and ends after ``STOCKADE_SERVER_IDLE`` seconds (300) without a client.
A supervisor ends its run as a killed CLI would (SIGKILL) when its client goes
away, so a killed `stockade run` leaves nothing behind either way.
"""

from __future__ import annotations

import gc
import os
import resource
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import paths
from . import client as _client

# The CLI a supervisor runs: (the client's arguments, housekeeping to run once the
# client has its status) -> exit status. The CLI gives it (``stockade.cli.serve``).
Handler = Callable[[list[str], list[Callable[[], None]]], int]

_SO_PEERPIDFD = 77  # Linux 6.5
_STATUS_KEYS = (b"Uid:", b"Gid:", b"Groups:", b"CapInh:", b"CapPrm:", b"CapEff:", b"CapBnd:", b"CapAmb:",
                b"NoNewPrivs:", b"Seccomp:", b"Seccomp_filters:")
_NAMESPACES = ("mnt", "pid", "net", "user", "uts", "ipc", "cgroup", "time")
_RLIMITS = tuple(getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_"))


def _identity(pid: int | str) -> tuple[object, ...]:
    """What a forked child would inherit from its parent and cannot take on later."""
    with open(f"/proc/{pid}/status", "rb") as f:
        status = tuple(ln for ln in f.read().splitlines() if ln.startswith(_STATUS_KEYS))
    ns = tuple(os.stat(f"/proc/{pid}/ns/{n}").st_ino for n in _NAMESPACES if os.path.exists(f"/proc/self/ns/{n}"))
    root = os.stat(f"/proc/{pid}/root")
    try:
        with open(f"/proc/{pid}/attr/current", "rb") as f:
            label = f.read()
    except OSError:
        label = b""
    return status, ns, (root.st_dev, root.st_ino), label


def code_signature(pkg: str) -> tuple[object, ...]:
    """The package's files as loaded: a changed file means a stale server."""
    out: list[object] = []

    def walk(d: str) -> None:
        with os.scandir(d) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        walk(e.path)
                else:
                    st = e.stat()
                    out.append((e.path, st.st_mtime_ns, st.st_size, st.st_ino))

    walk(pkg)
    st = os.stat(sys.executable)
    out.append((sys.executable, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(out, key=repr))


class CodeWatch:
    """Whether the package changed on disk since the server imported it: inotify
    on its directories (no cost per request), else its files' stat signatures."""

    _MASK = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800  # modify attrib close_write moved create delete *_self

    def __init__(self, pkg: str) -> None:
        self.pkg = pkg
        self.fd = -1
        self.sig: tuple[object, ...] | None = None
        self.exe = self._exe()
        try:
            from ..linux import libc

            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                raise OSError(libc.errno(), "inotify_init1")
            for d, dirs, _files in os.walk(pkg):
                dirs[:] = [x for x in dirs if x != "__pycache__"]
                if libc.inotify_add_watch(fd, os.fsencode(d), self._MASK) < 0:
                    os.close(fd)
                    raise OSError(libc.errno(), "inotify_add_watch")
            self.fd = fd
        except (OSError, AttributeError):
            self.sig = code_signature(pkg)

    @staticmethod
    def _exe() -> tuple[int, int] | None:
        try:
            st = os.stat(sys.executable)
        except OSError:  # a path this uid may execute but not stat: nothing to compare
            return None
        return (st.st_ino, st.st_mtime_ns)

    def changed(self) -> bool:
        if self._exe() != self.exe:
            return True
        if self.fd < 0:
            return code_signature(self.pkg) != self.sig
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return False
        i = 0
        while i + 16 <= len(data):  # struct inotify_event: wd, mask, cookie, len, name
            n = int.from_bytes(data[i + 12:i + 16], sys.byteorder)
            name = data[i + 16:i + 16 + n].rstrip(b"\0")
            if name != b"__pycache__":  # the interpreter writing byte code is no change
                return True
            i += 16 + n
        return False


def _warm() -> None:
    """Import everything a run may use, so a supervisor imports nothing."""
    import pkgutil

    import stockade

    skip = {"stockade.fast.server", "stockade.__main__", "stockade.demo"}
    # verbs that are never served (they serve a client of their own): their web and MCP
    # stacks would cost every server start a second of imports
    apart = ("stockade.mcp", "stockade.review")
    for m in pkgutil.walk_packages(stockade.__path__, "stockade."):
        if m.name not in skip and not m.name.startswith(apart):
            try:
                __import__(m.name)
            except ImportError:
                pass


def _prefault(waiting: Callable[[], bool]) -> None:
    """Copy this fork's private writable pages now (MADV_POPULATE_WRITE, Linux 5.14),
    while no client waits: Python writes reference counts all over the heap, and
    each first write after ``fork`` is a page fault and a copy on the run's path.
    Stops when a client comes (``waiting``): copying all of them first would make it
    wait for pages its run never writes."""
    from ..linux import libc

    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            maps = f.read().splitlines()
    except (OSError, AttributeError):
        return
    for line in maps:
        if waiting():
            return
        fields = line.split()
        if len(fields) < 2 or fields[1][:2] != "rw" or fields[1][3] != "p" or (len(fields) > 5 and fields[5].startswith("[v")):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        libc.madvise(lo, hi - lo, 23)  # MADV_POPULATE_WRITE; refused ranges stay as they are


class Request:
    def __init__(self, conn: socket.socket, pid: int, pidfd: int, fds: list[int], argv: list[str],
                 env: list[bytes], umask: int) -> None:
        self.conn, self.pid, self.pidfd, self.fds = conn, pid, pidfd, fds
        self.argv, self.env, self.umask = argv, env, umask
        self.numbers: list[int] = []  # the client's own numbers of fds[4:]
        self.stale = False  # sent in another protocol version

    def close(self) -> None:
        for fd in (*self.fds, self.pidfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.conn.close()


class Server:
    lock = -1

    def __init__(self, pkg: str, handler: Handler) -> None:
        self.pkg, self.handler = pkg, handler
        self.code = CodeWatch(pkg)
        self.me = _identity("self")
        self.interp = _client.interp_env()
        self.cache_dir = os.path.join(paths.state_dir(), "cache", "")

    def receive(self, conn: socket.socket) -> Request | None:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            return None
        try:  # only peers in our user namespace (not a nested one sharing the state dir)
            theirs = os.stat(f"/proc/{pid}/ns/user")
            ours = b"%d:%d" % (theirs.st_dev, theirs.st_ino) == _client.userns()
        except OSError:
            ours = False
        try:
            pidfd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        except OSError:
            pidfd = -1
        if ours and pidfd >= 0:  # the peer ended before we looked: its pid may be another process's
            from ..linux.native import pidfd_pid

            ours = pidfd_pid(pidfd) == pid
        conn.settimeout(5)  # a client sends its request at once
        try:
            msg, anc, flags, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(4 * (4 + _client.MAX_FDS)))
        except OSError:
            msg, anc, flags = b"", [], 0
        conn.settimeout(None)
        fds: list[int] = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += [int.from_bytes(data[i:i + 4], sys.byteorder) for i in range(0, len(data) - len(data) % 4, 4)]
        for fd in fds:
            os.set_inheritable(fd, False)  # recvmsg gives them without CLOEXEC: no launcher may inherit one
        fields = msg.split(b"\0")
        req = Request(conn, pid, pidfd, fds, [], [], 0o022)
        if not ours:
            self.reply(req, b"Mthe client is in another user namespace")
            return None
        if fields[0][:3] == _client.MAGIC[:3] and fields[0] != _client.MAGIC:
            req.stale = True  # another protocol: this server or the client is older; a new server settles it
            return req
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or fields[0] != _client.MAGIC:
                raise ValueError("malformed request")
            if os.fsdecode(fields[1]) != self.pkg:
                raise ValueError("another stockade package")
            req.umask = int(fields[2])
            req.numbers = [int(n) for n in fields[3].split(b",") if n]
            if len(fds) != 4 + len(req.numbers) or min(req.numbers, default=3) < 3:
                raise ValueError("malformed request")
            argc = int(fields[4])
            req.argv = [os.fsdecode(a) for a in fields[5:5 + argc]]
            req.env = [e for e in fields[5 + argc:] if b"=" in e]
            if len(req.argv) != argc:
                raise ValueError("malformed request")
        except (ValueError, IndexError) as e:
            self.reply(req, b"M" + str(e).encode())
            return None
        return req

    def reply(self, req: Request, msg: bytes) -> None:
        try:
            req.conn.send(msg)
        except OSError:
            pass
        req.close()

    def decline_reason(self, req: Request, interp: bool = True) -> str | None:
        env = dict(e.split(b"=", 1) for e in req.env)
        if interp and _client.interp_env(env) != self.interp:
            return "the interpreter environment (PYTHON*, LC_*, LANG) differs"
        try:
            them = _identity(req.pid)
        except OSError as e:
            return f"cannot read the client's process state: {e}"
        for what, a, b in zip(("identity (ids, groups, capabilities, no_new_privs, seccomp)", "namespaces",
                               "root directory", "security label"), them, self.me, strict=True):
            if a != b:
                return f"the client's {what} differs"
        if req.pidfd >= 0 and select.select([req.pidfd], [], [], 0)[0]:
            return "the client exited"  # and its pid may be another process's now
        return None

    # ------------------------------------------------------------------ the server

    def serve(self, lst: socket.socket, idle: float) -> None:
        """Keep one forked *spare* waiting for the next client. A spare that took one
        is replaced once its run ended (or 50 ms on, for a client arriving meanwhile):
        forking during a run would take a CPU from it. A run that left a prepared
        entry new to the server also replaces the waiting spare, so the next one
        inherits it decoded."""
        lst.setblocking(False)  # spares race for a connection: the losers go back to waiting
        poll = select.poll()
        spares: dict[int, int] = {}  # status pipe (read end) -> that spare's control pipe (write end; -1 once retired)
        current = -1  # the status pipe of the spare that waits
        due = 0.0  # when to fork the next spare
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if current < 0 and now >= due:
                current = self._fork_spare(lst, spares)
                if current >= 0:
                    poll.register(current, select.POLLIN)
                else:
                    due = now + 1.0  # out of processes: try again later
            wait = last + idle - now
            if current < 0:
                wait = min(wait, due - now)
            events = poll.poll(max(0.0, wait) * 1000)
            if not events and time.monotonic() >= last + idle:
                return
            for fd, _ev in events:
                try:
                    msg = os.read(fd, 4096)
                except OSError:
                    msg = b""
                if not msg:  # that spare exited
                    poll.unregister(fd)
                    os.close(fd)
                    ctl = spares.pop(fd, -1)
                    if ctl >= 0:
                        os.close(ctl)
                    if fd == current:
                        current = -1
                    due = 0.0
                    continue
                for note in msg.split(b"\n"):
                    if note == b"T":  # took a client
                        last = time.monotonic()
                        if fd == current:
                            current = -1
                            due = last + 0.05
                    elif note == b"S":  # the code changed: the client starts a new server
                        return
                    elif note[:1] == b"W":  # a run ended
                        due = 0.0
                        if self.prewarm(os.fsdecode(note[1:])) and current >= 0:
                            ctl = spares.get(current, -1)
                            if ctl >= 0:
                                os.close(ctl)
                                spares[current] = -1
                            current = -1

    def _fork_spare(self, lst: socket.socket, spares: dict[int, int]) -> int:
        gc.freeze()  # what the spare inherits stays shared: its collections never touch it
        st_r, st_w = os.pipe2(os.O_CLOEXEC)
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError:
            for fd in (st_r, st_w, ctl_r, ctl_w):
                os.close(fd)
            return -1
        if pid == 0:
            try:
                os.close(st_r)
                os.close(ctl_w)
                os.close(self.lock)  # the server's alone: a successor must not wait for this run
                for a, b in spares.items():
                    os.close(a)
                    if b >= 0:
                        os.close(b)
                self.spare(lst, ctl_r, st_w)
            finally:
                os._exit(0)
        os.close(st_w)
        os.close(ctl_r)
        spares[st_r] = ctl_w
        return st_r

    def prewarm(self, path: str) -> bool:
        """Decode the prepared run a supervisor used and join its shared launcher, so
        the next spares inherit both (every check still runs per run). True when that
        is new to this server."""
        from ..launch import launcher
        from ..pathsig import file_sig
        from . import warm

        if not path.startswith(self.cache_dir):
            return False
        pre = warm._preloaded.get(path)
        if pre is not None and file_sig(path) == pre[0]:
            try:
                launcher.preconnect(pre[2])  # still connected, or to the launcher's successor
            except Exception:  # an optimisation only
                pass
            return False
        try:
            plan = warm.preload(path)
            if plan is None:
                return False
            launcher.preconnect(plan)
        except Exception:  # an optimisation only: the supervisor does it all itself
            return False
        return True

    # ------------------------------------------------------------------ a spare

    @staticmethod
    def _cgroups_ahead() -> None:
        """Make the cgroups the likeliest next run (the last one's prepared entry)
        will use, while no client waits (cgroup v1: three mkdirs and their limits).
        Held by its manager until a run takes them or ``flush_deferred``."""
        from . import warm

        if not warm._preloaded:
            return
        _sig, _data, plan, limits, manager = next(reversed(warm._preloaded.values()))
        ahead = getattr(manager, "make_ahead", None)
        if ahead is None:
            return
        try:
            ahead(limits, pid_namespace="pid" in plan.namespaces)
        except OSError:
            return
        manager.defer_removal = True  # the supervisor removes the run's after its reply

    @staticmethod
    def _net_ahead() -> None:
        """When the likeliest next run proxies its network (--net allow, forwarded ports),
        import and warm pyroute2 while no client waits: its helper forks from here."""
        from . import warm

        if not warm._preloaded:
            return
        plan = next(reversed(warm._preloaded.values()))[2]
        if plan.network == "allow" or plan.forward:
            from ..net import netns

            netns.warm_netlink()

    def spare(self, lst: socket.socket, ctl: int, status: int) -> None:
        """Wait for a client (or retirement); serve it: decline, or become its supervisor."""
        from ..cgroups.base import flush_deferred

        self._cgroups_ahead()
        self._net_ahead()
        conn = None
        try:
            poll = select.poll()
            poll.register(lst, select.POLLIN)
            poll.register(ctl, select.POLLIN)
            _prefault(lambda: bool(poll.poll(0)))
            while conn is None:
                events = poll.poll()
                if any(fd == ctl for fd, _ev in events):
                    return  # retired (or the server is gone)
                try:
                    conn, _ = lst.accept()
                except (BlockingIOError, InterruptedError):
                    continue  # another spare took it
        finally:
            if conn is None:
                flush_deferred()  # nobody will run in the cgroups made ahead
        os.write(status, b"T\n")
        lst.close()
        os.close(ctl)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        conn.setblocking(True)
        req = self.receive(conn)
        if req is None:
            conn.close()
        elif req.stale:
            # only a peer we would serve may retire us (not a sandbox given the state dir)
            if (reason := self.decline_reason(req, interp=False)) is not None:
                self.reply(req, b"M" + reason.encode())
            else:
                self.reply(req, b"S")
                os.write(status, b"S\n")
        elif self.code.changed():
            self.reply(req, b"S")  # the client starts a server of the new code
            os.write(status, b"S\n")
        elif (reason := self.decline_reason(req)) is not None:
            self.reply(req, b"M" + reason.encode())
        else:
            if self.code.fd >= 0:
                os.close(self.code.fd)
            supervise(req, status, self.handler)
            return
        flush_deferred()


def _adopt(req: Request) -> None:
    """Take on the client's context: what ``fork`` would have given the CLI."""
    for r in _RLIMITS:
        want = resource.prlimit(req.pid, r)
        if resource.getrlimit(r) != want:
            resource.setrlimit(r, want)  # raises when the client's hard limit is higher
    os.sched_setaffinity(0, os.sched_getaffinity(req.pid))
    nice = os.getpriority(os.PRIO_PROCESS, req.pid)
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    with open(f"/proc/{req.pid}/oom_score_adj", "rb") as f:
        oom = f.read()
    with open("/proc/self/oom_score_adj", "rb") as f:
        if f.read() != oom:
            with open("/proc/self/oom_score_adj", "wb") as g:
                g.write(oom)
    paths.CGROUP_OWNER = req.pid
    from ..cgroups import detect

    detect.reset()  # chosen for the client's cgroup, not the server's
    os.umask(req.umask)
    os.environb.clear()  # shares its data with os.environ; putenv/unsetenv keep C's environ in step
    for e in req.env:
        k, v = e.split(b"=", 1)
        os.environb[k] = v
    os.fchdir(req.fds[3])
    for i in range(3):
        os.dup2(req.fds[i], i)
    # the client's other fds stay where they arrived: `--pass-fd N` passes the
    # client's N (callerfds), never this process's own fd N
    from .. import callerfds

    callerfds.RECEIVED = dict(zip(req.numbers, req.fds[4:], strict=True))
    for fd in req.fds[:4]:
        if fd > 2:
            os.close(fd)
    req.fds = []


def supervise(req: Request, note: int, handler: Handler) -> None:
    """In the forked child: become the client's CLI for this one run."""
    gc.disable()  # a short-lived process: collections would only copy shared pages
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        _adopt(req)
    except OSError as e:
        # nothing ran yet: the client runs in-process
        req.conn.send(b"M" + f"cannot take on the client's context: {e}".encode())
        return
    sys.argv = ["stockade", *req.argv]
    try:
        sys.stdout.reconfigure(line_buffering=os.isatty(1))  # type: ignore[union-attr]
    except (AttributeError, OSError):
        pass
    me = os.pidfd_open(os.getpid())
    req.conn.sendmsg([b"A%d" % os.getpid()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, me.to_bytes(4, sys.byteorder))])
    os.close(me)
    # the client gone (killed) ends this run as a killed CLI would end it
    threading.Thread(target=_watch, args=(req.conn.fileno(), req.pidfd), daemon=True).start()
    after_reply: list[Callable[[], None]] = []
    rc: int
    try:
        rc = handler(req.argv, after_reply)
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code
        else:
            sys.stderr.write(f"{e.code}\n")
            rc = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except OSError:
            pass
    global _replied
    _replied = True
    try:
        req.conn.send(b"X%d" % rc)
    except OSError:
        pass
    # the client's fds are not ours to keep through the housekeeping below: a reader
    # waiting for their end (`out=$(stockade run ...)`) would wait for it too
    from .. import callerfds

    for fd in (callerfds.RECEIVED or {}).values():
        try:
            os.close(fd)
        except OSError:
            pass
    callerfds.RECEIVED = {}
    null = os.open(os.devnull, os.O_RDWR)
    for i in range(3):
        os.dup2(null, i)
    os.close(null)
    for fn in after_reply:
        try:
            fn()
        except Exception:  # housekeeping only
            pass
    retention = sys.modules.get("stockade.changes.retention")
    if retention is not None:
        retention.drain()  # a run's empty session being deleted (what atexit would wait for)
    try:
        from ..cgroups.base import flush_deferred

        flush_deferred()  # what atexit would do (os._exit below skips it): the run's, and any unused
    except Exception:
        pass
    from . import warm

    if warm.last_path:
        try:
            os.write(note, b"W" + os.fsencode(warm.last_path) + b"\n")
        except OSError:
            pass
    os._exit(0)


_replied = False  # the client has its status: its going away is no longer a kill


def _watch(conn_fd: int, pidfd: int) -> None:
    p = select.poll()
    p.register(conn_fd, select.POLLRDHUP)
    if pidfd >= 0:
        p.register(pidfd, select.POLLIN)
    p.poll()
    if not _replied:
        os.kill(os.getpid(), signal.SIGKILL)


def _terminate(_sig: int, _frame: Any) -> None:
    raise SystemExit(0)


def main(handler: Handler) -> None:
    """The server process: ``python -P -c ENTRY dir name`` (``client.spawn``)."""
    d, name = sys.argv[1], sys.argv[2]
    os.chdir("/")
    os.closerange(3, 1 << 20)  # inherited fds (a pipe the caller's caller waits on) must not live on here
    import fcntl

    # one server per key: a second one started meanwhile (racing clients) leaves
    lock = os.open(os.path.join(d, name[:-5] + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    for _ in range(20):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.05)  # a stale server may be on its way out
    else:
        sys.stderr.write("stockade-server: another server holds the lock\n")
        return
    try:
        import prctl

        prctl.set_name("stockade-server")
    except (ImportError, OSError):
        pass
    _warm()
    gc.freeze()
    pkg = _client.package_dir()
    if name != _client.key() + ".sock":  # started with another environment than its key says: serve nobody
        sys.stderr.write(f"stockade-server: {name} is not this environment's key ({_client.key()})\n")
        return
    srv = Server(pkg, handler)
    srv.lock = lock
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    signal.signal(signal.SIGTERM, _terminate)  # leave as on idle: socket removed, spares told (EOF)
    idle = max(1.0, float(os.environ.get("STOCKADE_SERVER_IDLE", "300") or 300))
    dfd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    via = f"/proc/self/fd/{dfd}/"
    tmp = f".{name}.{os.getpid()}"
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        lst.bind(via + tmp)
        lst.listen(64)
        mine = os.stat(tmp, dir_fd=dfd).st_ino
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # atomic: a racing server idles out unused
        srv.serve(lst, idle)
    finally:
        lst.close()
        try:
            if os.stat(name, dir_fd=dfd).st_ino == mine:
                os.unlink(name, dir_fd=dfd)
        except (OSError, UnboundLocalError):
            pass
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
