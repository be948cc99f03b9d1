"""linux/quota.py: the structs it hands the kernel, and why probe says no."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest

from stockade.linux import quota


def test_qcmd_matches_sys_quota_h() -> None:
    # QCMD(Q_SETQUOTA, PRJQUOTA) as <sys/quota.h> computes it
    assert quota.qcmd(quota.Q_SETQUOTA, quota.PRJQUOTA) == 0x80000802
    assert quota.qcmd(quota.Q_GETINFO, quota.PRJQUOTA) == 0x80000502


def test_dqblk_layout() -> None:
    class IfDqblk(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("bh", "bs", "cs", "ih", "is_", "ci", "bt", "it")] + \
                   [("valid", ctypes.c_uint32)]

    raw = quota.pack_dqblk(16 * 1024 * 1024 + 1, 500)
    assert len(raw) == ctypes.sizeof(IfDqblk) == 72
    d = IfDqblk.from_buffer_copy(raw)
    assert d.bh == 16 * 1024 + 1  # 1 KiB blocks, rounded up
    assert d.ih == 500 and d.bs == d.is_ == 0
    assert d.valid == quota.QIF_BLIMITS | quota.QIF_ILIMITS
    assert quota.unpack_dqblk(raw)["bhardlimit"] == 16 * 1024 + 1


def test_fsxattr_layout_and_ioctl_numbers() -> None:
    raw = quota.pack_fsxattr(quota.FS_XFLAG_PROJINHERIT, 0, 0, 0x57000001, 0)
    assert len(raw) == 28  # sizeof(struct fsxattr)
    assert struct.unpack_from("=I", raw, 12)[0] == 0x57000001
    assert quota.unpack_fsxattr(raw) == (0x200, 0, 0, 0x57000001, 0)
    # _IOR/_IOW('X', 31/32, 28 bytes)
    assert (2 << 30) | (28 << 16) | (ord("X") << 8) | 31 == quota.FS_IOC_FSGETXATTR
    assert (1 << 30) | (28 << 16) | (ord("X") << 8) | 32 == quota.FS_IOC_FSSETXATTR


def _mountinfo(tmp_path: Path, fstype: str, opts: str, mp: str = "/") -> str:
    f = tmp_path / "mountinfo"
    f.write_text(f"22 1 8:1 / {mp} rw,relatime shared:1 - {fstype} /dev/sda1 rw,{opts}\n")
    return str(f)


def test_mount_of_picks_the_longest_mount(tmp_path: Path) -> None:
    f = tmp_path / "mountinfo"
    f.write_text("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
                 f"2 1 7:0 / {tmp_path} rw - ext4 /dev/loop0 rw,prjquota\n")
    assert quota.mount_of(str(tmp_path / "x"), str(f)) == (str(tmp_path), "ext4", "/dev/loop0", "rw,rw,prjquota")


@pytest.mark.parametrize(("fstype", "opts", "why"), [
    ("tmpfs", "size=10m", "tmpfs at / has no project quotas"),
    ("ext4", "errors=remount-ro", "ext4 at / is not mounted with project quotas (-o prjquota"),
    ("xfs", "attr2,noquota", "xfs at / is not mounted with project quotas (-o pquota)"),
])
def test_probe_reasons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fstype: str, opts: str, why: str) -> None:
    info = _mountinfo(tmp_path, fstype, opts)
    monkeypatch.setattr(quota, "mount_of", lambda p: _real_mount_of(p, info))
    got = quota._probe("/")
    assert isinstance(got, str) and got.startswith(why)


def test_probe_refuses_non_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = _mountinfo(tmp_path, "ext4", "prjquota")
    monkeypatch.setattr(quota, "mount_of", lambda p: _real_mount_of(p, info))
    monkeypatch.setattr(quota.os, "geteuid", lambda: 1000)
    assert quota._probe("/") == "not root (project quotas are set by root)"


def test_probe_names_a_kernel_without_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    info = _mountinfo(tmp_path, "ext4", "prjquota")
    monkeypatch.setattr(quota, "mount_of", lambda p: _real_mount_of(p, info))
    monkeypatch.setattr(quota, "_privileged", lambda: None)
    monkeypatch.setattr(quota, "_quotactl", lambda *a: errno.ENOSYS)
    assert quota._probe("/") == "quotactl(Q_GETINFO, PRJQUOTA) on /: this kernel has no quota support (CONFIG_QUOTA)"
    monkeypatch.setattr(quota, "_quotactl", lambda *a: errno.ESRCH)
    assert quota._probe("/").endswith("project quotas are not on there (quotaon)")  # type: ignore[union-attr]
    monkeypatch.setattr(quota, "_quotactl", lambda *a: 0)
    assert quota._probe("/") == quota.QuotaSupport("/", "ext4", "/dev/sda1")


def test_allocate_counts_up_from_the_base(tmp_path: Path) -> None:
    ids = [quota.allocate(tmp_path) for _ in range(3)]
    assert ids == [quota.ID_BASE, quota.ID_BASE + 1, quota.ID_BASE + 2]


_real_mount_of = quota.mount_of


def test_usage_of_an_id_the_kernel_keeps_no_record_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """xfs frees the record of a project with no limit and no use (Q_GETQUOTA: ENOENT, as
    after `stockade clean`); ext4 answers zeros. Both read as zeros; other errors raise."""
    import errno

    support = quota.QuotaSupport("/mnt", "xfs", "/dev/loop0")
    monkeypatch.setattr(quota, "_quotactl", lambda *a: errno.ENOENT)
    rec = quota.usage(support, "/mnt", quota.ID_BASE)
    assert rec["bhardlimit"] == rec["curspace"] == rec["curinodes"] == 0
    monkeypatch.setattr(quota, "_quotactl", lambda *a: errno.EPERM)
    with pytest.raises(PermissionError, match="Q_GETQUOTA"):
        quota.usage(support, "/mnt", quota.ID_BASE)
    # and what a write past the cap gets, by filesystem (explain says it)
    assert (quota.refusal("xfs"), quota.refusal("ext4")) == ("ENOSPC", "EDQUOT")
