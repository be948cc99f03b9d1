"""Launch one run: its streams, its cgroups, the sandbox started and released.

The choice between a pre-spawned launcher and a cold start is linux/'s
(``launch.start.start``); this module gives it the plan, the child's stdio and the
cgroup placement, and takes it all down again when the run ends.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import UsageError
from ..launch import start as launch
from ..launch.lower import RunChild
from ..linux import native
from ..session import store
from .request import DEVNULL, PIPE, STDOUT, RunIO, Stream
from .supervise import Supervisor, copy_winsize

if TYPE_CHECKING:
    from ..callerfds import SandboxStdin
    from ..cgroups.base import CgroupStats, Limits, Manager, Placement, RunCgroup
    from ..net.run import NetRun, NetSummary
    from .observe import RunObserve
    from .prepare import Prepared


@runtime_checkable
class MakesAhead(Protocol):
    """A cgroup backend that makes the next run's cgroups while a sandbox starts, and
    removes an emptied run's later (cgroup v1: each costs an RCU grace period)."""

    def prepare_next(self, limits: Limits, *, pid_namespace: bool = False) -> None: ...

    def retire(self, run: RunCgroup) -> None: ...


def _target(spec: Stream, default_fd: int) -> int | None:
    """Where a stream the caller does not capture goes: an fd, or None (DEVNULL)."""
    if spec is None:
        return default_fd
    if spec == DEVNULL:
        return None
    if isinstance(spec, int):
        return spec
    return spec.fileno()


