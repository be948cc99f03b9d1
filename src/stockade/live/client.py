"""The client side of a living sandbox: exec a command into it (``stockade exec`` and
``Sandbox.exec`` alike), a ``Popen``-like handle, and the holder's other requests.

An exec's streams are made by the core's ``Launch`` (pipes the session keeps a copy
of, input=, a sealed copy of a stdin file, a pty of the sandbox's devpts) and moved
by the core's ``Supervisor``, exactly as for a run; only the command's start differs:
init forks it inside the running sandbox. Its reports come on the exec's own socket;
a signal goes back the same way, and closing the socket (this process killed) ends
that command and nothing else.
"""

from __future__ import annotations

import math
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, ClassVar

from ..core.launch import Launch
from ..core.request import DEVNULL, PIPE, STDOUT, RunIO, argv_of
from ..core.result import RunResult
from ..core.supervise import Forwarding, Supervisor
from ..errors import StockadeError, UsageError
from ..launch.lower import RunChild
from ..linux import native
from . import proto, registry


class LiveError(StockadeError):
    """The living sandbox cannot do what was asked (gone, stopping, refused)."""

    exit_status = 1


def _error(ack: Mapping[str, Any]) -> StockadeError:
    msg = str(ack.get("error") or "the sandbox's holder refused the request")
    return UsageError(msg) if ack.get("status") == 2 else LiveError(msg)


@dataclass
class ExecChild(RunChild):
    """An exec's command as the supervisor sees it: reports (and its end) on the
    exec socket, no pidfd (it is not our child)."""

    @property
    def exit_fd(self) -> int:
        return -1

    def signal(self, sig: int) -> None:
        if self.report_fd >= 0:
            try:
                os.write(self.report_fd, proto.SIGNAL.pack(sig))
            except OSError:
                pass


class ExecSupervisor(Supervisor):
    """The core's supervisor for one exec: done when init closes the exec socket
    (after its exit report); a timeout or Ctrl-C signals the command's process
    group through that socket, never the whole sandbox."""

    DRAIN_AFTER_END = 0.1  # then what is still open belongs to what the command left running

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.started_pid = 0
        self.ended: set[int] = set()

    def _ready_report(self, fd: int) -> None:
        try:
            super()._ready_report(fd)
        except ConnectionResetError:
            return  # init closed with a signal of ours unread: its reports are still there, read again
        if not self.report_open:
            self.init_done = True  # the exec socket's end: the command is over (or init is gone)

    def _ready_out(self, fd: int) -> None:
        super()._ready_out(fd)
        if fd not in self.sel._data:
            self.ended.add(fd)

    def _signal(self, sig: int) -> None:
        if not self.init_done:
            child = self.child
            if isinstance(child, ExecChild):
                child.signal(sig)

    def _kill(self) -> None:
        self._signal(signal.SIGKILL)

    # the loop dispatches through this table, not by attribute: ours replace two entries
    _HANDLERS: ClassVar[dict[str, Callable[[Supervisor, int], None]]] = {
        **Supervisor._HANDLERS,
        "report": lambda self, fd: ExecSupervisor._ready_report(self, fd),  # type: ignore[arg-type]
        "out": lambda self, fd: ExecSupervisor._ready_out(self, fd),  # type: ignore[arg-type]
    }

    def still_open(self) -> list[tuple[int, str]]:
        """Output streams nobody ended (held by what the command left running)."""
        out = []
        for fd, name in ((self.out_r, "stdout"), (self.err_r, "stderr")):
            if fd >= 0 and fd not in self.ended and name not in self.reader_gone:
                out.append((fd, name))
        return out


def _recv_ack(sock: socket.socket, timeout: float = 60.0) -> dict[str, Any]:
    r, _, _ = select.select([sock], [], [], timeout)
    if not r:
        raise LiveError("the sandbox's holder did not answer within 60 s")
    msg = proto.recv_msg(sock)
    if msg is None:
        raise LiveError("the sandbox's holder closed the exec without an answer (is it stopping?)")
    msg.close_fds()
    return dict(msg.body)


