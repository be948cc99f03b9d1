"""--disk / --disk-floor without privileges: parsing, the plan's tmpfs options, the
watchdog's decisions (fake clock, fake usage), outcome classification, explain."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest

from stockade import plan as planmod
from stockade.cgroups import base as cgbase
from stockade.cgroups.base import DEFAULT_DISK, GiB, Limits, MiB
from stockade.cgroups.parse import parse_limit
from stockade.core import diskwatch
from stockade.core.diskwatch import DiskWatch, FsState, Probe
from stockade.errors import UsageError

# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(("raw", "want"), [("10G", 10 * GiB), ("500M", 500 * MiB), ("1.5G", int(1.5 * GiB)),
                                           ("none", None), ("unlimited", None), (2 * GiB, 2 * GiB)])
def test_parse_disk(raw: object, want: int | None) -> None:
    assert parse_limit("disk", raw) == want


@pytest.mark.parametrize("raw", ["10XB", "-5M", "", "0", "512K", "1e9", True])
def test_parse_disk_refuses(raw: object) -> None:
    with pytest.raises(UsageError) as e:
        parse_limit("disk", raw)
    msg = str(e.value)
    assert msg.startswith("--disk: invalid value") and "\n" not in msg


def test_parse_disk_floor_and_config_source() -> None:
    assert parse_limit("disk_floor", "2G") == 2 * GiB
    assert parse_limit("disk_floor", "0") == 0
    with pytest.raises(UsageError, match=r"^cfg.toml:3: limits\.disk: invalid value"):
        parse_limit("disk", "lots", source="cfg.toml:3")


def test_defaults_protect_a_laptop() -> None:
    d = Limits.defaults()
    assert d.disk == DEFAULT_DISK == 10 * GiB
    assert d.disk_floor == GiB
    with pytest.raises(UsageError):
        Limits(disk=4096)


def test_cli_table_has_the_flags() -> None:
    from stockade.cli.table import LIMIT_NAMES

    assert LIMIT_NAMES == cgbase.LIMIT_NAMES


def test_rlimit_fsize_guards_one_file() -> None:
    import resource

    from stockade.cgroups.rlimit import rlimits_for

    class M:
        kind = "none"

        def enforcement(self, limits: Limits) -> dict[str, str]:
            return {}

    got = {r: (s, h) for r, s, h in rlimits_for(Limits(disk=2 * GiB), M())}  # type: ignore[arg-type]
    assert got[resource.RLIMIT_FSIZE][0] <= 2 * GiB
    got = {r: (s, h) for r, s, h in rlimits_for(Limits(disk=2 * GiB, max_file_size=MiB), M())}  # type: ignore[arg-type]
    assert got[resource.RLIMIT_FSIZE][0] == MiB


# --------------------------------------------------------------------------- the plan


def _plan(tmp_path: Path, size: int | None, **kw: object) -> planmod.Plan:
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    (tmp_path / "upper").mkdir(exist_ok=True)
    (tmp_path / "work").mkdir(exist_ok=True)
    req = planmod.Request(argv=("true",), project=proj, cwd=proj, env={}, upper=tmp_path / "upper",
                          work=tmp_path / "work", tmpfs_size=size, **kw)  # type: ignore[arg-type]
    return planmod.build(req)


def test_every_writable_tmpfs_is_capped(tmp_path: Path) -> None:
    p = _plan(tmp_path, 2 * GiB)
    assert set(p.writable_tmpfs) >= {"/tmp", "/var/tmp", "/run", "/dev/shm"}
    by_target = {m.target: m for m in p.mounts if m.kind == "tmpfs"}
    for t in p.writable_tmpfs:
        data = str(by_target[t].data)
        assert f"size={2 * GiB}" in data and f"nr_inodes={2 * GiB // planmod.TMPFS_BYTES_PER_INODE}" in data, t
    # read-only and masking tmpfs keep their own size=0; the root and /dev are remounted read-only
    for m in p.mounts:
        if m.kind == "tmpfs" and "ro" in m.flags:
            assert "size=0" in str(m.data) and f"size={2 * GiB}" not in str(m.data)
    assert p.tmpfs_size == 2 * GiB
    assert "/" not in p.writable_tmpfs and "/dev" not in p.writable_tmpfs


def test_no_cap_no_size(tmp_path: Path) -> None:
    p = _plan(tmp_path, None)
    for m in p.mounts:
        if m.kind == "tmpfs" and m.target in p.writable_tmpfs:
            assert "size=" not in str(m.data)


def test_a_grant_over_tmp_is_not_counted(tmp_path: Path) -> None:
    host = tmp_path / "hosttmp"
    host.mkdir()
    p = _plan(tmp_path, GiB, grants=((str(host), True),))
    assert str(host) not in p.writable_tmpfs


def test_tmpfs_cap_rounds_and_never_zero() -> None:
    assert planmod.tmpfs_cap(None) == ""
    assert "size=4096," in planmod.tmpfs_cap(1)
    assert f"nr_inodes={planmod.TMPFS_MIN_INODES}" in planmod.tmpfs_cap(MiB)


def test_tmpfs_never_above_the_memory_limit() -> None:
    from stockade.core.prepare import disk_tmpfs

    assert disk_tmpfs(Limits(disk=10 * GiB, memory=GiB)) == GiB
    assert disk_tmpfs(Limits(disk=GiB, memory=4 * GiB)) == GiB
    assert disk_tmpfs(Limits(memory=GiB)) is None


# --------------------------------------------------------------------------- the watchdog


class FakeProbe(Probe):
    """Usage the test sets; counts the walks."""

    def __init__(self) -> None:
        super().__init__([], None)
        self.layer_bytes = 0
        self.tm: dict[str, tuple[int, bool]] = {}
        self.fs_used = 50 * GiB
        self.fs_free = 50 * GiB
        self.entries = 0
        self.fs_inodes_used = 1_000_000
        self.fs_inodes_total = 10_000_000
        self.walks = 0

    def attach(self, pid: int, pidfd: int, tmpfs: Sequence[str]) -> None:
        self.tm = {t: (0, False) for t in tmpfs}

    def tmpfs(self) -> dict[str, tuple[int, bool]]:
        return dict(self.tm)

    def fs(self) -> FsState | None:
        return FsState(self.fs_used, self.fs_free, self.fs_inodes_used,
                       self.fs_inodes_total - self.fs_inodes_used, self.fs_inodes_total)

    def walk(self) -> diskwatch.TreeUsage:
        self.walks += 1
        return diskwatch.TreeUsage(self.layer_bytes, self.entries)

    def create_files(self, n: int) -> None:
        """Empty files: inodes, no blocks."""
        self.entries += n
        self.fs_inodes_used += n

    def write_layers(self, n: int) -> None:
        self.layer_bytes += n
        self.fs_used += n
        self.fs_free -= n


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _watch(cap: int | None = GiB, floor: int | None = None) -> tuple[DiskWatch, FakeProbe, Clock]:
    pr, clock = FakeProbe(), Clock()
    w = DiskWatch(cap, floor, ("/tmp", "/dev/shm"), pr, clock=clock)
    w.attach(1, -1)
    return w, pr, clock


def _run_until_hit(w: DiskWatch, clock: Clock, write: object, limit: int = 10_000) -> str | None:
    for _ in range(limit):
        clock.t = w.next_at
        write(clock.t)  # type: ignore[operator]
        why = w.tick()
        if why is not None:
            return why
    return None


def test_layers_written_past_the_cap_end_the_run_near_it() -> None:
    w, pr, clock = _watch(cap=GiB)
    why = _run_until_hit(w, clock, lambda _t: pr.write_layers(20 * MiB))  # ~200 MB/s
    assert why is not None and why.startswith("disk limit 1G: the project's layers hold")
    assert GiB - 60 * MiB <= pr.layer_bytes <= GiB, pr.layer_bytes  # before the cap, not long before


def test_tmpfs_sum_counts_and_names_the_biggest() -> None:
    w, pr, clock = _watch(cap=GiB)

    def write(_t: float) -> None:
        u, _f = pr.tm["/tmp"]
        pr.tm["/tmp"] = (u + 30 * MiB, False)
        pr.tm["/dev/shm"] = (200 * MiB, False)

    why = _run_until_hit(w, clock, write)
    assert why is not None and why.endswith(": /tmp")
    # each tmpfs has the kernel's cap; their sum passes it by one look's growth at most
    assert GiB < pr.tm["/tmp"][0] + 200 * MiB <= GiB + 30 * MiB


def test_one_tmpfs_at_its_own_cap_is_the_kernels_business() -> None:
    """/tmp full at the cap (ENOSPC inside) with nothing else: the run goes on, and
    the full tmpfs is reported at its end."""
    w, pr, clock = _watch(cap=GiB)
    for used in (300 * MiB, 700 * MiB, GiB, GiB):
        pr.tm["/tmp"] = (used, used == GiB)
        clock.t = w.next_at
        assert w.tick() is None
    assert w.finish() == "disk limit 1G: /tmp full (ENOSPC)"


def test_nothing_written_nothing_ended_even_over_the_cap() -> None:
    """A session already over its cap still runs what does not write."""
    w, pr, clock = _watch(cap=GiB)
    pr.layer_bytes = 2 * GiB
    for _ in range(50):
        clock.t = w.next_at
        assert w.tick() is None
    pr.write_layers(MiB)
    clock.t = w.next_at + 3  # the next walk
    assert w.tick() is not None


def test_other_writers_on_the_host_never_end_the_run() -> None:
    """The filesystem's figures move with every process of the host: they only say
    when to walk; the run is ended on what its layers hold."""
    w, pr, clock = _watch(cap=GiB)
    pr.layer_bytes = 900 * MiB
    for _ in range(200):
        clock.t = w.next_at
        pr.fs_used += 200 * MiB  # someone else writes 2 GB/s
        pr.fs_free -= 200 * MiB
        assert w.tick() is None
    assert pr.walks > 2  # it did look


def test_after_a_hit_a_command_that_deletes_is_not_ended() -> None:
    """A living sandbox: the writer was killed near the cap; the next command deletes
    while the rest of the host writes. Its rate is the walks', and they show no growth."""
    w, pr, clock = _watch(cap=GiB)
    assert _run_until_hit(w, clock, lambda _t: pr.write_layers(20 * MiB)) is not None
    pr.layer_bytes -= 500 * MiB  # rm
    for _ in range(100):
        clock.t = w.next_at
        pr.fs_used += 50 * MiB  # the rest of the host
        assert w.tick() is None