class Launch:
    """One sandbox from its start to its teardown. Made before anything starts, so
    whatever was started is taken down (``close``) whatever fails on the way."""

    def __init__(self, io: RunIO) -> None:
        self.io = io
        self.child: RunChild | None = None
        self.cg: RunCgroup | None = None
        self.place: Placement | None = None
        self.to_close: list[int] = []  # the child's ends, closed once it has them
        self.out_r = self.err_r = self.out_w = self.err_w = -1
        self.stdin_fd = 0  # the sandbox's stdin (a number of the caller's, or ours)
        self.stdin_w = -1  # what we write the sandbox's stdin through
        self.feed: bytes | None = None  # input=
        self.relay_in = -1  # what we read and write to stdin_w (a pty's terminal, a large stdin file)
        self.given_stdin: SandboxStdin | None = None
        self.stdin_caller = -1
        self.console = (-1, -1)  # pty: the socket the sandbox sends its pty master over
        self.manager: Manager | None = None
        self.pid_ns = False  # the sandbox has its own PID namespace: all of it ends with its init
        self.net: NetRun | None = None  # --net allow, forwarded ports: the run's proxy
        self.net_summary: NetSummary | None = None
        self.observe: RunObserve | None = None  # observe mode: the listener's thread
        self._stdin(io)
        self._stdout_stderr(io)

    def _stdin(self, io: RunIO) -> None:
        if io.input is not None:
            inp = io.input
            self.feed = inp.encode(io.encoding or "utf-8", io.errors or "strict") if isinstance(inp, str) else bytes(inp)
            r, self.stdin_w = os.pipe()
            self.stdin_fd = r
            self.to_close.append(r)
        elif io.stdin == DEVNULL:
            self.stdin_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            self.to_close.append(self.stdin_fd)
        elif io.stdin is not None:
            self.stdin_fd = io.stdin_fd()
        # a regular file as stdin: a copy or a pipe the sandbox can reopen (/dev/stdin),
        # never the host file (callerfds.reopenable_stdin); with a pty, stdin is relayed
        if self.feed is None and not io.pty:
            from ..callerfds import reopenable_stdin

            given = self.given_stdin = reopenable_stdin(self.stdin_fd)
            if given is not None:
                if given.sink >= 0:
                    self.relay_in, self.stdin_w = self.stdin_fd, given.sink
                if given.copy < 0:
                    self.to_close.append(given.fd)
                self.stdin_caller, self.stdin_fd = self.stdin_fd, given.fd

    def _stdout_stderr(self, io: RunIO) -> None:
        """Always through pipes (or a pty), so the session keeps a copy."""
        if io.pty:
            # The sandbox opens a pty in its own devpts and hands us the master: it only
            # ever sees that pty, never the user's terminal.
            import socket

            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.console = (a.detach(), b.detach())
            self.to_close.extend(self.console)
            self.relay_in = 0
            return
        self.out_r, self.out_w = os.pipe()
        if io.err == STDOUT:
            self.err_r, self.err_w = -1, self.out_w
        else:
            self.err_r, self.err_w = os.pipe()
        self.to_close.extend([self.out_w] + ([self.err_w] if self.err_w != self.out_w else []))

    def start(self, sess: store.Session, run_no: int, prep: Prepared, hold_fd: int, session_ahead: bool,
              serve_fd: int = -1) -> RunChild:
        """Make the run's cgroups, start the sandbox and release it. ``hold_fd``: the
        session's overlay lock (``Session.lock``). ``serve_fd``: a living sandbox's
        channel to its init (``stockade.live``): init serves execs instead of a command."""
        plan, mgr, limits = prep.plan, prep.cg_manager, prep.limits
        pid_ns = self.pid_ns = "pid" in plan.namespaces
        self.manager = mgr
        cg = self.cg = mgr.create(f"{sess.id}-{run_no}", limits, pid_namespace=pid_ns)
        place = self.place = cg.placement() if cg else None
        # v2: born in its cgroup; v1: init enters them itself first. A move by pid
        # (the fallback) is slow on v1: it overlaps the child's mount setup, and the
        # child waits for Stage.ATTACHED before exec. So it does while the proxy's
        # listeners are made in its network namespace.
        attach = place is not None and place.attach
        net_policy = prep.net
        hold = attach or net_policy is not None
        obs = None
        if prep.observe:
            if serve_fd >= 0:
                from .observe import LIVE_REFUSED

                raise UsageError(LIVE_REFUSED)
            from .observe import RunObserve

            obs = self.observe = RunObserve(prep, sess, run_no)
            self.to_close.append(obs.child_fd)
        child = self.child = launch.start(plan, (self.stdin_fd, self.out_w, self.err_w), place.clone_fd if place else None,
                                          pty=self.io.pty, console_sock=self.console[1], hold_before_exec=hold,
                                          hold_fd=hold_fd, join_fds=place.join_fds if place else (), serve_fd=serve_fd,
                                          observe_sock=obs.child_fd if obs else -1,
                                          observe_bpf=obs.bpf if obs else b"")
        if obs is not None:
            obs.start(child.pidfd, child.pid)
        if hold:
            try:
                if attach and cg is not None:
                    cg.attach(child.pid)
                if net_policy is not None:
                    from ..audit import AuditLog
                    from ..net.run import NetRun

                    self.net = NetRun(net_policy, sess.dir, AuditLog(sess), run_no)
                    self.net.start(child.pidfd, child.pid)
            except Exception:
                # a child that failed its setup is gone before we were done: its
                # report says why (the supervisor reads it)
                if not native.has_exited(child):
                    raise
            else:
                native.release(child, native.Stage.ATTACHED)
        if cg is not None and isinstance(mgr, MakesAhead):
            mgr.prepare_next(limits, pid_namespace=pid_ns)  # the sandbox is starting: meanwhile, the next run's cgroups
        if session_ahead:
            store.make_ahead()  # and the next new session's directories
        self.handed_over()
        return child

    def handed_over(self) -> None:
        """The sandbox (or an exec's command) has its ends of the streams: close ours of
        them, and with a pty take the master it sent."""
        if self.io.pty:
            self._take_console()
        for fd in self.to_close:
            os.close(fd)
        self.to_close = []

    def _take_console(self) -> None:
        """The pty master the sandbox sent: its output, and its terminal input's sink."""
        for fd in self.console:
            self.to_close.remove(fd)
        os.close(self.console[1])
        self.out_r = native.recv_console(self.console[0])
        os.close(self.console[0])
        if self.out_r >= 0:
            self.stdin_w = os.dup(self.out_r)
            if os.isatty(0):
                copy_winsize(0, self.out_r)

    @property
    def child_stdio(self) -> tuple[int, int, int]:
        """The fds the command gets as 0, 1, 2 (without a pty)."""
        return (self.stdin_fd, self.out_w, self.err_w)

    def supervisor(self, run_dir: str, timeout: float | None, make: type[Supervisor] = Supervisor) -> Supervisor:
        """The started sandbox's supervisor; it owns stdin_w from here on. ``make``: an
        exec's (``stockade.live``) supervises one command of a living sandbox."""
        assert self.child is not None
        io = self.io
        err = STDOUT if io.pty else io.err  # a terminal has one output
        capture_out, capture_err = io.out == PIPE, err == PIPE
        dest_out = None if capture_out else _target(io.out, 1)
        dest_err = None if capture_err else _target(io.out if err == STDOUT else err, 2)
        sup = make(self.child, self.out_r, self.err_r, self.stdin_w, self.feed, dest_out, dest_err, run_dir,
                   capture_out, capture_err, timeout, self.cg, self.relay_in, relay_pty=io.pty)
        self.stdin_w = -1
        return sup

    def kill(self) -> bool:
        """Something failed: end the sandbox now. True: its init is reaped."""
        if self.child is None:
            return False
        try:
            signal.pidfd_send_signal(self.child.pidfd, signal.SIGKILL)
            self.child.reap()
            return True
        except (OSError, ChildProcessError):
            return False

    def close(self, reaped: bool) -> CgroupStats | None:
        """Close our ends, give the caller's stdin file its offset back, and take the
        cgroups down. ``reaped``: init is reaped, and with its own PID namespace
        nothing of the sandbox is left. The cgroups' last statistics."""
        if self.net is not None:
            net, self.net = self.net, None
            self.net_summary = net.close()
        if self.observe is not None:
            # a start that failed before the handover still holds the sandbox's end of
            # the listener's socket, on which the loop waits: closed first, the loop sees
            # no listener will come (else it waited out stop's timeout, 5 s)
            fd = self.observe.child_fd
            if fd in self.to_close:
                self.to_close.remove(fd)
                os.close(fd)
            self.observe.stop()  # (it ended with the sandbox; a failed start's ends here)
        given = self.given_stdin
        if given is not None and given.copy >= 0:
            given.give_back_offset(self.stdin_caller)
            os.close(given.copy)
        for fd in (*self.to_close, self.out_r, self.err_r, self.stdin_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.to_close = []
        self.out_r = self.err_r = self.stdin_w = -1
        if self.child is not None:
            self.child.close()
        cg = self.cg
        if cg is None:
            return None
        stats = None
        gone = reaped and self.pid_ns  # its init took every task with it
        try:
            if not gone:
                cg.kill()
            stats = cg.stats()
        finally:
            mgr = self.manager
            if gone and stats is not None and isinstance(mgr, MakesAhead):
                mgr.retire(cg)  # empty: removed while the next run starts
            else:
                cg.remove()  # a task still there (EBUSY) is killed then
        return stats
