"""The caller's file descriptors, by the numbers the caller knows them by.

``--pass-fd N`` passes the caller's fd N, never one stockade itself opened: the
CLI's own fds (a session directory, a lock, a socket) would be host fds inside
the sandbox. In-process, the CLI notes which fds it was started with
(``snapshot``) before it opens any. A CLI server's supervisor runs a client's
CLI: it holds the client's fds as received (SCM_RIGHTS, ``stockade.server``)
under other numbers, while its own fds may sit on the numbers the client names.
So prepare checks each number here and the launch layer asks ``sources`` where
each one is; a number is never used as an fd of this process directly. The
Python API (no snapshot) passes the calling program's own fds.
"""

from __future__ import annotations

import fcntl
import os

# The caller's fd number (above 2) -> the fd of this process that is it. None: the
# API, every open fd of this process is the caller's own.
RECEIVED: dict[int, int] | None = None


def snapshot() -> None:
    """The CLI, before it opens anything: the fds open now are the caller's."""
    global RECEIVED
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return  # no /proc: every check below is by number (the API's)
    got: dict[int, int] = {}
    for name in names:
        n = int(name)
        if n > 2:
            try:
                fcntl.fcntl(n, fcntl.F_GETFD)  # the listing's own fd is closed by now
            except OSError:
                continue
            got[n] = n
    RECEIVED = got


def source(n: int) -> int | None:
    """The fd of this process that is the caller's fd ``n``; None when the caller has none."""
    if RECEIVED is not None and n > 2:  # 0..2: the caller's stdio (a supervisor took it on)
        return RECEIVED.get(n)
    try:
        fcntl.fcntl(n, fcntl.F_GETFD)
    except OSError:
        return None
    return n


def sources(numbers: tuple[int, ...]) -> tuple[int, ...] | None:
    """Where each of the caller's fds (checked by prepare) is in this process, or
    None when each is at its own number (nothing to move)."""
    out = []
    for n in numbers:
        fd = source(n)
        if fd is None:  # prepare refused this; never fall back to our own fd n
            raise OSError(9, f"--pass-fd {n}: not an open file descriptor of the caller")
        out.append(fd)
    return None if tuple(out) == tuple(numbers) else tuple(out)