def test_a_full_tmpfs_beside_a_small_layer_is_not_ended() -> None:
    w, pr, clock = _watch(cap=GiB)
    pr.layer_bytes = 8192  # a directory copied up
    pr.tm["/tmp"] = (GiB, True)
    clock.t = w.next_at
    assert w.tick() is None
    pr.tm["/dev/shm"] = (2 * MiB, False)  # but a second tmpfs on top of it is
    clock.t = w.next_at
    assert w.tick() == "disk limit 1G: /tmp"


def test_empty_files_past_the_inode_share_end_the_run() -> None:
    """300,000 empty files grow no blocks: the filesystem's used inodes say when to
    walk, and the walk's entries are held to the cap's inode share (a tmpfs's
    nr_inodes for the same size)."""
    w, pr, clock = _watch(cap=16 * MiB)
    assert w.inode_cap == planmod.TMPFS_MIN_INODES == 4096
    why = _run_until_hit(w, clock, lambda _t: pr.create_files(200))  # 20,000 a second
    assert why is not None, pr.entries
    assert why.startswith("disk limit 16M: the project's layers hold ") and why.endswith(
        " entries, the cap's inode share is 4,096"), why
    assert 4096 - 1000 <= pr.entries <= 4096, pr.entries  # before the share, not long before
    assert pr.layer_bytes == 0


