"""Safe path resolution beneath a root directory.

Everything apply, discard, export and the scanner do to a project (or to a layer
the sandbox controlled) goes through a :class:`Root`: a directory fd plus
``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)``.
When the kernel lacks openat2 (before 5.6) a per-component ``O_NOFOLLOW``
walk gives the same guarantee. A symlink anywhere on the way, a ``..``
component, or an absolute path is refused (``ELOOP``/``EXDEV``), so content
written by untrusted code can never make us act outside the root.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from ..linux.libc import openat2

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


_have_openat2: bool | None = None


def has_openat2() -> bool:
    global _have_openat2
    if _have_openat2 is None:
        try:
            fd = openat2(-100, "/", _DIR_FLAGS, 0, RESOLVE_NO_SYMLINKS)
        except OSError as e:
            _have_openat2 = e.errno != errno.ENOSYS and e.errno != errno.EPERM
        else:
            os.close(fd)
            _have_openat2 = True
    return _have_openat2


def force_fallback(value: bool) -> None:
    """Tests: exercise the per-component O_NOFOLLOW walk even where openat2 exists."""
    global _have_openat2
    _have_openat2 = not value if value else None


def split_rel(rel: str) -> list[str]:
    """Split a relative path; refuse absolute paths, ``..`` and empty components."""
    if rel in ("", "."):
        return []
    if rel.startswith("/"):
        raise OSError(errno.EXDEV, "absolute path", rel)
    parts = rel.split("/")
    for p in parts:
        if p in ("", ".", ".."):
            raise OSError(errno.EXDEV, "path component escapes", rel)
    return parts


_ODD = frozenset(("", ".", ".."))


class Root:
    """A directory opened once; every path below it is resolved without symlinks.

    Parent directory fds are cached (an fd pins the directory itself, so later
    renames of the path cannot redirect us). Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False) -> None:
        self.path = os.fspath(path)
        if create:
            os.makedirs(self.path, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dirs: dict[str, int] = {"": self.fd}

    def close(self) -> None:
        for fd in self._dirs.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._dirs = {}

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forget(self, rel: str = "") -> None:
        """Drop cached fds at and below ``rel`` (after removing or replacing a directory)."""
        if rel == "":
            keep = {"": self.fd}
            for k, fd in self._dirs.items():
                if k:
                    os.close(fd)
            self._dirs = keep
            return
        pre = rel + "/"
        for k in [k for k in self._dirs if k == rel or k.startswith(pre)]:
            os.close(self._dirs.pop(k))

    def dirfd(self, rel: str) -> int:
        """An fd for directory ``rel`` (cached); OSError(ELOOP/ENOTDIR/ENOENT/EXDEV) otherwise."""
        fd = self._dirs.get(rel)
        if fd is not None:
            return fd
        parts = split_rel(rel)
        if has_openat2():
            fd = openat2(
                self.fd,
                rel,
                _DIR_FLAGS,
                0,
                RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
            )
        else:
            parent = "/".join(parts[:-1])
            pfd = self.dirfd(parent)
            fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=pfd)
        self._dirs[rel] = fd
        return fd

    def parent(self, rel: str) -> tuple[int, str]:
        """(fd of the parent directory, final component) of ``rel``."""
        head, _, name = rel.rpartition("/")
        if name not in _ODD and not rel.startswith("/"):
            fd = self._dirs.get(head)  # cached: ``head`` was checked when it was opened
            return (fd if fd is not None else self.dirfd(head)), name
        parts = split_rel(rel)
        if not parts:
            raise OSError(errno.EINVAL, "the root itself", rel)
        return self.dirfd("/".join(parts[:-1])), parts[-1]

    def lstat(self, rel: str) -> os.stat_result | None:
        """lstat of ``rel`` or None when it (or a non-directory/symlink ancestor) is absent."""
        try:
            if rel == "":
                return os.fstat(self.fd)
            pfd, name = self.parent(rel)
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                return None
            raise

    def open_read(self, rel: str) -> int:
        """O_RDONLY fd of regular file ``rel`` (never through a symlink)."""
        pfd, name = self.parent(rel)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=pfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", rel)
        return fd

    def read_bytes(self, rel: str, limit: int | None = None) -> bytes:
        fd = self.open_read(rel)
        try:
            chunks = []
            left = limit
            while left is None or left > 0:
                b = os.read(fd, 1 << 20 if left is None else min(left, 1 << 20))
                if not b:
                    break
                chunks.append(b)
                if left is not None:
                    left -= len(b)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def readlink(self, rel: str) -> str:
        pfd, name = self.parent(rel)
        return os.readlink(name, dir_fd=pfd)

    def listdir(self, rel: str) -> list[str]:
        return os.listdir(self.dirfd(rel))

    def scandir(self, rel: str) -> Iterator[os.DirEntry[str]]:
        fd = os.dup(self.dirfd(rel))
        try:
            with os.scandir(fd) as it:
                yield from it
        finally:
            os.close(fd)


