"""The CLI's served path: hand `stockade run` to the user's warm server.

Most of what a CLI run costs is the interpreter importing stockade. A server
(``stockade.fast.server``) keeps every module imported and forks a supervisor per run
that takes on this process's whole context (arguments, environment, working
directory, stdio, umask, rlimits, cgroup) and runs the same CLI code. This side
imports builtins only. Whenever the server cannot serve this process exactly as
it would run itself, it says so before anything runs and the CLI goes on
in-process: never a different sandbox, only a slower start.
"""

from __future__ import annotations

import os
import sys

MAGIC = b"SKS2"
MAX_FDS = 240  # the client's own fds sent along (SCM_RIGHTS carries at most 253); more: in-process
_FWD = (1, 2, 3, 10, 12, 15, 28)  # SIGHUP INT QUIT USR1 USR2 TERM WINCH: what the CLI forwards to the sandbox
_TSTP, _CONT, _STOP = 20, 18, 19


#: How long ``STOCKADE_SERVER=require`` waits for a server to come up (seconds).
REQUIRE_WAIT = 90


def interp_env(environb: dict[bytes, bytes] | None = None) -> list[bytes]:
    """The variables that shape the interpreter (imports, locale): a server only
    serves clients whose values are its own."""
    e = os.environb if environb is None else environb
    return sorted(k + b"=" + v for k, v in e.items() if k.startswith((b"PYTHON", b"LC_")) or k == b"LANG")


def package_dir() -> str:
    """The stockade package's directory (this module is in its ``fast`` subpackage)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def userns() -> bytes:
    """This process's user namespace (st_dev, st_ino of its link)."""
    try:
        st = os.stat("/proc/self/ns/user")
    except OSError:
        return b""
    return b"%d:%d" % (st.st_dev, st.st_ino)


def key() -> str:
    """Which server: one per uid, user namespace, interpreter, package and interpreter
    environment (a process in a nested user namespace that shares the state dir, e.g.
    under `unshare -U`, has servers of its own)."""
    h = 0xCBF29CE484222325  # FNV-1a 64: no hashlib import on the fast path
    data = b"\0".join([os.fsencode(sys.executable), os.fsencode(package_dir()), b"%d" % os.getuid(), userns(),
                       *interp_env()])
    for c in data:
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def servers_dir() -> str:
    from ..paths import state_dir

    return os.path.join(state_dir(), "servers")


def encode_request(argv: list[str], umask: int, numbers: list[int] | tuple[int, ...] = ()) -> bytes:
    fields = [MAGIC, os.fsencode(package_dir()), b"%d" % umask, b",".join(b"%d" % n for n in numbers), b"%d" % len(argv)]
    fields += [os.fsencode(a) for a in argv]
    fields += [k + b"=" + v for k, v in os.environb.items()]
    return b"\0".join(fields)


def run(argv: list[str], entry: str) -> int | None:
    """Serve ``stockade <argv>`` through the server; None: run it in-process. ``entry``:
    the Python code that starts a server (``python -P -c ENTRY dir name``), the CLI's.

    ``STOCKADE_SERVER=require`` (tests, benchmarks): the run is served or not run
    at all; a missing or stale server is started and waited for (nothing ran in a
    declined request, so it is sent again), and a decline is a one-line error."""
    mode = os.environ.get("STOCKADE_SERVER", "1")
    if mode == "0":
        return None
    d = servers_dir()
    name = key() + ".sock"
    if mode != "require":
        got = _connect_and_serve(argv, d, name, entry)
        return got if isinstance(got, int) else None
    import time

    try:
        os.makedirs(d, 0o700, exist_ok=True)
    except OSError as e:
        sys.stderr.write(f"stockade: STOCKADE_SERVER=require: cannot make {d}: {e.strerror}; "
                         "free space there or set STOCKADE_STATE_DIR elsewhere, or unset STOCKADE_SERVER\n")
        return 2
    # (a server's first start imports every module: about 30 s under emulation, tests' second kernel)
    deadline = time.monotonic() + REQUIRE_WAIT
    while True:
        got = _connect_and_serve(argv, d, name, entry)
        if isinstance(got, int):
            return got
        if got or time.monotonic() > deadline:
            why = got or f"no server came up in {REQUIRE_WAIT} s (see {os.path.join(d, name[:-5] + '.log')})"
            sys.stderr.write(f"stockade: STOCKADE_SERVER=require: this run cannot be served: {why}; "
                             "unset STOCKADE_SERVER to run it in-process\n")
            return 2
        time.sleep(0.05)


