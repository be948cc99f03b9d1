"""The one owner of libc: the calls Python's ``os`` module lacks (unshare, mount, syncfs,
openat2, clone3, ...). Nothing else in stockade loads libc (``ctypes.CDLL(None)``);
``native.py`` owns the C core.

Most functions are libc's own: they return its result (``-1`` on failure) and
:func:`errno` tells why, so a caller can name the step that failed. ``openat2``
raises ``OSError`` like ``os.open``."""

from __future__ import annotations

import ctypes
import os
import platform
import threading

_lock = threading.Lock()
_handle: ctypes.CDLL | None = None

SYS_OPENAT2 = 437  # same number on every architecture with the generic table
SYS_CLONE3 = 435
SYS_LANDLOCK_CREATE_RULESET = 444
LANDLOCK_CREATE_RULESET_VERSION = 1
SECCOMP_GET_ACTION_AVAIL = 2
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277, "riscv64": 277, "s390x": 348, "ppc64le": 358}


def _libc() -> ctypes.CDLL:
    global _handle
    if _handle is None:
        with _lock:
            if _handle is None:
                h = ctypes.CDLL(None, use_errno=True)
                h.syscall.restype = ctypes.c_long
                _handle = h
    return _handle


def errno() -> int:
    """The errno of this thread's last call here."""
    return ctypes.get_errno()


def unshare(flags: int) -> int:
    return int(_libc().unshare(ctypes.c_int(flags)))


def setns(fd: int, nstype: int) -> int:
    """Join the namespaces of an nsfs fd, or several of a pidfd's at once."""
    return int(_libc().setns(ctypes.c_int(fd), ctypes.c_int(nstype)))


def mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None) -> int:
    return int(_libc().mount(source, target, fstype, ctypes.c_ulong(flags), data))


def umount2(target: bytes, flags: int) -> int:
    return int(_libc().umount2(target, ctypes.c_int(flags)))


def sethostname(name: bytes) -> int:
    return int(_libc().sethostname(name, ctypes.c_size_t(len(name))))


def prctl(option: int, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0) -> int:
    return int(_libc().prctl(ctypes.c_int(option), ctypes.c_ulong(a2), ctypes.c_ulong(a3),
                             ctypes.c_ulong(a4), ctypes.c_ulong(a5)))


def syncfs(fd: int) -> int:
    """Write back the filesystem of ``fd`` (ctypes releases the GIL for the call)."""
    return int(_libc().syncfs(ctypes.c_int(fd)))


def inotify_init1(flags: int) -> int:
    return int(_libc().inotify_init1(ctypes.c_int(flags)))


def inotify_add_watch(fd: int, path: bytes, mask: int) -> int:
    return int(_libc().inotify_add_watch(ctypes.c_int(fd), path, ctypes.c_uint32(mask)))


def madvise(addr: int, length: int, advice: int) -> int:
    return int(_libc().madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice)))


def clone3(flags: int, exit_signal: int) -> int:
    """clone3 with no stack (fork-like): the child's pid, 0 in the child, -1 on failure."""
    # struct clone_args, CLONE_ARGS_SIZE_VER0: flags, pidfd, child_tid, parent_tid, exit_signal,
    # stack, stack_size, tls
    args = (ctypes.c_uint64 * 8)(flags, 0, 0, 0, exit_signal, 0, 0, 0)
    return int(_libc().syscall(ctypes.c_long(SYS_CLONE3), ctypes.byref(args), ctypes.c_size_t(64)))


def landlock_abi_version() -> int:
    """landlock_create_ruleset(NULL, 0, VERSION): the ABI, or -1."""
    return int(_libc().syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                               ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)))


def seccomp_action_avail(action: int) -> int | None:
    """seccomp(SECCOMP_GET_ACTION_AVAIL, 0, &action): 0 or -1; None where the number of
    seccomp(2) on this architecture is not known here."""
    nr = SYS_SECCOMP.get(platform.machine())
    if nr is None:
        return None
    act = ctypes.c_uint32(action)
    return int(_libc().syscall(ctypes.c_long(nr), ctypes.c_uint(SECCOMP_GET_ACTION_AVAIL), ctypes.c_uint(0),
                               ctypes.byref(act)))


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """The raw openat2(2) syscall; raises OSError (ENOSYS when the kernel lacks it)."""
    how = _OpenHow(flags, mode, resolve)
    fd = _libc().syscall(
        ctypes.c_long(SYS_OPENAT2),
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return int(fd)


SYS_QUOTACTL_FD = 443  # Linux 5.14+, same number on every architecture with the generic table


def quotactl_fd(fd: int, cmd: int, qid: int, addr: ctypes.Array[ctypes.c_char] | None) -> int:
    """quotactl_fd(2) on the filesystem of ``fd``: 0 or -1 (ENOSYS before Linux 5.14)."""
    return int(_libc().syscall(ctypes.c_long(SYS_QUOTACTL_FD), ctypes.c_uint(fd), ctypes.c_uint(cmd),
                               ctypes.c_int(qid), addr))


def quotactl(cmd: int, special: bytes, qid: int, addr: ctypes.Array[ctypes.c_char] | None) -> int:
    """quotactl(2) on the filesystem of block device ``special``: 0 or -1."""
    return int(_libc().quotactl(ctypes.c_int(cmd), ctypes.c_char_p(special), ctypes.c_int(qid), addr))