class Channel:
    """A connection to one living sandbox's holder. Execs share it (one message each,
    thread-safe); every other request has a connection of its own."""

    def __init__(self, lv: registry.Living) -> None:
        self.lv = lv
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def id(self) -> str:
        return self.lv.id

    def _conn(self) -> socket.socket:
        with self._lock:
            if self._sock is None:
                self._sock = registry.connect(self.lv)
            return self._sock

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def request(self, op: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """A request other than exec, answered on its own connection."""
        s = registry.connect(self.lv)
        try:
            proto.send_msg(s, {"op": op, **fields})
            r, _, _ = select.select([s], [], [], timeout)
            if not r:
                raise LiveError(f"the sandbox's holder did not answer {op!r} within {timeout:g} s")
            msg = proto.recv_msg(s)
        finally:
            s.close()
        if msg is None:
            raise LiveError(f"the sandbox's holder ended before it answered {op!r}")
        if not msg.body.get("ok"):
            raise _error(msg.body)
        return dict(msg.body)

    def send_exec(self, body: dict[str, Any], fds: list[int]) -> None:
        try:
            proto.send_msg(self._conn(), body, fds)
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError):
            self.close()
            raise LiveError(f"sandbox {self.id!r} is not running any more (its holder is gone); "
                            f"its changes stay for review (`stockade diff {self.id}`)") from None

    # ------------------------------------------------------------------ exec

    def exec(self, args: Sequence[str] | str, *, io: RunIO, env: Mapping[str, str] | None = None,
             cwd: str | os.PathLike[str] | None = None, timeout: float | None = None, shell: bool = False,
             pass_fds: Sequence[int] = (), here: str | None = None, env_replace: bool = False) -> RunResult:
        """Run one command in the sandbox, ``subprocess.run``-style. ``env_replace``: ``env``
        is the whole environment (already filtered by the sandbox's policy), not additions.
        ``io.on_start`` gets the exec's supervisor (its ``cancel`` signals the command's
        process group, never the sandbox)."""
        io.checked()
        argv = argv_of(args, shell)
        if not argv:
            raise UsageError("exec: no command given")
        body, sources = _exec_body(argv, env, cwd, timeout, io.pty, pass_fds, here)
        if env_replace:
            body["env_replace"] = True
        launch = Launch(io)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sup: ExecSupervisor | None = None
        try:
            stdio = [launch.console[1]] if io.pty else list(launch.child_stdio)
            try:
                self.send_exec(body, [theirs.fileno(), *stdio, *sources])
            finally:
                theirs.close()
            ack = _recv_ack(mine)
            if not ack.get("ok"):
                raise _error(ack)
            launch.child = ExecChild(0, -1, mine.detach(), -1, [])
            launch.handed_over()
            sup = launch.supervisor(str(ack["run_dir"]), ack.get("timeout"), make=ExecSupervisor)  # type: ignore[assignment]
            assert isinstance(sup, ExecSupervisor)
            child = launch.child
            assert isinstance(child, ExecChild)
            if io.on_start is not None:
                io.on_start(sup)
            if io.forward_signals:
                with Forwarding(child.signal, winch_to=sup.out_r if io.pty else None, on_term=sup.terminate):
                    sup.loop()
            else:
                sup.loop()
        except BaseException:
            if launch.child is not None and isinstance(launch.child, ExecChild):
                launch.child.signal(signal.SIGKILL)
            raise
        finally:
            mine.close()
            if sup is not None:
                sup.close_logs()
                self._adopt(sup, ack)
            launch.close(True)
        return _result(argv, sup, ack, io, timeout)

    def _adopt(self, sup: ExecSupervisor, ack: Mapping[str, Any]) -> None:
        """What the command left running still holds its output: the holder drains it
        into the exec's log from here on (closing it would give it SIGPIPE)."""
        left = sup.still_open()
        if not left:
            return
        try:
            self.send_exec({"op": "adopt", "run_dir": ack.get("run_dir"), "streams": [n for _fd, n in left]},
                           [fd for fd, _n in left])
        except (StockadeError, OSError):
            pass

    def popen(self, args: Sequence[str] | str, **kw: Any) -> LivePopen:
        return LivePopen(self, args, **kw)


def _exec_body(argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | os.PathLike[str] | None,
               timeout: float | None, pty: bool, pass_fds: Sequence[int],
               here: str | None) -> tuple[dict[str, Any], list[int]]:
    """The request, and the fds of this process that are the caller's ``pass_fds`` (a
    CLI server's supervisor holds its client's fds under other numbers: never our own
    fd of that number, ``callerfds``)."""
    from ..callerfds import source

    sources = []
    for fd in pass_fds:
        if not isinstance(fd, int) or fd < 3:
            raise UsageError(f"pass_fds: {fd!r} is not a descriptor number >= 3")
        src = source(fd)
        if src is None:
            raise UsageError(f"--pass-fd {fd}: not an open file descriptor of the caller")
        sources.append(src)
    if len(set(pass_fds)) != len(pass_fds):
        raise UsageError("pass_fds: a descriptor is named twice")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not math.isfinite(timeout) or timeout <= 0):
        raise UsageError(f"timeout {timeout!r}: expected a number of seconds > 0")
    body = {"op": "exec", "argv": list(argv), "env": dict(env or {}),
            "cwd": None if cwd is None else os.fspath(cwd), "here": here, "timeout": timeout, "pty": pty,
            "targets": list(pass_fds)}
    return body, sources