def test_the_inode_share_scales_with_the_cap() -> None:
    w, _pr, _clock = _watch(cap=20 * GiB)
    assert w.inode_cap == 1_310_720
    w2, pr2, clock2 = _watch(cap=20 * GiB)
    pr2.entries = 1_310_000
    why = _run_until_hit(w2, clock2, lambda _t: pr2.create_files(100), limit=200)
    assert why is not None and why.endswith("entries, the cap's inode share is 1,310,720"), why


def test_many_entries_without_growth_are_not_ended() -> None:
    """A session already holding more entries than the share runs what creates none."""
    w, pr, clock = _watch(cap=16 * MiB)
    pr.entries = 10_000
    for _ in range(100):
        clock.t = w.next_at
        pr.fs_inodes_used += 1000  # the rest of the host
        assert w.tick() is None


def test_the_inode_floor_ends_a_run_creating_entries() -> None:
    w, pr, clock = _watch(cap=None, floor=GiB)
    pr.fs_inodes_total = 1_000_000
    pr.fs_inodes_used = 900_000  # the floor keeps min(5 %, 100,000) = 50,000
    assert diskwatch.inode_floor(pr.fs()) == 50_000  # type: ignore[arg-type]
    why = _run_until_hit(w, clock, lambda _t: pr.create_files(500))
    assert why is not None and why.startswith("disk floor 1G: the state dir's filesystem has "), why
    assert why.endswith("inodes free, the floor keeps 50,000"), why
    assert 50_000 <= 1_000_000 - pr.fs_inodes_used <= 50_000 + 5000, pr.fs_inodes_used


