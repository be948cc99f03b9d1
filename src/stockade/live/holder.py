"""A living sandbox's holder: the host process that starts the sandbox through the
core (prepare, launch), keeps its init serving, and answers its clients.

The holder is started by ``live.start`` as a fresh interpreter (``python -m
stockade.live.holder``): the caller may be a threaded program, and a fork of it
could inherit a held lock. It gets the ``StartSpec`` pickled on stdin and says
"ready" or the error on the fd named in its argv, then serves until ``stop``, an
idle timeout (detached), its owner's exit (attached), or the sandbox's end.

Its life, in order: session and lock -> prepare (the plan, built once) -> run
record -> launch with a serve socket (init serves execs) -> socket in the state dir
-> ready -> loop -> stop (SIGTERM to every process, grace, then init's end) ->
record -> cgroups removed -> exit. A reaper forked before anything starts cleans up
(cgroups, socket, record) if the holder itself is SIGKILLed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import plan as planmod
from ..errors import SessionBusy, StockadeError, UsageError
from ..session import store
from . import proto, registry

if TYPE_CHECKING:
    from ..core.diskwatch import DiskWatch
    from ..core.launch import Launch
    from ..core.prepare import Prepared
    from ..core.record import RunRecord
    from ..core.request import RunRequest

PLACEHOLDER_ARGV = ("stockade-init", "--serve")  # the plan's command: never run (init serves instead)
GRACE = 2.0
DEFAULT_IDLE = 1800.0  # a detached sandbox with nothing running for this long is stopped


@dataclass(frozen=True)
class StartSpec:
    """What ``start`` asks of a holder."""

    request: RunRequest  # the sandbox's options; its args are not used
    name: str | None = None  # the session (and sandbox) name; None: a new one
    detached: bool = False  # outlives its starter; ends after ``idle`` seconds of nothing running
    idle: float | None = None  # seconds; None: the config's [live] idle_timeout (else 30 min); inf: never
    owner_pid: int | None = None  # attached: the holder ends when this process does
    warm: bool = False  # pre-warmed: waits to be claimed (``stockade warm``)
    warm_key: str | None = None


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass
class ExecRec:
    """One exec the holder dispatched."""

    id: int
    run: int
    run_dir: str
    argv: list[str]
    cwd: str
    started: float
    timeout: float | None
    pid: int = 0  # inside the sandbox
    killed_at: float | None = None  # the holder's own timeout backstop fired
    disk_hit: str | None = None  # the disk watchdog ended it: what reached the cap or floor


@dataclass
class Conn:
    sock: socket.socket
    pid: int


@dataclass
class Adopted:
    """An ended exec's output pipe still held open by what it left running: drained
    into its log so that nothing it writes later is lost or gets SIGPIPE."""

    fd: int
    log: str
    room: int


class Holder:
    def __init__(self, spec: StartSpec, ready_fd: int) -> None:
        self.spec = spec
        self.ready_fd = ready_fd
        self.conns: dict[int, Conn] = {}
        self.execs: dict[int, ExecRec] = {}
        self.adopted: dict[int, Adopted] = {}
        self.next_exec = 1
        self.last_activity = time.monotonic()
        self.stopping: str | None = None  # why it stops
        self.stop_waiters: list[socket.socket] = []
        self.stop_grace = GRACE
        self.status = "starting"
        self.started = time.time()
        self.exec_count = 0
        self.frozen = False
        self.data: dict[str, Any] = {}
        self.reaper_w = -1
        self.launch: Launch | None = None
        self.prep: Prepared | None = None
        self.record: RunRecord | None = None
        self.serve: socket.socket | None = None
        self.listener: socket.socket | None = None
        self.sess: store.Session | None = None
        self.dir: Path | None = None
        self.owner_fd = -1
        self.init_pid = 0
        self.init_reaped = False
        self.hold_cm: Any = None
        self.claimed_by: str | None = None
        self.idle: float | None = None  # seconds with nothing running before a detached sandbox stops
        self.disk: DiskWatch | None = None  # the disk watchdog (core/diskwatch.py)
        self.prewarm = False
        self.prewarm_ttl = 300.0
        self.live_snapshots: list[str] = []  # snapshots taken while it ran (finish: deletions since)
        self.config_idle: float | None = DEFAULT_IDLE
        self.written_at = 0.0
        self.written_execs = 0
        self.cpu_marks: list[tuple[float, float]] = []
        self.term_requested = False  # SIGTERM came (its handler only sets this and wakes the loop)
        self.wake_r = -1
        self.created: set[str] = set()  # the files of the live dir this holder made (an abort removes only these)

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        from ..core.execute import discard_unused
        from ..core.launch import Launch
        from ..core.prepare import prepare
        from ..core.record import RunRecord
        from ..core.request import DEVNULL, RunIO

        spec = self.spec
        req = spec.request
        if req.pass_fds:
            raise UsageError("--pass-fd: a living sandbox's commands get their fds per exec "
                             "(`stockade exec --pass-fd N`, or pass_fds= of Sandbox.exec); drop it from start")
        project = planmod.resolve_project(req.project)
        fresh = spec.name is None
        if not fresh:
            try:
                store.open_session(str(spec.name))
            except StockadeError:
                store.validate_name(str(spec.name))
                fresh = True
        sess = self.sess = store.open_or_create(project, spec.name)
        try:
            other = registry.read(sess.id)
            if other is not None and other.status in ("running", "starting", "stopping", "warm"):
                raise UsageError(f"sandbox {sess.id!r} is already running (holder pid {other.holder_pid}); "
                                 f"use `stockade exec {sess.id} -- CMD`, or `stockade stop {sess.id}` first")
            self.dir = registry.make_dir(sess.id)
            self._start_reaper()
            self.hold_cm = sess.lock(wait=False, for_run=True)
            try:
                hold_fd = self.hold_cm.__enter__()
            except SessionBusy:
                self.hold_cm = None
                raise SessionBusy(f"session {sess.id!r} is in use by a run; start the sandbox when it has ended, "
                                  "or start one over another session") from None
            req = dataclasses.replace(req, args=PLACEHOLDER_ARGV, session=sess.id, pass_fds=())
            self._settings(sess, project, req)
            prep = self.prep = prepare(sess, project, req)
            if prep.plan.uid_map.ranged():
                from ..session import idrange

                idrange.record_plan(sess.dir, prep.plan)
            self.record = RunRecord(sess, prep, quiet=True)
            self.record.data["kind"] = "sandbox"
            self.record.data["argv"] = ["(living sandbox)"]
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self.serve = a
            launch = self.launch = Launch(RunIO(stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL))
            try:
                child = launch.start(sess, self.record.run_no, prep, hold_fd, False, serve_fd=b.fileno())
            finally:
                b.close()
            self.init_pid = child.pid
            self._await_ready()
            # the same disk cap as a run's (core/diskwatch.py): the holder looks, as a
            # run's supervisor does, for the sandbox's whole life
            from ..core.execute import disk_watch

            self.disk = disk_watch(sess, prep)
            if self.disk is not None:
                self.disk.attach(child.pid, child.pidfd)  # init serves: its mounts are in place
        except BaseException:
            self._abort()
            if fresh and self.sess is not None:
                discard_unused(self.sess)
            raise
        self._listen()
        self.status = "warm" if spec.warm else "running"
        self._write_record()
        if spec.warm:
            (self.dir / registry.WARM).touch()
            self.created.add(registry.WARM)
        self._say_ready({"ok": True, "id": sess.id, "pid": os.getpid(), "socket": str(self.dir / registry.SOCK)})

    def _settings(self, sess: store.Session, project: Path, req: RunRequest) -> None:
        """The config's [live], [snapshots] and [prewarm] settings; an automatic snapshot
        now, before the overlay is mounted (a mounted overlay's upper cannot be renamed)."""
        from ..core.prepare import load_policy

        pol = load_policy(project, sess, req.policy, req.env, req)
        conf = getattr(pol, "live_idle_timeout", DEFAULT_IDLE)
        self.config_idle = None if conf is None else float(conf)
        idle = self.spec.idle
        if idle is None:
            idle = conf
        self.idle = None if idle is None or idle == float("inf") else float(idle)
        if getattr(pol, "snapshots_auto", False) and not self.spec.warm:
            from .snapshot import auto_snapshot

            auto_snapshot(sess, int(getattr(pol, "snapshots_max_auto", 5)), getattr(pol, "snapshots_retention", None))
        self.prewarm = bool(getattr(pol, "prewarm_enabled", False))
        self.prewarm_ttl = float(getattr(pol, "prewarm_ttl", 300.0))

    def _await_ready(self) -> None:
        """init's first report: it serves, or the step that failed and why."""
        from ..launch import lower
        from ..linux import native

        assert self.launch is not None and self.launch.child is not None and self.prep is not None
        child = self.launch.child
        buf = b""
        deadline = time.monotonic() + 60
        while True:
            r, _, _ = select.select([child.report_fd], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                raise StockadeError("the sandbox's init did not report within 60 s")
            data = os.read(child.report_fd, 4096)
            if not data:
                raise StockadeError("the sandbox's init ended before it served (see `stockade doctor`)")
            reps, buf = native.parse_reports(buf + data)
            for rep in reps:
                if rep.kind == native.REP_ERROR:
                    place = self.launch.place
                    raise lower.report_error(rep, child.mounts or self.prep.plan.mounts,
                                             cgroup_paths=place.join_paths if place else ())
                if rep.kind == native.REP_STARTED:
                    return

    def _listen(self) -> None:
        assert self.dir is not None
        path = self.dir / registry.SOCK
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        addr, dfd = registry.sock_address(path)
        old = os.umask(0o177)
        try:
            s.bind(addr)
        finally:
            os.umask(old)
            if dfd >= 0:
                os.close(dfd)
        s.listen(64)
        s.setblocking(False)
        self.listener = s
        self.created.add(registry.SOCK)

    def _start_reaper(self) -> None:
        """A process that outlives a SIGKILLed holder and takes down what the kernel
        does not: the run's cgroups (named after the holder's pid), the socket, the
        record. Forked before any thread exists; it holds no fd of the session."""
        r, w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the reaper's own process
            try:
                os.setsid()
                keep = {r}
                for fd in range(3, 1024):
                    if fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                holder = os.getppid()
                while True:
                    try:
                        got = os.read(r, 1)
                        break
                    except InterruptedError:
                        continue
                if not got:
                    reap_after(holder, self.dir)
            finally:
                os._exit(0)
        os.close(r)
        self.reaper_w = w

    def _say_ready(self, msg: dict[str, Any]) -> None:
        if self.ready_fd < 0:  # a background warm-up: nobody waits
            if not msg.get("ok"):
                sys.stderr.write(f"stockade: pre-warming failed: {msg.get('error')}\n")
            return
        try:
            os.write(self.ready_fd, json.dumps(msg).encode() + b"\n")
        finally:
            os.close(self.ready_fd)
            self.ready_fd = -1

    def _write_record(self, **extra: Any) -> None:
        if self.dir is None or self.sess is None:
            return
        prep, spec = self.prep, self.spec
        plan = prep.plan if prep is not None else None
        data = {
            "id": self.sess.id,
            "provider": "stockade",
            "status": self.status,
            "started_at": _utc(self.started),
            "holder_pid": os.getpid(),
            "holder_start": registry.pid_start(os.getpid()),
            "init_pid": self.init_pid,
            "project": str(plan.project) if plan is not None else None,
            "session": self.sess.id,
            "detached": spec.detached,
            "idle_timeout": self.idle if spec.detached else None,
            "owner_pid": spec.owner_pid,
            "policy_digest": prep.audit.policy.digest if prep is not None else None,
            "network": plan.network if plan is not None else None,
            "warm_key": spec.warm_key,
            "warm_opts": spec.warm_key and spec.warm_key.split(":", 1)[0],
            "prewarm": self.prewarm,
            "prewarm_ttl": self.prewarm_ttl,
            "limits": _limits_json(prep),
            "run": self.record.run_no if self.record is not None else None,
            "execs": self.exec_count,
        }
        data.update(self.data)
        data["execs"] = self.exec_count  # (never a value kept from an earlier write)
        data.update(extra)
        self.data.update({k: v for k, v in extra.items() if k != "execs"})
        try:
            registry.write(self.dir, data)
            self.created.add(registry.RECORD)
        except (OSError, StockadeError) as e:  # a full disk: the record lags, the sandbox serves on
            sys.stderr.write(f"stockade: holder record not written: {e}\n")
        self.written_execs = self.exec_count
        self.written_at = time.monotonic()

    # ------------------------------------------------------------------ the loop

    def loop(self) -> None:
        assert self.listener is not None and self.serve is not None and self.launch is not None
        assert self.launch.child is not None
        ep = select.epoll()
        ep.register(self.listener.fileno(), select.EPOLLIN)
        ep.register(self.serve.fileno(), select.EPOLLIN)
        pidfd = self.launch.child.pidfd
        ep.register(pidfd, select.EPOLLIN)
        for fd in (*self.conns, *self.adopted):  # a new loop (a claim): the same watches
            ep.register(fd, select.EPOLLIN)
        if self.wake_r >= 0:
            ep.register(self.wake_r, select.EPOLLIN)
        if self.spec.owner_pid and not self.spec.detached:
            try:
                if self.owner_fd < 0:
                    self.owner_fd = os.pidfd_open(self.spec.owner_pid)
                ep.register(self.owner_fd, select.EPOLLIN)
            except OSError:
                self._begin_stop("its owner process is gone")
        stop_deadline: float | None = None
        try:
            while True:
                now = time.monotonic()
                if self.stopping is not None and stop_deadline is None:
                    stop_deadline = self._send_term(now)
                if stop_deadline is not None and (now >= stop_deadline or self._sandbox_empty()):
                    break
                timeout = self._next_wake(now, stop_deadline)
                try:
                    events = ep.poll(timeout)
                except InterruptedError:
                    continue
                # init's notes first: a batch of execs' ends must not wait behind requests
                serve_fd = self.serve.fileno()
                events.sort(key=lambda e: e[0] != serve_fd)
                for fd, _ev in events:
                    try:
                        stop_deadline = self._dispatch(ep, fd, pidfd, now, stop_deadline)
                    except _Rewatch:
                        raise
                    except Exception as e:  # one bad event never takes the sandbox down
                        sys.stderr.write(f"stockade: holder: {type(e).__name__}: {e}\n")
                if self.term_requested:
                    self.term_requested = False
                    self._begin_stop("the holder got SIGTERM")
                self._enforce_timeouts()
                self._disk_check()
                self._idle_check()
                if self.exec_count != self.written_execs and time.monotonic() - self.written_at > 1.0:
                    self._write_record()  # `stockade ps` figures, at most once a second
                self._mark_cpu()
        finally:
            ep.close()

    def _dispatch(self, ep: select.epoll, fd: int, pidfd: int, now: float,
                  stop_deadline: float | None) -> float | None:
        """One ready fd; the stop deadline (set once init is gone)."""
        assert self.listener is not None
        if fd == self.listener.fileno():
            self._accept(ep)
        elif self.serve is not None and fd == self.serve.fileno():
            self._notes()
        elif fd == pidfd:
            self.init_reaped = True
            if self.stopping is None:
                self.status = "failed"
                self._begin_stop("the sandbox's init ended")
            return now
        elif fd == self.owner_fd:
            self._begin_stop("its owner process ended")
        elif fd in self.adopted:
            self._drain(ep, fd)
        elif fd in self.conns:
            self._on_conn(ep, fd)
        elif fd == self.wake_r:
            _drain_fd(fd)
        return stop_deadline

    def _mark_cpu(self) -> None:
        """(time, CPU seconds) at most every second, kept two deep: status reports CPU use
        over the window from the older mark (at least a second, at most about two)."""
        from .status import cpu_seconds

        now = time.monotonic()
        if self.cpu_marks and now - self.cpu_marks[-1][0] < 1.0:
            return
        cpu = cpu_seconds(self.init_pid, self.launch.cg if self.launch is not None else None)
        if cpu is not None:
            self.cpu_marks = [*self.cpu_marks[-1:], (now, cpu)]

    @property
    def cpu_mark(self) -> tuple[float, float] | None:
        return self.cpu_marks[0] if self.cpu_marks else None

    def _disk_check(self) -> None:
        """The disk watchdog's look when due. Past the cap (or under the floor) while
        something writes, every process of the sandbox but init is killed at once: its
        files stay (the change set, the tmpfs), the sandbox still serves, and each exec
        that was running ends as disk-limit-hit."""
        d = self.disk
        if d is None or self.stopping is not None or self.init_reaped or time.monotonic() < d.next_at:
            return
        why = d.tick()
        if why is None:
            return
        for e in self.execs.values():
            e.disk_hit = why
        self._write_record(disk_hit=why, disk_hit_at=time.time())  # first: an exec's client reads it at its end
        if self.serve is not None:
            try:
                proto.send_signal_all(self.serve, signal.SIGKILL)
            except OSError:
                pass
        d.restart()
        try:
            from ..audit import AuditLog

            assert self.sess is not None
            AuditLog(self.sess).outcome(self.record.run_no if self.record is not None else 0, "disk-limit-hit",
                                        outcome=f"disk-limit-hit ({why}): every command of the sandbox killed",
                                        sandbox=self.sess.id)
        except (OSError, StockadeError, AssertionError):
            pass

    def _next_wake(self, now: float, stop_deadline: float | None) -> float:
        waits = [1.0]
        if self.disk is not None and self.stopping is None:
            waits.append(self.disk.next_at - now)
        if stop_deadline is not None:
            waits.append(0.02)
        for e in self.execs.values():
            if e.timeout is not None:
                waits.append(e.started + e.timeout + GRACE + 1.0 - time.time())
        if self.spec.detached and self.idle is not None and not self.execs:
            waits.append(self.last_activity + self.idle - now)
        return max(0.0, min(waits))

    def _idle_check(self) -> None:
        if (self.stopping is None and self.spec.detached and self.idle is not None and not self.execs
                and time.monotonic() - self.last_activity >= self.idle):
            self._begin_stop(f"idle for {self.idle:g} s")

    def _enforce_timeouts(self) -> None:
        """The client enforces an exec's timeout (SIGTERM, grace, SIGKILL); this is the
        backstop for a client that does not: the policy's limit holds regardless."""
        now = time.time()
        for e in self.execs.values():
            if e.timeout is not None and e.killed_at is None and now > e.started + e.timeout + GRACE + 1.0:
                e.killed_at = now
                assert self.serve is not None
                try:
                    proto.send_signal_exec(self.serve, e.id, signal.SIGKILL)
                except OSError:
                    pass

    def _begin_stop(self, why: str, grace: float | None = None) -> None:
        if self.stopping is None:
            self.stopping = why
            if grace is not None:
                self.stop_grace = grace
            if self.status != "failed":
                self.status = "stopping"
            self._write_record(reason=why)

    def _send_term(self, now: float) -> float:
        """Every process of the sandbox gets SIGTERM; the deadline of the grace period."""
        if self.serve is not None and not self.init_reaped:
            try:
                proto.send_signal_all(self.serve, signal.SIGTERM)
            except OSError:
                pass
        return now + self.stop_grace

    def _sandbox_empty(self) -> bool:
        """Nothing but init is left (or init itself is gone)."""
        if self.init_reaped:
            return True
        from .status import stragglers

        return not stragglers(self.init_pid)

    # ------------------------------------------------------------------ clients

    def _accept(self, ep: select.epoll) -> None:
        assert self.listener is not None
        while True:
            try:
                s, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE: the client waits in the backlog; retried on the next turn
                sys.stderr.write(f"stockade: holder: accept: {os.strerror(e.errno or 0)}\n")
                return
            peer = proto.same_userns_peer(s)
            if peer is None:
                s.close()  # another user, or a process in a sandbox: not ours to serve
                continue
            s.setblocking(False)
            self.conns[s.fileno()] = Conn(s, peer[0])
            ep.register(s.fileno(), select.EPOLLIN)
            self.last_activity = time.monotonic()

    def _drop(self, ep: select.epoll, fd: int) -> None:
        c = self.conns.pop(fd, None)
        if c is not None:
            try:
                ep.unregister(fd)
            except OSError:
                pass
            c.sock.close()

    def _on_conn(self, ep: select.epoll, fd: int) -> None:
        c = self.conns[fd]
        while True:
            try:
                msg = proto.recv_msg(c.sock, max_fds=4 + proto.MAX_FDS)
            except (BlockingIOError, InterruptedError):
                return
            except proto.ProtocolError as e:
                self._reply(c.sock, {"ok": False, "error": str(e), "status": 2})
                continue
            except OSError:
                msg = None
            if msg is None:
                self._drop(ep, fd)
                return
            self.last_activity = time.monotonic()
            op = msg.body.get("op")
            try:
                if op == "exec":
                    self._exec(msg)
                elif op == "adopt":
                    self._adopt(ep, msg)
                else:
                    msg.close_fds()
                    self._answer(ep, c, msg.body)
                    if fd not in self.conns:
                        return  # handed on (stop waits for the end)
            except Exception as e:  # one bad request never takes the holder down
                msg.close_fds()
                self._reply(c.sock, {"ok": False, "error": f"{type(e).__name__}: {e}", "status": 1})

    def _answer(self, ep: select.epoll, c: Conn, body: dict[str, object]) -> None:
        op = body.get("op")
        if op == "ping":
            self._reply(c.sock, {"ok": True})
        elif op == "status":
            self._reply(c.sock, {"ok": True, "status": self.status_json()})
        elif op == "stop":
            grace = _seconds(body.get("grace"))
            self._begin_stop("stopped on request", grace)
            self.stop_waiters.append(c.sock)
            fd = c.sock.fileno()
            ep.unregister(fd)
            del self.conns[fd]
        elif op == "snapshot":
            self._reply(c.sock, self._snapshot(str(body.get("name") or "")))
        elif op == "claim":
            self._claim(c, body)
        else:
            self._reply(c.sock, {"ok": False, "error": f"unknown request {op!r}", "status": 2})

    def _reply(self, sock: socket.socket, body: dict[str, Any]) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(2)
            proto.send_msg(sock, body)
        except OSError:
            pass
        finally:
            try:
                sock.setblocking(False)
            except OSError:
                pass

    # ------------------------------------------------------------------ exec

    def _exec(self, msg: proto.Message) -> None:
        """Check one exec and hand it to init. Answered on the exec socket (its first
        message), so that the client's reply and the command's reports share one channel."""
        fds = msg.fds
        if not fds:
            raise proto.ProtocolError("an exec without its socket")
        esock = fds[0]
        try:
            try:
                argv, env, cwd, timeout, pty, targets, stdio, passed = self._check_exec(msg)
            except (UsageError, ValueError, TypeError) as e:
                _send_on(esock, {"ok": False, "error": str(e), "status": 2})
                return
            except Exception as e:  # answered where the client waits: on its exec socket
                _send_on(esock, {"ok": False, "error": f"{type(e).__name__}: {e}", "status": 1})
                return
            if self.stopping is not None or self.status not in ("running", "warm"):
                _send_on(esock, {"ok": False, "error": f"sandbox {self.sess.id if self.sess else ''!r} is stopping "
                                 f"({self.stopping})", "status": 1})
                return
            assert self.sess is not None and self.prep is not None and self.serve is not None
            eid = self.next_exec
            self.next_exec += 1
            try:
                run_no, run_dir = self.sess.new_run_dir()
            except StockadeError as e:  # a full disk: said to the client, the sandbox serves on
                _send_on(esock, {"ok": False, "error": e.one_line(), "status": 1})
                return
            rec = ExecRec(eid, run_no, str(run_dir), argv, cwd, time.time(), timeout)
            _send_on(esock, {"ok": True, "exec": eid, "run": run_no, "run_dir": str(run_dir), "timeout": timeout,
                             "session": self.sess.id, "started_at": rec.started})
            try:
                proto.send_exec(self.serve, eid, argv, env, cwd, dict(env).get("PATH", self.prep.plan.path_env), esock, stdio, targets, passed, pty)
            except ValueError as e:  # (a NUL in the cwd; the rest was refused above)
                _send_on(esock, {"ok": False, "error": f"exec: {e}", "status": 2})
                return
            except OSError as e:
                _send_on(esock, {"ok": False, "error": f"the sandbox's init is gone ({os.strerror(e.errno or 0)})",
                                 "status": 1})
                return
            self.execs[eid] = rec
            self.exec_count += 1
            self._exec_started(rec)
        finally:
            msg.close_fds()

    def _check_exec(self, msg: proto.Message) -> tuple[list[str], list[tuple[str, str]], str, float | None, bool,
                                                       list[int], list[int], list[int]]:
        from ..core.prepare import _cwd

        assert self.prep is not None and self.sess is not None
        b = msg.body
        argv = b.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise UsageError("exec: no command given; usage: stockade exec NAME -- CMD [ARGS...]")
        if not argv[0]:
            raise UsageError("exec: the command is an empty string")
        if any("\0" in a for a in argv):
            raise UsageError("exec: an argument holds a NUL byte")
        extra = b.get("env") or {}
        if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise UsageError("exec: env must map names to strings")
        for k, v in extra.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise UsageError(f"--env {k!r}: expected NAME=VALUE (no NUL byte)")
        pty = bool(b.get("pty"))
        targets = b.get("targets") or []
        if not isinstance(targets, list) or not all(isinstance(t, int) and 3 <= t < 1 << 20 for t in targets):
            raise UsageError("exec: pass_fds must be fd numbers >= 3")
        nstd = 1 if pty else 3
        if len(msg.fds) != 1 + nstd + len(targets):
            raise proto.ProtocolError("an exec's fds do not match its request")
        stdio, passed = msg.fds[1:1 + nstd], msg.fds[1 + nstd:]
        if len(targets) > proto.MAX_FDS:
            raise UsageError(f"--pass-fd: at most {proto.MAX_FDS} descriptors, not {len(targets)}")
        plan = self.prep.plan
        if pty and not _unix_socket(stdio[0]):
            raise proto.ProtocolError("an exec's console is not a Unix socket")
        if plan.network != "host":
            from ..core.request import inet_socket

            # every fd the command gets (its stdio too: a UDP socket as stdout sends anywhere;
            # a connected TCP one can be disconnected and connected again)
            for fd in (*([] if pty else stdio), *passed):
                if inet_socket(fd):
                    raise UsageError("an IPv4/IPv6 socket of the host's network cannot be handed to an exec: "
                                     "inside it reaches what the sandbox's network mode "
                                     f"({plan.network}) does not allow; give the sandbox --net host at start, "
                                     "or pass a pipe or Unix socket")
        here = b.get("here")
        cwd_opt = b.get("cwd")
        project = plan.project
        if cwd_opt is not None:
            wd = str(_cwd(Path(project), str(cwd_opt)))
        elif isinstance(here, str) and (here == str(project) or here.startswith(str(project).rstrip("/") + "/")):
            wd = here
        else:
            wd = plan.cwd
        timeout = b.get("timeout")
        cap = self.prep.timeout
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) \
                    or timeout <= 0:
                raise UsageError(f"--timeout {timeout!r}: expected a duration > 0")
            t: float | None = float(timeout) if cap is None else min(float(timeout), cap)
        else:
            t = cap
        reason = self.prep.audit.policy.check_command(list(argv)) if hasattr(self.prep.audit.policy, "check_command") else None
        if reason:
            from ..audit import AuditLog

            try:
                AuditLog(self.sess).command_refused(None, list(argv), reason)
            except OSError:
                pass
            raise UsageError(f"command refused by policy: {reason}")
        # a claimed pre-warmed sandbox's run: the claimant's environment, filtered by the same
        # policy (its digest is in the claim's key), instead of the one at warm-up time
        env = {} if b.get("env_replace") else dict(plan.env)
        env.update(extra)
        return list(argv), list(env.items()), wd, t, pty, list(targets), list(stdio), list(passed)

    def _exec_started(self, rec: ExecRec) -> None:
        from ..audit import AuditLog
        from ..redact import record_argv

        assert self.sess is not None and self.record is not None
        data = {"run": rec.run, "kind": "exec", "sandbox": self.sess.id, "sandbox_run": self.record.run_no,
                "argv": record_argv(rec.argv), "cwd": rec.cwd, "started": _utc(rec.started), "status": "running"}
        try:
            store.write_json_atomic(rec.run_dir + "/run.json", data)
            AuditLog(self.sess).event("exec", " ".join(record_argv(rec.argv)), "started", run=rec.run,
                                      sandbox=self.sess.id, cwd=rec.cwd)
        except (OSError, StockadeError):
            pass  # the audit log never breaks a run (a full disk included)

    def _notes(self) -> None:
        assert self.serve is not None
        while True:
            try:
                data = self.serve.recv(64, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                return  # init's end closed: its pidfd says the rest
            try:
                kind, eid, value, err = proto.parse_note(data)
            except proto.ProtocolError:
                continue
            rec = self.execs.get(eid)
            if kind == proto.NOTE_STARTED and rec is not None:
                rec.pid = value
            elif kind in (proto.NOTE_EXIT, proto.NOTE_FAILED) and rec is not None:
                del self.execs[eid]
                self.last_activity = time.monotonic()
                self._exec_ended(rec, value if kind == proto.NOTE_EXIT else None, err)

    def _exec_ended(self, rec: ExecRec, status: int | None, err: int) -> None:
        from ..audit import AuditLog
        from ..cgroups import base as cgbase

        assert self.sess is not None
        ended = time.time()
        if status is None:
            code, kind, summary = 125, "error", f"could not start: {os.strerror(err)}"
        else:
            rc = os.waitstatus_to_exitcode(status)
            timed_out = rec.timeout is not None and ended - rec.started >= rec.timeout and rc < 0
            o = cgbase.classify(rc, timed_out=timed_out or rec.killed_at is not None, disk_hit=rec.disk_hit,
                                limits=self.prep.limits if self.prep is not None and rec.disk_hit else None)
            code = rc if rc >= 0 else 128 - rc
            kind, summary = o.kind, o.summary()
        try:
            path = rec.run_dir + "/run.json"
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = {"run": rec.run, "kind": "exec"}
            data.update({"status": "done", "ended": _utc(ended), "duration": round(ended - rec.started, 4),
                         "exit_status": code, "outcome": summary, "outcome_kind": kind})
            store.write_json_atomic(path, data)
            AuditLog(self.sess).outcome(rec.run, kind, outcome=summary, exit_status=code, sandbox=self.sess.id)
        except (OSError, StockadeError):
            pass

    # ------------------------------------------------------------------ adopted output

    def _adopt(self, ep: select.epoll, msg: proto.Message) -> None:
        from ..core.supervise import log_max

        run_dir = str(msg.body.get("run_dir") or "")
        names = msg.body.get("streams") or []
        if not isinstance(names, list) or len(names) != len(msg.fds) or self.sess is None or \
                not run_dir.startswith(str(self.sess.runs_dir) + "/"):
            msg.close_fds()
            return
        for fd, name in zip(msg.fds, names, strict=True):
            if name not in ("stdout", "stderr"):
                os.close(fd)
                continue
            log = f"{run_dir}/{name}.log"
            try:
                used = os.stat(log).st_size
            except OSError:
                used = 0
            os.set_blocking(fd, False)
            self.adopted[fd] = Adopted(fd, log, max(0, log_max() - used))
            ep.register(fd, select.EPOLLIN)
        msg.fds = []

    def _drain(self, ep: select.epoll, fd: int) -> None:
        a = self.adopted[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data and a.room > 0:
            keep = data[:a.room]
            try:
                lf = os.open(a.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                try:
                    os.write(lf, keep)
                finally:
                    os.close(lf)
                a.room -= len(keep)
            except OSError:
                a.room = 0
        if not data:
            ep.unregister(fd)
            os.close(fd)
            del self.adopted[fd]

    # ------------------------------------------------------------------ status, snapshot, claim

    def status_json(self) -> dict[str, Any]:
        """The provider status schema; CPU use over the last mark's window (about a
        second: the loop marks it on its ticks, never sleeping for a sample)."""
        from .status import resources

        assert self.sess is not None
        data = dict(self.data)
        rec = registry.read(self.sess.id)
        if rec is not None:
            data = {**rec.data, **data}
        data["status"] = self.status
        data["execs"] = self.exec_count
        data["changes"] = _changes_summary(self.sess)
        cg = self.launch.cg if self.launch is not None else None
        data["resources"] = resources(self.init_pid, cg, 0.0, since=self.cpu_mark)
        data["execs_running"] = [{"exec": e.id, "run": e.run, "argv": e.argv, "pid": e.pid} for e in self.execs.values()]
        return data

    def _snapshot(self, name: str) -> dict[str, Any]:
        """A consistent snapshot of a running sandbox: freeze its processes (the cgroup
        freezer, else SIGSTOP of its tree), copy the upper layer into a snapshot layer,
        thaw. The overlay keeps its upper (a mounted overlay's upper cannot be swapped)."""
        from .snapshot import snapshot_living

        assert self.sess is not None
        cg = self.launch.cg if self.launch is not None else None
        try:
            snap, how = snapshot_living(self.sess, name, cg, self.init_pid)
        except StockadeError as e:
            return {"ok": False, "error": e.one_line(), "status": e.exit_status}
        self.live_snapshots.append(snap)  # deletions after it are made whiteouts at the end (finish)
        self._write_record(live_snapshots=list(self.live_snapshots))  # (a scan meanwhile leaves them out)
        return {"ok": True, "snapshot": snap, "frozen_by": how}

    def _claim(self, c: Conn, body: dict[str, object]) -> None:
        """A pre-warmed sandbox is taken by a start or run with the same policy: it
        becomes an ordinary one (its owner and idle rules are the claimant's)."""
        if self.status != "warm":
            self._reply(c.sock, {"ok": False, "error": "not a pre-warmed sandbox (already claimed)", "status": 1})
            return
        self.status = "running"
        if self.dir is not None:
            try:
                (self.dir / registry.WARM).unlink()
            except FileNotFoundError:
                pass
        owner = body.get("owner_pid")
        detached = bool(body.get("detached"))
        idle = body.get("idle")
        self.spec = dataclasses.replace(self.spec, warm=False, detached=detached,
                                        owner_pid=int(str(owner)) if owner else None)
        if idle is not None:
            v = float(str(idle))
            self.idle = None if v == float("inf") or not v > 0 else v
        else:
            self.idle = self.config_idle
        self.claimed_by = str(owner or "")
        self._write_record(detached=detached, owner_pid=self.spec.owner_pid,
                           idle_timeout=self.idle if detached else None, claimed=True)
        self._reply(c.sock, {"ok": True, "id": self.sess.id if self.sess else None, "pid": os.getpid()})
        raise _Rewatch()

    # ------------------------------------------------------------------ stop

    def finish(self) -> None:
        """Take the sandbox down: init's end (the kernel kills what is left in its PID
        namespace), the overlay unmounted by its run child, the cgroups removed; the
        change set stays. Then the records and the waiting clients."""
        from ..linux import native

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the teardown runs to its end
        if self.serve is not None:
            self.serve.close()  # init's channel: it ends, and the kernel ends its PID namespace
            self.serve = None
        launch = self.launch
        reaped = self.init_reaped
        if launch is not None and launch.child is not None and not reaped:
            # init ends at once; one stuck (a vfork'd command in a hung mount) is killed
            if not select.select([launch.child.pidfd], [], [], 10.0)[0]:
                launch.kill()
            try:
                os.waitid(os.P_PIDFD, launch.child.pidfd, os.WEXITED)
                reaped = True
            except ChildProcessError:
                reaped = native.has_exited(launch.child)
            except OSError:
                reaped = launch.kill()
        if self.disk is not None:
            self.disk.finish()  # its fds keep the sandbox's tmpfs alive
        for fd in list(self.adopted):
            os.close(fd)
        self.adopted.clear()
        stats = None
        if launch is not None:
            try:
                stats = launch.close(reaped)
            except StockadeError as e:
                sys.stderr.write(f"stockade: {e.one_line()}\n")
        for rec in list(self.execs.values()):
            self._exec_ended(rec, signal.SIGKILL, 0)
        self.execs.clear()
        if self.live_snapshots and self.sess is not None:  # the overlay is unmounted; the lock still ours
            from .snapshot import deletions_after

            try:
                deletions_after(self.sess, self.live_snapshots)
            except OSError as e:
                sys.stderr.write(f"stockade: sandbox {self.sess.id}: entries deleted after a snapshot may show "
                                 f"again (a whiteout could not be made: {e})\n")
        if self.hold_cm is not None:
            self.hold_cm.__exit__(None, None, None)
            self.hold_cm = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.dir is not None:
            for f in (registry.SOCK, registry.WARM):
                try:
                    (self.dir / f).unlink()
                except FileNotFoundError:
                    pass
        if self.status != "failed":
            self.status = "stopped"
        self._record_end(stats)
        self._write_record(stopped_at=_utc(time.time()), reason=self.stopping)
        for s in self.stop_waiters:
            self._reply(s, {"ok": True, "status": self.status, "reason": self.stopping})
            s.close()
        for c in list(self.conns.values()):
            c.sock.close()
        self.conns.clear()
        if self.reaper_w >= 0:
            os.write(self.reaper_w, b"x")  # done: nothing for the reaper to do
            os.close(self.reaper_w)
            self.reaper_w = -1

    def _record_end(self, stats: Any) -> None:
        from ..audit import AuditLog

        rec, sess = self.record, self.sess
        if rec is None or sess is None:
            return
        ended = time.time()
        rec.data.update({"status": "done", "ended": _utc(ended), "duration": round(ended - rec.started, 4),
                         "outcome": f"{self.status}: {self.stopping}", "outcome_kind": self.status,
                         "execs": self.exec_count, "exit_status": 0})
        if stats is not None:
            rec.data.update({"peak_memory": stats.peak_memory, "cpu_time": stats.cpu_time})
        try:
            store.write_json_new(rec.run_dir + "/run.json", rec.data)
            AuditLog(sess).outcome(rec.run_no, self.status, outcome=f"sandbox {self.status}: {self.stopping}",
                                   exit_status=0, execs=self.exec_count)
        except (OSError, StockadeError):
            pass

    def _abort(self) -> None:
        """start failed: whatever began is taken down, the record says why."""
        if self.serve is not None:
            self.serve.close()
            self.serve = None
        if self.launch is not None:
            reaped = self.launch.kill()
            try:
                self.launch.close(reaped)
            except StockadeError:
                pass
        if self.hold_cm is not None:
            self.hold_cm.__exit__(None, None, None)
            self.hold_cm = None
        if self.dir is not None:
            for f in (registry.SOCK, registry.RECORD, registry.WARM):
                if f in self.created:  # another holder's (a concurrent start of the name) stays
                    try:
                        (self.dir / f).unlink()
                    except FileNotFoundError:
                        pass
            try:
                self.dir.rmdir()  # only when empty
            except OSError:
                pass
        if self.reaper_w >= 0:
            os.write(self.reaper_w, b"x")
            os.close(self.reaper_w)
            self.reaper_w = -1


class _Rewatch(BaseException):
    """The loop's watches changed (a claim gave the sandbox an owner)."""


def _seconds(v: object) -> float | None:
    """A duration from a request: finite and >= 0, else None (the default)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


def _unix_socket(fd: int) -> bool:
    from ..core.request import socket_family

    return socket_family(fd) == socket.AF_UNIX


def _send_on(fd: int, body: dict[str, Any]) -> None:
    s = socket.socket(fileno=os.dup(fd))
    try:
        s.setblocking(False)
        proto.send_msg(s, body)
    except OSError:
        pass
    finally:
        s.close()


def _changes_summary(sess: store.Session) -> dict[str, Any] | None:
    """The session's change counts (what ``stockade status`` shows), or None if unreadable."""
    try:
        from ..changes.scan import scan

        counts = scan(sess).counts()
        return {"added": counts.added, "modified": counts.modified, "deleted": counts.deleted,
                "summary": counts.phrase()}
    except (StockadeError, OSError, AttributeError):
        return None


def _limits_json(prep: Prepared | None) -> dict[str, Any] | None:
    if prep is None:
        return None
    lim = prep.limits
    out: dict[str, Any] = {}
    for f in dataclasses.fields(lim):
        v = getattr(lim, f.name)
        if isinstance(v, int | float | str) or v is None:
            out[f.name] = v
    out["exec_timeout"] = prep.timeout
    return out


def reap_after(holder_pid: int, d: Path | None) -> None:
    """The holder died without taking the sandbox down (SIGKILL): its init died with it
    (the launcher ends a run whose requester is gone; a cold start's init has a death
    signal), and the PID namespace with it. Left for us: the run's cgroups, named after
    the holder's pid (removed as soon as their tasks are gone: the holder's end closed our
    pipe, so it has exited, reaped or not), the socket, the record."""
    from ..cgroups import detect
    from ..cgroups.fs import CgroupFS, owner_tag, remove_tree

    try:
        mgr = detect.detect()
        fs = CgroupFS()
        tag = owner_tag()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = [p for p in _run_cgroups(mgr)
                    if f"-{holder_pid}-" in os.path.basename(p) and os.path.basename(p).endswith(f"-{tag}")]
            if not left:
                break
            for p in left:
                try:
                    remove_tree(fs, p)
                except (OSError, StockadeError):
                    pass  # tasks still draining: again shortly
            time.sleep(0.05)
    except (OSError, StockadeError):
        pass
    if d is None:
        return
    try:
        with open(d / registry.RECORD, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {"holder_pid": holder_pid}
    if data.get("holder_pid") != holder_pid:
        return  # a new holder of this name started meanwhile: its socket and record are its own
    for name in (registry.SOCK, registry.WARM):
        try:
            (d / name).unlink()
        except OSError:
            pass
    try:
        if data.get("status") in ("running", "starting", "stopping", "warm"):
            data["status"] = "failed"
            data["reason"] = "its holder process was killed"
            data["stopped_at"] = _utc(time.time())
            registry.write(d, data)
    except (OSError, ValueError):
        pass


def _run_cgroups(mgr: Any) -> list[str]:
    from ..cgroups.sweep import run_parents

    out = []
    for parent in run_parents(mgr):
        try:
            out += [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith("stockade-")]
        except OSError:
            pass
    return out


def main() -> int:
    """``python -m stockade.live.holder READY_FD``: the StartSpec pickled on stdin."""
    ready_fd = int(sys.argv[1])
    spec = pickle.load(sys.stdin.buffer)
    if not isinstance(spec, StartSpec):
        return 2
    if spec.detached and os.fork() > 0:
        # detached: our starter reaps this process at once; the holder is its orphan
        # (no zombie in a long-lived starter), in a session of its own
        os._exit(0)
    if spec.detached:
        os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # every client, adopted stream and exec in flight holds fds here
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    from ..launch import launcher

    launcher.SHARED = os.environ.get("STOCKADE_LAUNCHER", "1") != "private"  # as the CLI's: one per user, reused
    h = Holder(spec, ready_fd)
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    h.wake_r = wake_r

    def on_term(_sig: int, _frame: object) -> None:
        h.term_requested = True  # the loop stops the sandbox at its next turn (never mid-step)

    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, on_term)
    try:
        h.start()
    except StockadeError as e:
        h._say_ready({"ok": False, "error": e.one_line(), "status": e.exit_status})
        return e.exit_status
    except Exception as e:  # a start that fails says why, never hangs its starter
        h._say_ready({"ok": False, "error": f"{type(e).__name__}: {e}", "status": 1})
        raise
    try:
        while True:
            try:
                h.loop()
                break
            except _Rewatch:
                continue
    finally:
        h.finish()
    return 0



if __name__ == "__main__":
    sys.exit(main())