def files_equal(a: Root, arel: str, b: Root, brel: str, size: int) -> bool:
    """Byte comparison of two regular files of the same (already checked) size."""
    fa = a.open_read(arel)
    try:
        fb = b.open_read(brel)
        try:
            left = size
            while True:
                x = os.read(fa, 1 << 18)
                y = os.read(fb, 1 << 18)
                if x != y:
                    return False
                if not x:
                    return left == 0
                left -= len(x)
        finally:
            os.close(fb)
    finally:
        os.close(fa)


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def rmtree_at(dirfd: int, name: str) -> None:
    """Remove ``name`` below ``dirfd`` (any type) without following symlinks."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dirfd)
        return
    fd = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
    try:
        for child in os.listdir(fd):
            rmtree_at(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dirfd)


class Roots:
    """The project and a session's layers (lowest first) as Roots; layers open on first use."""

    def __init__(self, project: Path, stack: list[Path]) -> None:
        self.host = Root(project)
        self.stack = stack
        self.layers: dict[int, Root] = {}

    def close(self) -> None:
        self.host.close()
        for r in self.layers.values():
            r.close()

    def layer(self, i: int) -> Root:
        r = self.layers.get(i)
        if r is None:
            r = self.layers[i] = Root(self.stack[i])
        return r


def copy_fd(src_fd: int, out: int) -> None:
    """Copy ``src_fd`` from its current offset to its end into ``out`` (short writes handled)."""
    while b := os.read(src_fd, 1 << 16):
        view = memoryview(b)
        while view:
            view = view[os.write(out, view):]


def copy_to_new(src_fd: int, name: str, dir_fd: int, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Copy ``src_fd`` into a file ``name`` that must not exist yet in ``dir_fd``
    (O_EXCL|O_NOFOLLOW: nothing planted there is followed), then set its owner
    (through the fd: nothing swapped in under the name is touched) and mode."""
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        copy_fd(src_fd, out)
        if owner is not None:
            os.fchown(out, *owner)  # before the mode: chown clears set-id bits
        os.fchmod(out, mode)
    finally:
        os.close(out)


# O_TMPFILE + linkat: a new file appears under its final name all at once (linkat is
# atomic and fails with EEXIST rather than replace anything), and a crash before the
# link leaves nothing behind (the kernel frees the unnamed inode). The link goes
# through /proc/self/fd/N with AT_SYMLINK_FOLLOW: linkat(AT_EMPTY_PATH) would need
# CAP_DAC_READ_SEARCH. None = not probed yet.
_tmpfile_ok: bool | None = None
_TMPFILE_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)


def link_new(src_fd: int, name: str, dir_fd: int, mode: int, owner: tuple[int, int] | None = None) -> bool:
    """Create ``name`` in ``dir_fd`` (it must not exist; nothing there is followed or
    replaced: EEXIST) with the contents of ``src_fd`` and ``mode``, atomically.

    Returns False, having done nothing, where O_TMPFILE or /proc is unavailable
    (the caller then writes a temporary file and renames it)."""
    global _tmpfile_ok
    if _tmpfile_ok is None:
        _tmpfile_ok = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
    if not _tmpfile_ok:
        return False
    try:
        out = os.open(".", os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in _TMPFILE_UNSUPPORTED:
            raise
        _tmpfile_ok = False  # this kernel or filesystem has no O_TMPFILE
        return False
    try:
        copy_fd(src_fd, out)
        if owner is not None:
            os.fchown(out, *owner)
        os.fchmod(out, mode)
        os.link(f"/proc/self/fd/{out}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(out)
    return True