def _disk_hit(ack: Mapping[str, Any], rc: int) -> str | None:
    """The holder's disk watchdog killed this exec (it records what hit, and when)."""
    if rc != -9 and rc != 128 + 9:
        return None
    from . import registry

    lv = registry.read(str(ack.get("session") or ""))
    if lv is None:
        return None
    why, at = lv.data.get("disk_hit"), lv.data.get("disk_hit_at")
    started = ack.get("started_at")
    if not isinstance(why, str) or not isinstance(at, int | float):
        return None
    if isinstance(started, int | float) and at < started:
        return None
    return why


def _result(argv: Sequence[str], sup: ExecSupervisor | None, ack: Mapping[str, Any], io: RunIO,
            timeout: float | None) -> RunResult:
    from ..cgroups import base as cgbase

    assert sup is not None
    if sup.error is not None:
        raise native.spawn_error(sup.error.step, sup.error.err, sup.error.path or None)
    rc = sup.returncode
    o = cgbase.classify(rc, timed_out=sup.timed_out, disk_hit=_disk_hit(ack, rc))
    out, err = io.decoded(bytes(sup.out_buf) if sup.capture_out else None,
                          bytes(sup.err_buf) if sup.capture_err else None)
    res = RunResult(list(argv), rc, out, err, session=str(ack.get("session") or ""), run=int(ack.get("run") or 0),
                    outcome=o.summary(), outcome_kind=o.kind, exec_failed=sup.exec_failed)
    if sup.timed_out and timeout is not None and not io.forward_signals:
        import subprocess

        exc = subprocess.TimeoutExpired(list(argv), timeout, out, err)
        exc.result = res  # type: ignore[attr-defined]
        raise exc
    if io.check and rc != 0:
        import subprocess

        raise subprocess.CalledProcessError(rc, list(argv), out, err)
    return res


# --------------------------------------------------------------------------- Popen


