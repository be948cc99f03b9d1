"""Supervise one run: move its bytes, read its reports, enforce the timeout, wait for init.

Runs in the calling thread (no helper threads): it tees the sandbox's stdout/stderr
to the caller and the session's logs, feeds stdin (input=, a large stdin file, a
pty's terminal input), enforces the timeout and forwards signals. Safe to use from
many threads at once (each run has its own).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, ClassVar, Protocol

from ..errors import UsageError
from ..linux import native
from ..session import store

if TYPE_CHECKING:
    from ..cgroups.base import RunCgroup
    from .diskwatch import DiskWatch


class RecordFeed(Protocol):
    """Records that come during the run (observe mode's): ``pump`` takes and classifies
    them (and says whether there were any), on the supervisor's timer while the sandbox
    lives."""

    def pump(self) -> bool: ...


# On a timer of the supervisor's own rather than woken by the records' thread: a wake-up
# from that thread comes on the command's CPU, right after an answer the command waits
# to run on. Every PUMP_EVERY seconds while records come; a quiet command's timer slows
# down to PUMP_IDLE (a build waiting on the network wakes its supervisor seldom).
PUMP_EVERY = 0.02
PUMP_IDLE = 1.0


_CHUNK = 1 << 16

_READ = select.EPOLLIN
_WRITE = select.EPOLLOUT


class Poller:
    """The part of ``selectors.EpollSelector`` the supervisor uses, without its per-call
    bookkeeping: ``select`` gives (fd, data) pairs."""

    __slots__ = ("_data", "_ep")

    def __init__(self) -> None:
        self._ep = select.epoll()
        self._data: dict[int, str] = {}

    def register(self, fd: int, events: int, data: str) -> None:
        self._ep.register(fd, events)
        self._data[fd] = data

    def unregister(self, fd: int) -> None:
        del self._data[fd]
        self._ep.unregister(fd)

    def select(self, timeout: float | None) -> list[tuple[int, str]]:
        data = self._data
        while True:
            try:
                ready = self._ep.poll(-1 if timeout is None else timeout, max(len(data), 1))
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
        return [(fd, data[fd]) for fd, _ev in ready if fd in data]

    def close(self) -> None:
        self._ep.close()


GRACE = 2.0  # seconds between SIGTERM and SIGKILL (a timeout, or SIGTERM to the CLI)
EOF_QUIET = 0.3  # seconds of a quiet terminal before it is sent ^D (its input ended)
LOG_MAX = 64 << 20  # bytes of each stream a run's log keeps, unless STOCKADE_LOG_MAX says otherwise


def log_max() -> int:
    """Read when a run starts, never at import: a CLI server imports this module once
    and serves many clients, each with its own environment (an import-time value
    was the server's, so a served run ignored the client's STOCKADE_LOG_MAX)."""
    v = os.environ.get("STOCKADE_LOG_MAX", "")
    if not v:
        return LOG_MAX
    try:
        n = int(v)
    except ValueError:
        raise UsageError(f"STOCKADE_LOG_MAX={v!r}: not a number of bytes; unset it or give one, e.g. 1048576") from None
    if n < 0:
        raise UsageError(f"STOCKADE_LOG_MAX={v!r}: negative; give a number of bytes (0 keeps no log)")
    return n
RELAY_MAX = 1 << 20  # bytes of terminal input buffered before we stop reading it


class Supervisor:
    """Moves bytes, reads the child's reports, waits for init, enforces the timeout.

    Single-threaded and non-blocking: every deadline is checked on every turn, so a
    command that never stops writing cannot delay its own timeout, and input that the
    command does not read is buffered (bounded) instead of blocking the output.
    """

    # once init is reaped, output still buffered in the pipes is read for this long
    # (a living sandbox's exec: its command ended, what still holds the pipes lives on)
    DRAIN_AFTER_END = 2.0

    def __init__(
        self,
        child: native.Child,
        out_r: int,
        err_r: int,
        stdin_w: int,
        feed: bytes | None,
        dest_out: int | None,
        dest_err: int | None,
        run_dir: str,
        capture_out: bool,
        capture_err: bool,
        timeout: float | None,
        cg: RunCgroup | None,
        relay_in: int = -1,
        relay_pty: bool = True,
    ) -> None:
        self.child = child
        self.relay_in = relay_in
        # relay_in feeds a pty (terminal input: its end is ^D) or a pipe (a caller's
        # large stdin file: its end closes the pipe)
        self.relay_pty = relay_pty
        self.out_r, self.err_r = out_r, err_r
        self.stdin_w = stdin_w
        self.pending = bytearray(feed or b"")
        self.input_eof = feed is not None  # input= is all there is; a relay ends at EOF
        self.dest = {out_r: dest_out, err_r: dest_err}
        # the session's copy of each stream, made when the stream first has output
        # (a silent run creates no log file: inodes are slow on some disks)
        self.log = {out_r: -1, err_r: -1}
        self.log_path = {out_r: run_dir + "/stdout.log", err_r: run_dir + "/stderr.log"}
        self.logged = {out_r: 0, err_r: 0}
        self.dropped = {out_r: 0, err_r: 0}
        self.log_max = log_max()
        self.capture = {out_r: capture_out, err_r: capture_err}
        self.capture_out, self.capture_err = capture_out, capture_err
        self.out_buf = bytearray()
        self.err_buf = bytearray()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.cg = cg
        self.timed_out = False
        self.error: native.Report | None = None  # the sandbox failed to start: which step, why
        self.exec_failed: native.Report | None = None  # the command could not be executed
        self.exit_status: int | None = None
        self.init_status: int | None = None
        self.init_done = False
        self.returncode = 0
        self._rbuf = b""
        self._kill_at: float | None = None
        self.log_disk_full = False  # a log write found the state dir's disk full
        self.reader_gone: list[str] = []  # streams whose reader went away (EPIPE): "stdout", "stderr"
        self._out_at = 0.0  # when the sandbox last wrote output (monotonic)
        self._veof_at: float | None = None  # when its terminal was last sent ^D
        # a signal handler's wake-up (``terminate``): the loop may be waiting with no deadline
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # the loop's state
        self.sel = Poller()
        self.open_streams = 0  # output streams not at their end yet
        self.report_open = True  # the child's report pipe
        self.relay_on = False  # relay_in is registered
        self.relay_direct = False  # relay_in cannot be polled: read whenever there is room
        self.sink_on = False  # stdin_w is registered
        self.drain_until: float | None = None  # init reaped: output is read until then
        self._cancel_lock = threading.Lock()  # cancel (another thread) vs close_logs (the fds' end)
        self._closed = False
        # the disk watchdog (core/diskwatch.py), set by the run path; what it ended the
        # run for, and a tmpfs the command filled (ENOSPC) without being ended
        self.disk: DiskWatch | None = None
        self.disk_hit: str | None = None
        self.disk_full: str | None = None
        # observe mode's records, classified here as they come (core/observe.py)
        self.observe: RecordFeed | None = None
        self._pump_at: float | None = None
        self._pump_every = PUMP_EVERY

    def cancel(self) -> None:
        """From another thread (``RunIO.on_start`` handed this supervisor out: `stockade
        mcp`'s cancelled request, its client gone): SIGTERM to the command now, SIGKILL
        after the grace period, as a timeout does. A no-op once the run is over."""
        with self._cancel_lock:
            if self._closed or self.init_done:
                return
            self._signal(signal.SIGTERM)
            self.terminate()

    def close_logs(self) -> None:
        with self._cancel_lock:  # never a cancel's write into a closed (maybe reused) fd
            self._closed = True
            self._close_logs()

    def _close_logs(self) -> None:
        for k, fd in self.log.items():
            if fd >= 0:
                os.close(fd)
                self.log[k] = -1
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self.sel.close()  # (the loop closes it too; a run that failed before it did not)

    def terminate(self) -> None:
        """SIGTERM reached the CLI (it was forwarded to the sandbox): whatever the
        command does with it, the sandbox is killed once the grace period is over."""
        if self._kill_at is None:
            self._kill_at = time.monotonic() + GRACE
        try:
            os.write(self._wake_w, b"t")
        except OSError:
            pass

    @property
    def log_truncated(self) -> dict[str, int]:
        names = {self.out_r: "stdout", self.err_r: "stderr"}
        return {names[fd]: n for fd, n in self.dropped.items() if n}

    def _write_all(self, fd: int, data: bytes) -> bool:
        """To the caller's own stdout/stderr (or a file it gave us): blocking is its choice.
        False: its reader is gone (EPIPE)."""
        mv = memoryview(data)
        while mv:
            try:
                n = os.write(fd, mv)
            except BrokenPipeError:
                return False
            except InterruptedError:
                continue
            except BlockingIOError:
                select.select([], [fd], [])
                continue
            mv = mv[n:]
        return True

    def _on_output(self, fd: int, data: bytes) -> bool:
        """Log, capture or pass on one chunk. False: the caller's reader of this stream
        is gone."""
        room = self.log_max - self.logged[fd]
        kept = 0
        if room > 0:
            try:
                if self.log[fd] < 0:
                    self.log[fd] = os.open(self.log_path[fd], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                kept = os.write(self.log[fd], data[:room])
                self.logged[fd] += kept
            except OSError as e:
                if e.errno not in store.NO_SPACE:
                    raise
                # the state dir's disk is full: the command's output still reaches the
                # caller; the kept log ends here, 64 KiB shorter, so the run's record
                # still fits, and the record says why
                if self.log[fd] >= 0:
                    cut = min(self.logged[fd], 65536)
                    os.ftruncate(self.log[fd], self.logged[fd] - cut)
                    self.dropped[fd] += cut
                self.logged[fd] = self.log_max
                self.log_disk_full = True
        if len(data) > kept:
            self.dropped[fd] += len(data) - kept
        if self.capture[fd]:
            (self.out_buf if fd == self.out_r else self.err_buf).extend(data)
        else:
            d = self.dest[fd]
            if d is not None:
                return self._write_all(d, data)
        return True

    def _reader_gone(self, fd: int) -> None:
        """What a shell pipeline does when a reader exits: the writer's next write gets
        SIGPIPE/EPIPE. Our read end of the command's pipe is closed (the number stays
        valid, now /dev/null: the caller closes it once more); with a pty, its master
        is closed whole and the sandbox's terminal hangs up."""
        self.reader_gone.append("stdout" if fd == self.out_r else "stderr")
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)
        if self.relay_in >= 0 and self.relay_pty and self.stdin_w >= 0:  # the pty master's other handle
            os.close(self.stdin_w)
            self.stdin_w = -1
            self.pending.clear()
            self.input_eof = True

    def loop(self) -> None:
        """Until init is reaped, its report pipe closed and the output drained."""
        self._watch()
        try:
            while self.open_streams or not self.init_done or self.report_open:
                now = time.monotonic()
                self._enforce_deadlines(now)
                self._arm_stdin()
                if self._relay_directly():
                    continue  # and the sink is registered on the next turn
                self._arm_relay()
                if self.init_done and self.drain_until is None:
                    # init is gone, so is every process of the sandbox: drain what is buffered
                    self.drain_until = now + self.DRAIN_AFTER_END
                if self.drain_until is not None and now >= self.drain_until:
                    break
                eof_at = self._eof_due()
                if eof_at is not None and now >= eof_at:
                    self._send_eof()
                    eof_at = None
                disk_at = self.disk.next_at if self.disk is not None and self.disk_hit is None and not self.init_done else None
                pump_at = self._pump_due(now)
                times = (None if self.timed_out else self.deadline, self._kill_at, self.drain_until, eof_at, disk_at,
                         pump_at)
                waits = [t - now for t in times if t is not None]
                for fd, what in self.sel.select(max(0.0, min(waits)) if waits else None):
                    self._HANDLERS[what](self, fd)
        except KeyboardInterrupt:
            self._signal(signal.SIGINT)
            raise
        finally:
            self.sel.close()
            if self.stdin_w >= 0:
                os.close(self.stdin_w)
                self.stdin_w = -1
            if self.disk is not None:
                self.disk_full = self.disk.finish()
        if self.exit_status is not None:
            self.returncode = os.waitstatus_to_exitcode(self.exit_status)
        elif self.init_status is not None:
            s = self.init_status
            self.returncode = s if s < 0 or s <= 128 or s >= 256 else -(s - 128)
        else:
            self.returncode = -signal.SIGKILL

    # ------------------------------------------------------------------ the loop's steps

    def _watch(self) -> None:
        """Register what the loop waits on: output, reports, init's end, wake-ups, input."""
        sel = self.sel
        for fd in (self.out_r, self.err_r):
            if fd >= 0:
                sel.register(fd, _READ, "out")
                self.open_streams += 1
        sel.register(self.child.report_fd, _READ, "report")
        if self.child.exit_fd >= 0:  # (a living sandbox's exec: its end is its report channel's)
            sel.register(self.child.exit_fd, _READ, "pidfd")
        sel.register(self._wake_r, _READ, "wake")
        if self.relay_in >= 0 and self.stdin_w >= 0:
            try:
                sel.register(self.relay_in, _READ, "relay")
                self.relay_on = True
            except PermissionError:
                # input epoll refuses (a regular file, /dev/null): read whenever there is room
                self.relay_direct = True
        if self.stdin_w >= 0:
            os.set_blocking(self.stdin_w, False)
            if not self.relay_on and not self.relay_direct and not self.pending:
                os.close(self.stdin_w)
                self.stdin_w = -1

    def _enforce_deadlines(self, now: float) -> None:
        if self.deadline is not None and not self.timed_out and now >= self.deadline:
            self._on_timeout()
        if self._kill_at is not None and now >= self._kill_at:
            self._kill()
            self._kill_at = None
        d = self.disk
        if d is not None and self.disk_hit is None and not self.init_done and now >= d.next_at:
            why = d.tick(now)
            if why is not None:
                # no grace: every moment more is more written; the change set so far stays
                self.disk_hit = why
                self._kill()

    def _arm_stdin(self) -> None:
        """The stdin sink is watched only while something waits to be written."""
        want_sink = self.stdin_w >= 0 and bool(self.pending)
        if want_sink != self.sink_on:
            if want_sink:
                self.sel.register(self.stdin_w, _WRITE, "stdin")
            else:
                self.sel.unregister(self.stdin_w)
            self.sink_on = want_sink
        if not self.sink_on and self.stdin_w >= 0 and self.input_eof and not self.relay_pty and self.relay_in >= 0:
            os.close(self.stdin_w)  # the relayed file is all written: the pipe's end is its end
            self.stdin_w = -1

    def _relay_directly(self) -> bool:
        """Input epoll cannot watch: one read when there is room. True: read, turn again."""
        if not self.relay_direct:
            return False
        if self.input_eof or self.stdin_w < 0:
            self.relay_direct = False
            return False
        if len(self.pending) < RELAY_MAX // 2:
            self._relay_read(self.relay_in)
            return True
        return False

    def _arm_relay(self) -> None:
        """Stop reading input while RELAY_MAX waits to be written; read again below half."""
        if self.relay_on and len(self.pending) >= RELAY_MAX:
            self.sel.unregister(self.relay_in)
            self.relay_on = False
        elif (not self.relay_on and not self.relay_direct and self.relay_in >= 0 and not self.input_eof
              and len(self.pending) < RELAY_MAX // 2 and self.stdin_w >= 0):
            self.sel.register(self.relay_in, _READ, "relay")
            self.relay_on = True

    # ------------------------------------------------------------------ one ready fd each

    def _ready_relay(self, fd: int) -> None:
        if not self._relay_read(fd):
            self.sel.unregister(fd)
            self.relay_on = False

    def _ready_wake(self, fd: int) -> None:
        try:
            os.read(fd, 64)
        except OSError:
            pass

    def _ready_stdin(self, fd: int) -> None:
        try:
            n = os.write(fd, self.pending[:_CHUNK])
        except BlockingIOError:
            return
        except OSError:  # EPIPE / EIO: nobody reads any more
            n = len(self.pending)
            self.input_eof = True
        del self.pending[:n]
        if not self.pending and self.input_eof and (self.relay_in < 0 or not self.relay_pty):
            self.sel.unregister(fd)
            self.sink_on = False
            os.close(fd)
            self.stdin_w = -1

    def _ready_out(self, fd: int) -> None:
        try:
            data = os.read(fd, _CHUNK)
        except (InterruptedError, BlockingIOError):  # the pty master shares O_NONBLOCK with the sink
            return
        except OSError:  # EIO: the pty's last user is gone
            data = b""
        if not data:
            self.sel.unregister(fd)
            self.open_streams -= 1
            return
        self._out_at = time.monotonic()
        if not self._on_output(fd, data):
            self.sel.unregister(fd)
            self.open_streams -= 1
            if self.sink_on and self.relay_in >= 0:
                self.sel.unregister(self.stdin_w)  # the pty master: closed with it
                self.sink_on = False
            self._reader_gone(fd)

    def _ready_report(self, fd: int) -> None:
        data = os.read(fd, 4096)
        if not data:
            self.sel.unregister(fd)
            self.report_open = False
            return
        reps, self._rbuf = native.parse_reports(self._rbuf + data)
        for r in reps:
            if r.kind == native.REP_ERROR:
                self.error = r
            elif r.kind == native.REP_EXEC_FAILED:
                self.exec_failed = r
            elif r.kind == native.REP_EXIT:
                self.exit_status = r.value
            elif r.kind == native.REP_STARTED and self.disk is not None and not self.init_done:
                self.disk.attach(self.child.pid, self.child.pidfd)  # its mounts are in place now

    def _ready_init(self, fd: int) -> None:
        self.sel.unregister(fd)
        self.init_status = self.child.reap()
        self.init_done = True

    def _pump_due(self, now: float) -> float | None:
        """Observe mode's records classified when their time comes; the next time."""
        if self.observe is None or self.init_done:
            return None  # (the run's end takes the rest: RunObserve.finish)
        if self._pump_at is None:
            self._pump_at = now + PUMP_EVERY
        elif now >= self._pump_at:
            took = self.observe.pump()
            self._pump_every = PUMP_EVERY if took else min(PUMP_IDLE, self._pump_every * 2)
            self._pump_at = now + self._pump_every
        return self._pump_at

    _HANDLERS: ClassVar[dict[str, Callable[[Supervisor, int], None]]] = {
        "relay": _ready_relay, "wake": _ready_wake, "stdin": _ready_stdin, "out": _ready_out,
        "report": _ready_report, "pidfd": _ready_init,
    }

    def _relay_read(self, fd: int) -> bool:
        """One read of the terminal input into ``pending``. False at its end: then the
        sandbox's terminal gets its end-of-file character (^D), as a terminal user
        would type it, so a shell reading it exits."""
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            self.pending.extend(data)
            return True
        self.input_eof = True
        return False

    def _eof_due(self) -> float | None:
        """With a pty, the end of the terminal input is told to the sandbox the way a
        user tells it: the terminal's EOF character (^D), once the sandbox's terminal
        went quiet (a shell prints its prompt, then reads; one sent earlier, before it
        reads, can be lost as it sets up its line editor), and again after each later
        output (until something reads it, like a closed stdin's reads keep ending)."""
        if self.relay_in < 0 or not self.relay_pty or self.stdin_w < 0 or not self.input_eof or self.pending:
            return None
        if self._veof_at is not None and self._out_at <= self._veof_at:
            return None  # nothing new since the last one
        return max(self._out_at, self._veof_at or 0.0) + EOF_QUIET

    def _send_eof(self) -> None:
        import termios

        try:
            veof = termios.tcgetattr(self.stdin_w)[6][termios.VEOF]
        except (OSError, termios.error):
            veof = b"\x04"
        try:
            os.write(self.stdin_w, veof if isinstance(veof, bytes) else bytes([veof]))
        except OSError:  # full (nobody reads: the next one after more output) or hung up
            pass
        self._veof_at = time.monotonic()

    def _signal(self, sig: int) -> None:
        # through the pidfd, and never once init is reaped: its pid may be reused
        if self.init_done:
            return
        try:
            signal.pidfd_send_signal(self.child.pidfd, sig)
        except (ProcessLookupError, OSError):
            pass

    def _on_timeout(self) -> None:
        self.timed_out = True
        self._signal(signal.SIGTERM)
        self._kill_at = time.monotonic() + GRACE

    def _kill(self) -> None:
        if self.cg is not None:
            try:
                self.cg.kill()
            except OSError:
                pass
        self._signal(signal.SIGKILL)


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)