def test_the_inode_floor_is_capped_and_off_without_a_count() -> None:
    assert diskwatch.inode_floor(FsState(0, 0, 0, 0, 100_000_000)) == 100_000
    assert diskwatch.inode_floor(FsState(0, 0, 0, 0, 0)) == 0


def test_the_floor_ends_a_writing_run() -> None:
    w, pr, clock = _watch(cap=None, floor=GiB)
    pr.fs_free = 3 * GiB
    why = _run_until_hit(w, clock, lambda _t: pr.write_layers(50 * MiB))
    assert why is not None and why.startswith("disk floor 1G")
    assert pr.fs_free >= GiB - 50 * MiB


def test_the_floor_leaves_a_quiet_run_alone() -> None:
    w, pr, clock = _watch(cap=None, floor=GiB)
    pr.fs_free = GiB // 2  # the host is already under it: nothing this run writes
    for _ in range(30):
        clock.t = w.next_at
        assert w.tick() is None


def test_walks_are_bounded() -> None:
    """Quiet: one walk per WALK_EVERY seconds; a host that writes elsewhere does not
    make it walk on every look."""
    w, pr, clock = _watch(cap=100 * GiB)
    start = clock.t
    for _ in range(100):
        clock.t = w.next_at
        pr.fs_used += 10 * MiB  # another process of the host writes
        w.tick()
    elapsed = clock.t - start
    assert pr.walks <= elapsed / diskwatch.WALK_EVERY + 2


def test_full_tmpfs_is_reported_at_the_end() -> None:
    w, pr, _clock = _watch(cap=GiB)
    pr.tm["/tmp"] = (GiB, True)
    assert w.finish() == "disk limit 1G: /tmp full (ENOSPC)"


def test_tree_bytes_counts_blocks_and_hard_links_once(tmp_path: Path) -> None:
    d = tmp_path / "t"
    (d / "sub").mkdir(parents=True)
    with open(d / "sub" / "f", "wb") as f:
        f.write(b"x" * 100_000)
    os.link(d / "sub" / "f", d / "g")
    os.symlink("/usr", d / "link")
    n = diskwatch.tree_bytes(str(d))
    assert 100_000 <= n < 100_000 + 64 * 1024


