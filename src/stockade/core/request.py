"""What a run was asked for: the options (``RunRequest``) and its I/O (``RunIO``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..cgroups.base import Limits
    from ..policy import CliPolicy
    from .supervise import Supervisor

# subprocess's values (api.PIPE == subprocess.PIPE ...), without importing it
PIPE = -1
STDOUT = -2
DEVNULL = -3

# a stream the caller gives: one of the values above, an fd, or a file object
Stream = int | IO[Any] | None


@dataclass(frozen=True)
class RunRequest:
    """What to run, where and under which options: everything but the I/O."""

    args: Sequence[str] | str
    project: str | os.PathLike[str] = "."
    session: str | None = None
    env: Mapping[str, str] | None = None
    cwd: str | os.PathLike[str] | None = None
    timeout: float | None = None
    shell: bool = False
    root: bool = False
    user: int | None = None
    read_only: bool = False
    network: str | None = None  # none | allow | host; None: the config's [network] mode, else none
    allow_hosts: Sequence[str] = ()  # --allow-host: HOST[:PORT], *.DOMAIN, IP, CIDR, @preset (needs mode allow)
    forward: Sequence[int | str] = ()  # --forward: host loopback ports the sandbox reaches (modes none, allow)
    pass_fds: Sequence[int] = ()
    seccomp: str = "default"
    allow_degraded: Sequence[str] = ()
    landlock: bool = True
    limits: Limits | None = None
    requested_limits: set[str] | frozenset[str] | None = None
    policy: CliSpec | CliPolicy | None = None
    no_wait: bool = False  # a busy session is an error at once instead of a wait
    session_ahead: bool = False  # the caller makes more runs (the API): make the next session's dirs meanwhile
    # a run without a session makes an anonymous one, removed when the run changed nothing
    # (changes/retention.py); the CLI keeps its project's latest such session until its next run
    keep_latest_empty: bool = False
    observe: bool | None = None  # log what the command tried (core/observe.py); None: the config's [audit] observe


@dataclass(frozen=True)
class RunIO:
    """The run's streams and how the caller waits for it (``subprocess.run``'s meanings)."""

    input: bytes | str | None = None
    stdin: Stream = None
    stdout: Stream = None
    stderr: Stream = None
    capture_output: bool = False
    text: bool = False
    encoding: str | None = None
    errors: str | None = None
    check: bool = False
    quiet: bool = True  # no policy warnings on stderr (the CLI shows them)
    forward_signals: bool = False  # the CLI: signals to this process go to the sandbox
    pty: bool = False  # a terminal of the sandbox's own, relayed (stockade shell)
    # called with the run's Supervisor once the command runs: its ``cancel`` ends the run
    # from another thread (`stockade mcp`); not a keyword of the public API
    on_start: Callable[[Supervisor], None] | None = None

    def checked(self) -> RunIO:
        """``subprocess.run``'s argument errors (ValueError), before anything starts."""
        if self.capture_output and (self.stdout is not None or self.stderr is not None):
            raise ValueError("stdout and stderr arguments may not be used with capture_output.")
        if self.input is not None and self.stdin is not None:
            raise ValueError("stdin and input arguments may not both be used.")
        return self

    @property
    def out(self) -> Stream:
        return PIPE if self.capture_output else self.stdout

    @property
    def err(self) -> Stream:
        return PIPE if self.capture_output else self.stderr

    @property
    def text_mode(self) -> bool:
        return bool(self.text or self.encoding or self.errors)

    def decoded(self, out: bytes | None, err: bytes | None) -> tuple[bytes | str | None, bytes | str | None]:
        """Captured output as the caller asked for it (``text``, ``encoding``, ``errors``)."""
        if not self.text_mode:
            return out, err
        enc, errs = self.encoding or "utf-8", self.errors or "strict"
        return (None if out is None else out.decode(enc, errs)), (None if err is None else err.decode(enc, errs))

    @property
    def piped_stdin(self) -> bool:
        """stdin is a pipe of stockade's own (input=, DEVNULL, a pty), never the caller's fd."""
        return self.input is not None or self.stdin == DEVNULL or self.pty

    def stdin_fd(self) -> int:
        """The caller's stdin descriptor the sandbox gets (when not piped)."""
        s = self.stdin
        return 0 if s is None else s if isinstance(s, int) else s.fileno()

    def inet_stdin(self) -> bool:
        """The caller's stdin is an IPv4/IPv6 socket (of whatever network namespace made
        it): inside, it is the caller's network (``prepare``'s stdin wall)."""
        fd = self.stdin_fd()
        return fd >= 0 and inet_socket(fd)


def socket_family(fd: int) -> int | None:
    """``fd``'s socket family (AF_UNIX, AF_INET...), or None when it is not a socket."""
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return int(s.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN))
    except OSError:
        return None
    finally:
        s.close()


def inet_socket(fd: int) -> bool:
    """Whether ``fd`` is an IPv4/IPv6 socket."""
    import socket

    return socket_family(fd) in (socket.AF_INET, socket.AF_INET6)


def argv_of(args: Sequence[str] | str, shell: bool) -> tuple[str, ...]:
    if isinstance(args, str | bytes):
        if shell:
            return ("/bin/sh", "-c", os.fsdecode(args))
        return (os.fsdecode(args),)
    if shell:
        return ("/bin/sh", "-c", " ".join(args))
    return tuple(os.fsdecode(a) for a in args)


class CliSpec:
    """Policy flags of the command line, made a ``CliPolicy`` only when a run is
    prepared in full (importing the policy package is what a cached CLI run avoids)."""

    __slots__ = ("fields",)

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    @property
    def key(self) -> tuple[Any, ...]:
        return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in self.fields.items()))

    def build(self) -> CliPolicy:
        from ..policy import CliPolicy

        return CliPolicy(**self.fields)