class Forwarding:
    """CLI only (main thread): signals the supervisor receives go to the sandbox's init,
    which forwards them to the command's process group, like a shell's foreground job.
    With a pty, a window size change is copied to the pty instead (the kernel then
    signals the pty's foreground group)."""

    def __init__(self, pidfd: int | Callable[[int], None], winch_to: int | None = None,
                 on_term: Callable[[], None] | None = None) -> None:
        # init's pidfd, or how to signal the command (a living sandbox's exec)
        self.pidfd = pidfd
        self.winch_to = winch_to
        self.on_term = on_term  # SIGTERM: the sandbox ends after a grace period whatever the command does
        self.old: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def _handler(self, sig: int, _frame: FrameType | None) -> None:
        if sig == signal.SIGWINCH and self.winch_to is not None:
            copy_winsize(0, self.winch_to)
            return
        try:
            if callable(self.pidfd):
                self.pidfd(sig)
            else:
                signal.pidfd_send_signal(self.pidfd, sig)
        except OSError:  # init already gone (and reaped: the pidfd never aims elsewhere)
            pass
        if sig == signal.SIGTERM and self.on_term is not None:
            self.on_term()

    def __enter__(self) -> None:
        for s in _FORWARDED:
            self.old[s] = signal.signal(s, self._handler)

    def __exit__(self, *exc: object) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def copy_winsize(src: int, dst: int) -> None:
    import fcntl
    import termios

    try:
        ws = fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(dst, termios.TIOCSWINSZ, ws)
    except OSError:
        pass