def _swap_on_open(monkeypatch: pytest.MonkeyPatch, victim: Path, replace: object) -> list[str]:
    """Swap ``victim`` (already lstat'ed by the walk) just before the walk opens it."""
    real = diskwatch._open_dir
    done: list[str] = []

    def racing(name: str, parent_fd: int | None, key: tuple[int, int] | None) -> int | None:
        if name == victim.name and not done:
            done.append(name)
            replace()  # type: ignore[operator]
        return real(name, parent_fd, key)

    monkeypatch.setattr(diskwatch, "_open_dir", racing)
    return done


def _target(tmp_path: Path) -> Path:
    t = tmp_path / "host"
    (t / "a" / "b").mkdir(parents=True)
    (t / "a" / "b" / "big").write_bytes(b"x" * 2_000_000)
    return t


def test_a_directory_swapped_for_a_symlink_mid_walk_is_not_followed(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox renames a directory of its upper layer away and puts a symlink to a
    host tree in its place between the walk's lstat and its open: nothing of the
    target is counted (the walk runs as root on the host)."""
    target = _target(tmp_path)
    root = tmp_path / "upper"
    (root / "d").mkdir(parents=True)

    def swap() -> None:
        os.rename(root / "d", tmp_path / "moved")
        os.symlink(target, root / "d")

    done = _swap_on_open(monkeypatch, root / "d", swap)
    got = diskwatch.tree_usage(str(root))
    assert done == ["d"]
    assert got.bytes < 64 * 1024 and got.entries == 1, got  # the entry "d" itself


def test_a_directory_swapped_for_another_mid_walk_is_skipped(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    target = _target(tmp_path)
    root = tmp_path / "upper"
    (root / "d").mkdir(parents=True)

    def swap() -> None:
        os.rename(root / "d", tmp_path / "moved")
        os.rename(target, root / "d")  # (a bind mount of a host tree would do the same)

    _swap_on_open(monkeypatch, root / "d", swap)
    assert diskwatch.tree_usage(str(root)).bytes < 64 * 1024


def test_a_deep_tree_is_walked_with_few_fds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diskwatch, "MAX_OPEN_DEPTH", 4)
    d = tmp_path / "t"
    cur = d
    for i in range(40):
        cur = cur / f"d{i}"
    cur.mkdir(parents=True)
    (cur / "f").write_bytes(b"y" * 100_000)
    (d / "d0" / "g").write_bytes(b"z" * 100_000)
    before = len(os.listdir("/proc/self/fd"))
    peak = [0]
    real = diskwatch._open_dir

    def counting(name: str, parent_fd: int | None, key: tuple[int, int] | None) -> int | None:
        peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")) - before)
        return real(name, parent_fd, key)

    monkeypatch.setattr(diskwatch, "_open_dir", counting)
    got = diskwatch.tree_usage(str(d))
    assert got.entries == 40 + 2 and 200_000 <= got.bytes < 200_000 + 64 * 1024 * 4
    assert peak[0] <= 4 + 3, peak  # the open frames, a re-open's two, the listing's own
    assert len(os.listdir("/proc/self/fd")) == before  # nothing left open


def test_open_deleted_counts_a_childs_unlinked_files(tmp_path: Path) -> None:
    """A real process below ``init`` holds an unlinked file open: counted once (two fds
    of one inode), on its device only; descendants() finds a grandchild."""
    import subprocess
    import sys

    code = ("import os,sys,time\n"
            "f=open(sys.argv[1],'wb'); f.write(b'x'*3_000_000); f.flush(); os.unlink(sys.argv[1])\n"
            "g=os.dup(f.fileno()); print('ready', flush=True); time.sleep(30)\n")
    p = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$0" "$1"; :', code, str(tmp_path / "gone")],
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        dev = os.stat(tmp_path).st_dev
        assert len(diskwatch.descendants(p.pid)) == 2
        got = diskwatch.open_deleted(p.pid, frozenset({dev}))
        assert 3_000_000 <= got < 3_000_000 + 64 * 1024, got
        assert diskwatch.open_deleted(p.pid, frozenset({dev + 1})) == 0  # another device
    finally:
        for c in diskwatch.descendants(p.pid)[::-1]:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(c, signal.SIGKILL)
        p.wait()


def test_filesystem_of_and_mechanism(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw,relatime 0 0\n/dev/sdb1 /var/lib xfs rw,pquota 0 0\n")
    assert diskwatch.filesystem_of("/var/lib/x", str(mounts)) == ("/var/lib", "xfs", "rw,pquota")
    assert diskwatch.filesystem_of("/home", str(mounts))[1] == "ext4"
    assert "watchdog" in diskwatch.mechanism(str(tmp_path))


# --------------------------------------------------------------------------- outcomes


def test_classify_disk_hit_and_exit_status() -> None:
    o = cgbase.classify(-signal.SIGKILL, disk_hit="disk limit 10G: /tmp", limits=Limits.defaults())
    assert o.kind == "disk-limit-hit" and o.exit_status == cgbase.EXIT_DISK == 122
    assert o.summary().startswith("disk-limit-hit (disk limit 10G: /tmp), signaled(SIGKILL)")
    assert o.to_dict()["outcome"] == "disk-limit-hit"
    # timeout still wins; 122 is none of the run path's own statuses
    assert cgbase.classify(-9, timed_out=True, disk_hit="x").kind == "timeout"
    assert cgbase.EXIT_DISK not in (124, 125, 126, 127, 137)


def test_classify_full_tmpfs_survived_is_an_event() -> None:
    o = cgbase.classify(0, disk_full="disk limit 1G: /tmp full (ENOSPC)", limits=Limits(disk=GiB))
    assert o.kind == "exited" and o.exit_status == 0
    assert "events: disk-limit-hit: disk limit 1G: /tmp full (ENOSPC)" in o.summary()
    o = cgbase.classify(1, disk_full="disk limit 1G: /tmp full (ENOSPC)", limits=Limits(disk=GiB))
    assert o.kind == "disk-limit-hit" and o.exit_status == 122


def test_classify_sigxfsz_from_the_disk_cap() -> None:
    o = cgbase.classify(-signal.SIGXFSZ, limits=Limits(disk=GiB))
    assert o.kind == "disk-limit-hit" and "SIGXFSZ" in o.summary()
    # the user's own --max-file-size below the cap: their limit, not the disk's
    o = cgbase.classify(-signal.SIGXFSZ, limits=Limits(disk=GiB, max_file_size=MiB))
    assert o.kind == "signaled"


# --------------------------------------------------------------------------- explain


def test_explain_shows_the_disk_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade import explain

    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    proj = tmp_path / "p"
    proj.mkdir()
    out = explain.explain(args=["true"], project=str(proj), limits=Limits.defaults().replace(disk=2 * GiB))
    assert "disk           2G" in out
    assert "capped at 2G each" in out and "/tmp" in out
    assert "watchdog" in out
    assert f"size={2 * GiB}" in out


def test_doctor_says_how_this_host_holds_it(tmp_path: Path) -> None:
    from stockade.doctor import probe_disk

    p = probe_disk(tmp_path)
    assert p.name == "disk" and p.status == "info"
    assert "size= and nr_inodes=" in p.detail and "watchdog" in p.detail and "free" not in p.detail
    assert p.data["mechanism"] == "watchdog"


def test_the_default_floor_is_at_most_a_twentieth_of_a_small_filesystem() -> None:
    """A 1G tmpfs (the second kernel's state dir here) is not under the 1G default floor
    from the start; a floor given explicitly is kept as given; an unknown size keeps it."""
    g = 1024**3
    small = FsState(0, 900 * 1024**2, total=g)
    assert diskwatch.byte_floor(g, small, default=True) == g // 20
    assert diskwatch.byte_floor(g, small, default=False) == g
    assert diskwatch.byte_floor(g, FsState(0, 0, total=100 * g), default=True) == g
    assert diskwatch.byte_floor(g, FsState(0, 0), default=True) == g
    assert diskwatch.byte_floor(None, small, default=True) is None