def _connect_and_serve(argv: list[str], d: str, name: str, entry: str) -> int | str:
    """The run's status, or why the server did not take it ("": none serves yet)."""
    import _socket

    try:
        dfd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        spawn(d, name, entry)
        return ""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        try:
            # through the directory's fd: a socket path is at most 107 bytes
            s.connect(f"/proc/self/fd/{dfd}/{name}")
        except OSError:
            spawn(d, name, entry)
            return ""
        finally:
            os.close(dfd)
        if not _same_userns(s):  # whoever made that socket, it is not our server: send it nothing
            return f"the process listening on {name} is in another user namespace"
        return _serve(s, argv, d, name, entry)
    finally:
        s.close()


def own_fds(skip: tuple[int, ...]) -> list[int] | str:
    """This process's open fds above 2 (but ``skip``): the server's supervisor gets
    them all, so ``--pass-fd N`` passes this process's N whatever argparse makes of
    the options (it never uses its own fd N). A str: why they cannot be sent."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError as e:
        return f"cannot list this process's fds: {e}"
    out = []
    for name in names:
        fd = int(name)
        if fd > 2 and fd not in skip:
            try:
                os.fstat(fd)  # the listing's own fd is closed by now
            except OSError:
                continue
            out.append(fd)
    return sorted(out) if len(out) <= MAX_FDS else f"more than {MAX_FDS} open file descriptors"


def _same_userns(s: object) -> bool:
    """Whether the server (the process that called listen on the socket) is in our
    user namespace. One in a nested namespace sharing the state dir could have put
    its socket where ours belongs; it must not get our stdio and working directory."""
    import _socket

    sock: _socket.socket = s  # type: ignore[assignment]
    pid = int.from_bytes(sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)[:4], sys.byteorder, signed=True)
    try:
        st = os.stat(f"/proc/{pid}/ns/user")
    except OSError:
        return False
    return b"%d:%d" % (st.st_dev, st.st_ino) == userns()


def _serve(s: object, argv: list[str], d: str, name: str, entry: str) -> int | str:
    import _signal
    import _socket

    sock: _socket.socket = s  # type: ignore[assignment]
    umask = os.umask(0o077)
    os.umask(umask)
    try:
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return "the working directory cannot be opened"  # the in-process path reports it
    extra = own_fds((sock.fileno(), cwd))
    if isinstance(extra, str):
        os.close(cwd)
        return extra
    pending: list[int] = []
    target = [-1]

    def forward(sig: int, _frame: object) -> None:
        if target[0] < 0:
            pending.append(sig)  # before the server took the run: delivered once it has
            return
        try:
            _signal.pidfd_send_signal(target[0], sig)
        except OSError:
            pass
        pending.append(sig)

    def stop(_sig: int, _frame: object) -> None:
        # Ctrl-Z: the supervisor stops with us, as an in-process CLI would (the
        # sandbox runs on until its output pipes fill), and goes on with us
        if target[0] >= 0:
            try:
                _signal.pidfd_send_signal(target[0], _STOP)
            except OSError:
                pass
        _signal.signal(_TSTP, _signal.SIG_DFL)
        os.kill(os.getpid(), _TSTP)

    def cont(_sig: int, _frame: object) -> None:
        _signal.signal(_TSTP, stop)
        if target[0] >= 0:
            try:
                _signal.pidfd_send_signal(target[0], _CONT)
            except OSError:
                pass

    old = {sig: _signal.signal(sig, forward) for sig in _FWD}
    old[_TSTP] = _signal.signal(_TSTP, stop)
    old[_CONT] = _signal.signal(_CONT, cont)
    try:
        try:
            sock.sendmsg([encode_request(argv, umask, extra)],
                         [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                           b"".join(fd.to_bytes(4, sys.byteorder) for fd in (0, 1, 2, cwd, *extra)))])
        except OSError as e:
            return f"cannot send the request: {e}"  # e.g. a closed stdio fd: in-process handles that
        finally:
            os.close(cwd)
        try:
            msg, anc, _flags, _addr = sock.recvmsg(4096, _socket.CMSG_SPACE(4))
        except OSError:
            msg, anc = b"", []
        if msg[:1] != b"A":
            if msg[:1] == b"S" or not msg:  # stale code, or gone before taking the run: a new one
                spawn(d, name, entry)
                return ""
            why = f"server declined: {msg[1:].decode(errors='replace')}"
            if os.environ.get("STOCKADE_SERVER") == "debug":
                sys.stderr.write(f"stockade: {why}\n")
            return why
        who = msg[1:].decode(errors="replace")
        pidfd = -1
        for level, kind, data in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS and len(data) >= 4:
                pidfd = int.from_bytes(data[:4], sys.byteorder)
        if pidfd < 0:
            return "the server sent no pidfd"
        target[0] = pidfd
        if os.environ.get("STOCKADE_SERVER") == "debug":
            sys.stderr.write(f"stockade: served by supervisor {who}\n")
        early, pending[:] = pending[:], []
        for sig in early:
            forward(sig, None)
        try:
            msg = sock.recv(64)
        except OSError:
            msg = b""
        if msg[:1] == b"X":
            return int(msg[1:])
        if pending:  # a signal we forwarded ended the supervisor before the sandbox started
            return 128 + pending[-1]
        sys.stderr.write(f"stockade: the supervisor of this run (pid {who}) ended without a status: "
                         "it was killed; see `stockade log` for the run's record\n")
        return 137
    finally:
        for sig, h in old.items():
            _signal.signal(sig, h)


_spawned_at = [-1e9]


def spawn(d: str, name: str, entry: str) -> None:
    """Start a server for the next runs (this one goes on in-process)."""
    if os.environ.get("STOCKADE_SERVER", "1") in ("0", "once"):
        return
    import time

    if time.monotonic() - _spawned_at[0] < 3:
        return  # the one this process started is still coming up (STOCKADE_SERVER=require waits)
    _spawned_at[0] = time.monotonic()
    try:
        try:
            os.mkdir(d, 0o700)  # in an existing state dir only: the in-process run makes that one
        except FileExistsError:
            pass
        pid = os.fork()
    except OSError:
        return  # no server: every run is in-process, as before
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        # not our child (a supervisor reaps and kills its own stragglers); -P: never
        # import from the caller's directory (it may be the untrusted project)
        os.posix_spawn(sys.executable, [sys.executable, "-P", "-c", entry, d, name],
                       os.environ, setsid=True,
                       file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDWR, 0), (os.POSIX_SPAWN_DUP2, 0, 1),
                                     # why a server could not start (every run is in-process then)
                                     (os.POSIX_SPAWN_OPEN, 2, os.path.join(d, name[:-5] + ".log"),
                                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)])
    finally:
        os._exit(0)


def serve_and_exit(argv: list[str], entry: str) -> None:
    """Exit with the status of ``stockade <argv>`` run by the server, if it took it."""
    rc = run(argv, entry)
    if rc is not None:
        # the run happened in the server's supervisor: nothing here to finalize
        sys.stderr.flush()
        os._exit(rc & 0xFF)
