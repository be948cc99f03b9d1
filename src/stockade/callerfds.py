"""The caller's file descriptors, by the numbers the caller knows them by.

``--pass-fd N`` passes the caller's fd N, never one stockade itself opened: the
CLI's own fds (a session directory, a lock, a socket) would be host fds inside
the sandbox. In-process, the CLI notes which fds it was started with
(``snapshot``) before it opens any. A CLI server's supervisor runs a client's
CLI: it holds the client's fds as received (SCM_RIGHTS, ``stockade.fast.server``)
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


# A caller's stdin that is a regular file is handed to the sandbox as a copy of it
# up to this size, and as a pipe fed from it beyond (see ``reopenable_stdin``).
STDIN_COPY_MAX = 64 << 20


class SandboxStdin:
    """What the sandbox gets as fd 0 in place of a caller's regular file.

    ``fd``: the sandbox's stdin. ``copy``: a read-only fd of the sealed memfd copy
    (the same open file as ``fd``), whose offset goes back to the caller's file when
    the run ends; -1 for a pipe. ``sink``: the pipe's write end, fed from the
    caller's file by the supervisor; -1 for a copy."""

    __slots__ = ("copy", "fd", "sink")

    def __init__(self, fd: int, copy: int = -1, sink: int = -1) -> None:
        self.fd, self.copy, self.sink = fd, copy, sink

    def give_back_offset(self, caller_fd: int) -> None:
        """Move the caller's file to where the sandbox stopped reading its copy, as if
        the sandbox had read the file itself (``{ stockade run -- head -n1; cat; } < f``)."""
        if self.copy >= 0:
            try:
                os.lseek(caller_fd, os.lseek(self.copy, 0, os.SEEK_CUR), os.SEEK_SET)
            except OSError:
                pass


def reopenable_stdin(fd: int) -> SandboxStdin | None:
    """An fd for the sandbox's stdin that it can reopen (``python3 /dev/stdin``,
    ``bash /dev/stdin``, ``jq . /dev/stdin``), when the caller's ``fd`` is a regular
    file opened read-only; None to pass ``fd`` itself (a pipe, a tty, /dev/null, a
    file opened for writing: those reopen, or writes must reach the file).

    Reopening /dev/stdin opens /proc/self/fd/0, a path that leads to the caller's
    file on the host, which Landlock refuses: granting it would open that path. A
    memfd is on no path of the host (Landlock leaves such internal files alone), so
    the sandbox gets a sealed, read-only memfd copy of the whole file at the same
    offset: reads, seeks, fstat's size and a reopen from the start behave as on the
    file. A file larger than ``STDIN_COPY_MAX`` (or one that grows past it while it
    is copied) becomes a pipe fed from the caller's offset on: reading and reopening
    work, seeking does not."""
    import stat

    try:
        st = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or flags & os.O_ACCMODE != os.O_RDONLY:
        return None
    if st.st_size <= STDIN_COPY_MAX:
        try:
            got = _memfd_copy(fd)
        except OSError:
            got = None  # no sendfile from this filesystem, no memfd: the pipe reads it
        if got is not None:
            return got
    r, w = os.pipe2(os.O_CLOEXEC)
    return SandboxStdin(r, sink=w)


def _memfd_copy(fd: int) -> SandboxStdin | None:
    """A sealed read-only copy of the file ``fd`` at its offset; None when it is
    larger than ``STDIN_COPY_MAX`` by the end of the copy."""
    mfd = os.memfd_create("stockade-stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        off = 0
        while True:  # to the end as it is now: the file may have grown since fstat
            n = os.sendfile(mfd, fd, off, 1 << 20)  # with an offset: the caller's is left alone
            if n == 0:
                break
            off += n
            if off > STDIN_COPY_MAX:
                return None
        fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        ro = os.open(f"/proc/self/fd/{mfd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(mfd)
    try:
        os.lseek(ro, os.lseek(fd, 0, os.SEEK_CUR), os.SEEK_SET)
    except OSError:
        os.close(ro)
        raise
    return SandboxStdin(ro, copy=ro)