class LivePopen:
    """``subprocess.Popen``'s interface for a command in a living sandbox: ``stdin``,
    ``stdout``, ``stderr`` streams (with PIPE), ``pid`` (inside the sandbox), ``poll``,
    ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``, ``returncode``.
    Its streams are the caller's own: the session keeps no copy of them (run.json and
    the audit log record the command and its end)."""

    def __init__(self, chan: Channel, args: Sequence[str] | str, *, stdin: Any = None, stdout: Any = None,
                 stderr: Any = None, text: bool = False, encoding: str | None = None, errors: str | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 pass_fds: Sequence[int] = (), shell: bool = False, bufsize: int = -1,
                 timeout: float | None = None) -> None:
        self.args = args
        self.returncode: int | None = None
        self.pid = 0
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self.session = ""
        self.run = 0
        self._text = bool(text or encoding or errors)
        self._enc, self._errs = encoding, errors
        argv = argv_of(args, shell)
        if not argv:
            raise UsageError("popen: no command given")
        body, sources = _exec_body(argv, env, cwd, timeout, False, pass_fds, None)
        ours: list[int] = []  # the child's ends, closed once sent
        theirs_fds: list[int] = []
        mine_ends: dict[str, int] = {}

        def child_end(spec: Any, default: int, name: str, write: bool) -> int:
            if spec is None:
                return default
            if spec == DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                ours.append(fd)
                return fd
            if spec == PIPE:
                r, w = os.pipe2(os.O_CLOEXEC)
                mine_ends[name] = r if not write else w
                fd = w if not write else r
                ours.append(fd)
                return fd
            if isinstance(spec, int):
                return spec
            return int(spec.fileno())

        try:
            in_fd = child_end(stdin, 0, "stdin", True)
            out_fd = child_end(stdout, 1, "stdout", False)
            err_fd = out_fd if stderr == STDOUT else child_end(stderr, 2, "stderr", False)
            theirs_fds = [in_fd, out_fd, err_fd]
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                chan.send_exec(body, [theirs.fileno(), *theirs_fds, *sources])
            finally:
                theirs.close()
            ack = _recv_ack(mine)
            if not ack.get("ok"):
                mine.close()
                raise _error(ack)
        except BaseException:
            for fd in (*ours, *mine_ends.values()):
                os.close(fd)
            raise
        for fd in ours:
            os.close(fd)
        self._sock = mine
        self.session, self.run = str(ack.get("session") or ""), int(ack.get("run") or 0)
        self._deadline = None if ack.get("timeout") is None else time.monotonic() + float(ack["timeout"])
        self._lock = threading.Lock()
        self._status: int | None = None
        for name, fd in mine_ends.items():
            mode = "wb" if name == "stdin" else "rb"
            f: IO[Any] = open(fd, mode, buffering=bufsize)  # noqa: SIM115 - the caller's stream, closed by it
            if self._text:
                import io as _io

                f = _io.TextIOWrapper(f, encoding=encoding or "utf-8", errors=errors or "strict",  # type: ignore[arg-type]
                                      write_through=name == "stdin", line_buffering=name == "stdin")
            setattr(self, name, f)
        self._read_reports(block=False)

    def _read_reports(self, block: bool, timeout: float | None = None) -> bool:
        """Take what init reported. True once the command has ended."""
        with self._lock:
            if self.returncode is not None:
                return True
            end = None if timeout is None else time.monotonic() + timeout
            while True:
                wait = 0.0 if not block else (None if end is None else max(0.0, end - time.monotonic()))
                if self._deadline is not None and block:
                    left = max(0.0, self._deadline - time.monotonic())
                    wait = left if wait is None else min(wait, left)
                r, _, _ = select.select([self._sock], [], [], wait)
                if not r:
                    if self._deadline is not None and time.monotonic() >= self._deadline:
                        self._deadline = None
                        self._signal(signal.SIGKILL)  # its timeout: the policy's cap
                        continue
                    return False
                try:
                    data = self._sock.recv(4096)
                except ConnectionResetError:
                    continue  # init closed with a signal of ours unread: its reports follow
                if not data:
                    st = self._status
                    self.returncode = os.waitstatus_to_exitcode(st) if st is not None else -signal.SIGKILL
                    self._sock.close()
                    return True
                reps, _rest = native.parse_reports(data)
                for rep in reps:
                    if rep.kind == native.REP_STARTED:
                        self.pid = rep.value
                    elif rep.kind == native.REP_EXIT:
                        self._status = rep.value
                    elif rep.kind == native.REP_ERROR:
                        self._status = 125 << 8
                    elif rep.kind == native.REP_EXEC_FAILED:
                        self._status = (127 if rep.err in (2, 20) else 126) << 8
                if not block and not r:
                    return False

    def poll(self) -> int | None:
        self._read_reports(block=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_reports(block=True, timeout=timeout):
            import subprocess

            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def _signal(self, sig: int) -> None:
        try:
            self._sock.send(proto.SIGNAL.pack(sig))
        except OSError:
            pass

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: bytes | str | None = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input``, read stdout and stderr to their ends, wait (subprocess's rules)."""
        end = None if timeout is None else time.monotonic() + timeout
        pending = b""
        if input is not None:
            pending = input.encode(self._enc or "utf-8", self._errs or "strict") if isinstance(input, str) else input
        bufs: dict[int, bytearray] = {}
        readers: dict[int, IO[Any]] = {}
        for f in (self.stdout, self.stderr):
            if f is not None:
                raw = f.buffer if hasattr(f, "buffer") else f
                fd = raw.fileno()
                bufs[fd] = bytearray()
                readers[fd] = f
        w_fd = -1
        if self.stdin is not None:
            try:
                self.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass
            w_fd = self.stdin.fileno()
            os.set_blocking(w_fd, False)  # select says "room for PIPE_BUF", not for all of it
            if not pending:
                self.stdin.close()
                w_fd = -1
        while (bufs and any(fd not in (-1,) for fd in bufs)) or w_fd >= 0:
            rl = [fd for fd in bufs if fd in readers]
            if not rl and w_fd < 0:
                break
            wait = None if end is None else max(0.0, end - time.monotonic())
            r, w, _ = select.select(rl, [w_fd] if w_fd >= 0 else [], [], wait)
            if not r and not w:
                import subprocess

                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            if w:
                try:
                    n = os.write(w_fd, pending[:65536])
                    pending = pending[n:]
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    pending = b""
                if not pending:
                    assert self.stdin is not None
                    self.stdin.close()
                    w_fd = -1
            for fd in r:
                data = os.read(fd, 65536)
                if data:
                    bufs[fd].extend(data)
                else:
                    readers.pop(fd)
            if not readers and w_fd < 0:
                break
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        outs: list[Any] = []
        for f in (self.stdout, self.stderr):
            if f is None:
                outs.append(None)
                continue
            raw = f.buffer if hasattr(f, "buffer") else f
            data = bytes(bufs.get(raw.fileno(), b""))
            f.close()
            outs.append(data.decode(self._enc or "utf-8", self._errs or "strict") if self._text else data)
        return outs[0], outs[1]

    def __enter__(self) -> LivePopen:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdout, self.stderr, self.stdin):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self.wait()
