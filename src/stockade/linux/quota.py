"""Filesystem project quotas: the kernel's own cap on a session's layers (``--disk``).

A directory tree gets a project id (``FS_IOC_FSSETXATTR``: ``fsx_projid`` and
``FS_XFLAG_PROJINHERIT``, so what is created below inherits it) and the id gets hard
limits (``quotactl(Q_SETQUOTA, PRJQUOTA)``): a write past them fails in the sandbox,
whatever writes it (EDQUOT; ENOSPC on xfs, which answers a project quota as a full
disk). Only where the filesystem enforces project quotas (ext4 mounted ``prjquota``,
xfs ``pquota``) and the caller is root in the initial user namespace; elsewhere ``probe`` says why not and the supervisor's watchdog holds the cap."""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from . import libc

PRJQUOTA = 2
SUBCMDSHIFT = 8
Q_GETINFO = 0x800005
Q_GETQUOTA = 0x800007
Q_SETQUOTA = 0x800008
QIF_BLIMITS = 1
QIF_ILIMITS = 4
QIF_DQBLKSIZE = 1024  # dqb_bhardlimit's unit

# struct if_dqblk: bhardlimit, bsoftlimit, curspace, ihardlimit, isoftlimit, curinodes,
# btime, itime (u64 each), valid (u32), padded to 8
_DQBLK = struct.Struct("=8QI4x")
# struct if_dqinfo: bgrace, igrace (u64), flags, valid (u32)
_DQINFO = struct.Struct("=2Q2I")
# struct fsxattr: xflags, extsize, nextents, projid, cowextsize (u32), pad[8]
_FSXATTR = struct.Struct("=5I8x")
FS_IOC_FSGETXATTR = 0x801C581F  # _IOR('X', 31, struct fsxattr)
FS_IOC_FSSETXATTR = 0x401C5820  # _IOW('X', 32, struct fsxattr)
FS_XFLAG_PROJINHERIT = 0x200

CAP_SYS_ADMIN = 21
# Session project ids start high: an admin's own ids are small numbers (/etc/projid).
ID_BASE = 0x5700_0000
ID_SPAN = 0x00FF_FFFF
_ENFORCING = ("prjquota", "pquota", "prjjquota", "pqnoenforce")


def qcmd(cmd: int, qtype: int) -> int:
    """QCMD(cmd, type) of <sys/quota.h>."""
    return (cmd << SUBCMDSHIFT) | (qtype & 0x00FF)


def pack_dqblk(bytes_limit: int, inodes_limit: int) -> bytes:
    """An if_dqblk that sets both hard limits (0: none); soft limits left at 0."""
    blocks = (bytes_limit + QIF_DQBLKSIZE - 1) // QIF_DQBLKSIZE
    return _DQBLK.pack(blocks, 0, 0, inodes_limit, 0, 0, 0, 0, QIF_BLIMITS | QIF_ILIMITS)


def unpack_dqblk(raw: bytes) -> dict[str, int]:
    names = ("bhardlimit", "bsoftlimit", "curspace", "ihardlimit", "isoftlimit", "curinodes", "btime", "itime",
             "valid")
    return dict(zip(names, _DQBLK.unpack(raw[:_DQBLK.size]), strict=True))


def pack_fsxattr(xflags: int, extsize: int, nextents: int, projid: int, cowextsize: int) -> bytes:
    return _FSXATTR.pack(xflags, extsize, nextents, projid, cowextsize)


def unpack_fsxattr(raw: bytes) -> tuple[int, int, int, int, int]:
    x = _FSXATTR.unpack(raw[:_FSXATTR.size])
    return (x[0], x[1], x[2], x[3], x[4])


def refusal(fstype: str) -> str:
    """The errno a write past a project quota gets on ``fstype``: xfs answers ENOSPC (a
    project's tree looks like a full disk: tested under `make test-vm`), ext4 EDQUOT."""
    return "ENOSPC" if fstype == "xfs" else "EDQUOT"


@dataclass(frozen=True)
class QuotaSupport:
    """A filesystem that enforces project quotas, and how to reach it."""

    mount_point: str
    fstype: str
    device: str


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str, str, str]:
    """(mount point, fstype, source, mount + super options) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("/", "?", "", "")
    with open(mountinfo, encoding="utf-8", errors="replace") as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            a, b = left.split(), right.split()
            if not sep or len(a) < 6 or len(b) < 3:
                continue
            mp = a[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best[0]):
                best = (mp, b[0], b[1], a[5] + "," + b[2])
    return best


def _privileged() -> str | None:
    """Why this process may not set quotas, or None: root with CAP_SYS_ADMIN in the
    initial user namespace (project ids and quota limits are the host's)."""
    if os.geteuid() != 0:
        return "not root (project quotas are set by root)"
    try:
        with open("/proc/self/uid_map", encoding="ascii") as f:
            if f.read().split() != ["0", "0", "4294967295"]:
                return "root of a user namespace, not of the host"
        with open("/proc/self/status", encoding="ascii") as f:
            eff = next((int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:")), 0)
    except OSError as e:
        return f"cannot read this process's credentials: {e.strerror}"
    if not eff >> CAP_SYS_ADMIN & 1:
        return "no CAP_SYS_ADMIN"
    return None


def _quotactl(path: str, device: str, cmd: int, qid: int, buf: ctypes.Array[ctypes.c_char] | None) -> int:
    """quotactl on the filesystem of ``path``: quotactl_fd where the kernel has it (no
    device path needed), else by the block device. 0, or an errno."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if libc.quotactl_fd(fd, cmd, qid, buf) == 0:
            return 0
        e = libc.errno()
        if e not in (errno_mod.ENOSYS, errno_mod.EPERM) or not device.startswith("/"):
            return e  # (EPERM: a seccomp filter may refuse the newer call with it)
    finally:
        os.close(fd)
    if libc.quotactl(cmd, os.fsencode(device), qid, buf) == 0:
        return 0
    return libc.errno()


_probed: dict[int, QuotaSupport | str] = {}


def probe(path: str | os.PathLike[str]) -> QuotaSupport | str:
    """A ``QuotaSupport`` when the filesystem holding ``path`` enforces project quotas
    and this process may set them, else the reason why not (one phrase). Cached per
    filesystem."""
    p = str(path)
    while not os.path.exists(p) and p not in ("", "/"):
        p = os.path.dirname(p)
    try:
        dev = os.stat(p).st_dev
    except OSError as e:
        return f"cannot stat {p}: {e.strerror}"
    hit = _probed.get(dev)
    if hit is None:
        hit = _probed[dev] = _probe(p)
    return hit


def _probe(path: str) -> QuotaSupport | str:
    try:
        mp, fstype, source, opts = mount_of(path)
    except OSError as e:
        return f"cannot read /proc/self/mountinfo: {e.strerror}"
    if fstype not in ("ext4", "xfs"):
        return f"{fstype} at {mp} has no project quotas stockade can set (ext4 prjquota, xfs pquota)"
    if not any(o in _ENFORCING or o.startswith("prjjquota=") for o in opts.split(",")):
        how = "-o prjquota (and tune2fs -O quota,project)" if fstype == "ext4" else "-o pquota"
        return f"{fstype} at {mp} is not mounted with project quotas ({how})"
    why = _privileged()
    if why is not None:
        return why
    buf = ctypes.create_string_buffer(_DQINFO.size)
    err = _quotactl(path, source, qcmd(Q_GETINFO, PRJQUOTA), 0, buf)
    if err:
        reason = {errno_mod.ENOSYS: "this kernel has no quota support (CONFIG_QUOTA)",
                  errno_mod.ESRCH: "project quotas are not on there (quotaon)"}.get(err, os.strerror(err))
        return f"quotactl(Q_GETINFO, PRJQUOTA) on {mp}: {reason}"
    return QuotaSupport(mp, fstype, source)


def set_project(path: str | os.PathLike[str], project_id: int, *, recursive: bool = False) -> None:
    """Give ``path`` (a directory) project id ``project_id`` with PROJINHERIT; with
    ``recursive``, every directory and regular file below it too (what exists now:
    setting the id moves the file's usage to the project). Symlinks and device nodes
    (whiteouts) are left: they hold no data blocks worth a cap. Raises OSError."""
    _set_one(str(path), project_id, directory=True)
    if not recursive:
        return
    for top, dirs, files in os.walk(path):
        for name in dirs:
            full = os.path.join(top, name)
            if stat.S_ISDIR(os.lstat(full).st_mode):
                _set_one(full, project_id, directory=True)
        for name in files:
            full = os.path.join(top, name)
            if stat.S_ISREG(os.lstat(full).st_mode):
                _set_one(full, project_id, directory=False)


def _set_one(path: str, project_id: int, *, directory: bool) -> None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if directory else os.O_NONBLOCK)
    fd = os.open(path, flags)
    try:
        raw = bytearray(_FSXATTR.size)
        fcntl.ioctl(fd, FS_IOC_FSGETXATTR, raw)
        xflags, extsize, nextents, projid, cow = unpack_fsxattr(bytes(raw))
        want = xflags | FS_XFLAG_PROJINHERIT if directory else xflags
        if projid != project_id or want != xflags:
            fcntl.ioctl(fd, FS_IOC_FSSETXATTR, pack_fsxattr(want, extsize, nextents, project_id, cow))
    finally:
        os.close(fd)


def project_of(path: str | os.PathLike[str]) -> tuple[int, bool]:
    """(project id, PROJINHERIT set) of ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        raw = bytearray(_FSXATTR.size)
        fcntl.ioctl(fd, FS_IOC_FSGETXATTR, raw)
    finally:
        os.close(fd)
    x = unpack_fsxattr(bytes(raw))
    return x[3], bool(x[0] & FS_XFLAG_PROJINHERIT)


def set_limit(support: QuotaSupport, path: str | os.PathLike[str], project_id: int, bytes_limit: int,
              inodes_limit: int = 0) -> None:
    """Hard limits for ``project_id`` on ``support``'s filesystem (0: none). Raises
    OSError naming the call and the path."""
    buf = ctypes.create_string_buffer(pack_dqblk(bytes_limit, inodes_limit), _DQBLK.size)
    e = _quotactl(str(path), support.device, qcmd(Q_SETQUOTA, PRJQUOTA), project_id, buf)
    if e:
        raise OSError(e, f"quotactl(Q_SETQUOTA, PRJQUOTA, {project_id:#x}): {os.strerror(e)}", str(path))


def usage(support: QuotaSupport, path: str | os.PathLike[str], project_id: int) -> dict[str, int]:
    """The kernel's record of ``project_id``: limits and use (``curspace`` in bytes); all
    zero for an id it keeps no record of (xfs frees one with no limit and no use: ENOENT,
    where ext4 answers zeros)."""
    buf = ctypes.create_string_buffer(_DQBLK.size)
    e = _quotactl(str(path), support.device, qcmd(Q_GETQUOTA, PRJQUOTA), project_id, buf)
    if e == errno_mod.ENOENT:
        return unpack_dqblk(bytes(_DQBLK.size))
    if e:
        raise OSError(e, f"quotactl(Q_GETQUOTA, PRJQUOTA, {project_id:#x}): {os.strerror(e)}", str(path))
    return unpack_dqblk(buf.raw)


def limit(upper_dir: str | os.PathLike[str], project_id: int, bytes_limit: int, inodes_limit: int = 0) -> QuotaSupport:
    """Put ``upper_dir`` (and what is created below it) under ``project_id`` and cap the
    id. Raises OSError where ``probe`` says no (ENOTSUP) or a call fails."""
    support = probe(upper_dir)
    if isinstance(support, str):
        raise OSError(errno_mod.ENOTSUP, support, str(upper_dir))
    set_project(upper_dir, project_id)
    set_limit(support, upper_dir, project_id, bytes_limit, inodes_limit)
    return support


def release(path: str | os.PathLike[str], project_id: int) -> None:
    """Clear ``project_id``'s limits on the filesystem holding ``path`` (a session's
    removal). Quiet where there is nothing to clear."""
    support = probe(path)
    if isinstance(support, str):
        return
    try:
        set_limit(support, path, project_id, 0, 0)
    except OSError:
        pass


def allocate(state: str | os.PathLike[str]) -> int:
    """The next session project id of the state dir ``state`` (its ``quota-ids``
    counter file, under a lock): ``ID_BASE`` upwards."""
    counter = Path(state) / "quota-ids"
    fd = os.open(counter, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.pread(fd, 32, 0).strip()
        n = int(raw) if raw.isdigit() else 0
        data = f"{(n + 1) % ID_SPAN}\n".encode()
        os.pwrite(fd, data.ljust(16), 0)
        return ID_BASE + n % ID_SPAN
    finally:
        os.close(fd)
