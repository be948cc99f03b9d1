"""--disk and --disk-floor against the real kernel, root and unprivileged, each CLI case
in-process and served: a large write into the project or /tmp stops near the cap (the
upper layer's real size read from the host), the tmpfs caps are the kernel's (read from
the sandbox's mount table on the host), the state dir's filesystem never falls under the
floor (a small tmpfs as the state dir, sampled from the host while the run writes), the
session stays usable, and bad input runs nothing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import User, need, umount_when_free

pytestmark = pytest.mark.cli_paths  # every CLI run here goes in-process and served

MiB = 1 << 20
GiB = 1 << 30


def upper_bytes(user: User, sid: str) -> int:
    """The session's upper layer's size on the host (st_blocks; as root: every inode)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(user.state / "sessions" / sid / "upper"):
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            total += st.st_blocks * 512
    return total


def run(user: User, project: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[bytes]:
    return user.cli(["run", *args], cwd=project, timeout=timeout)


def unique_sleep(seconds: int) -> tuple[str, bytes]:
    """A sleep this test alone runs (its duration is unique), and its /proc cmdline."""
    arg = f"{seconds}.{os.getpid() % 100000:05d}{threading.get_ident() % 1000:03d}"
    return f"sleep {arg}", b"sleep\0" + arg.encode() + b"\0"


def find_pid(cmdline: bytes) -> int | None:
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{d}/cmdline").read_bytes() == cmdline:
                    return int(d)
    return None


def _write_files(where: str, n: int, mib_each: int) -> str:
    """A shell loop writing ``n`` files of ``mib_each`` MiB (8 MiB blocks): many files,
    none above the cap (RLIMIT_FSIZE alone would stop a single one)."""
    count = mib_each // 8
    return (f"i=0; while [ $i -lt {n} ]; do dd if=/dev/zero of={where}/f$i bs=8M count={count} status=none "
            f"|| echo dd-failed >&2; i=$((i+1)); done; echo wrote-all")


def test_a_2g_write_into_the_project_stops_near_the_cap(user: User, project: Path) -> None:
    cap = 256 * MiB
    r = run(user, project, "--session", "dk1", "--disk", "256M", "--", "sh", "-c", _write_files(".", 16, 128))
    err = r.stderr.decode()
    assert r.returncode == 122, err
    assert b"wrote-all" not in r.stdout
    assert re.search(r"ended: disk-limit-hit \(disk limit 256M: the project's layers hold [\d.]+M\)", err), err
    held = upper_bytes(user, "dk1")
    # near the cap: it looks ahead at most 0.25 s of writes at their rate (GB/s into the
    # page cache here), and a loaded host's late look may let one look's writes through
    assert cap // 4 <= held <= cap + cap // 4, held
    # what it wrote stays reviewable, and the session is usable afterwards
    d = user.cli(["diff", "--session", "dk1", "--stat"], cwd=project, timeout=120)
    assert d.returncode == 0 and b"f0" in d.stdout, d.stderr.decode()
    again = run(user, project, "--session", "dk1", "--", "sh", "-c", "echo small > note.txt; cat note.txt")
    assert again.returncode == 0 and again.stdout == b"small\n", again.stderr.decode()
    rec = sorted((user.state / "sessions" / "dk1" / "runs").iterdir(), key=lambda p: int(p.name))[0] / "run.json"
    data = json.loads(rec.read_text())
    assert data["outcome_kind"] == "disk-limit-hit" and data["exit_code"] == 122
    assert data["disk"]["limit"] == cap and data["disk"]["hit"].startswith("disk limit 256M")


def test_a_2g_write_into_tmp_stops_at_the_cap(user: User, project: Path) -> None:
    """The kernel's cap (ENOSPC at size=); a command that then fails ends as
    disk-limit-hit, and what /tmp held is read from the host meanwhile."""
    sleep, cmdline = unique_sleep(2)
    script = ("i=0; while [ $i -lt 16 ]; do dd if=/dev/zero of=/tmp/f$i bs=8M count=16 status=none || break; "
              f"i=$((i+1)); done; {sleep}; exit 1")
    seen: list[int] = []
    done = threading.Event()

    def watch_tmp() -> None:  # from the host: the sandbox's /tmp, through its sleep's root
        while not done.is_set():
            pid = find_pid(cmdline)
            if pid is not None:
                with contextlib.suppress(OSError):
                    s = os.statvfs(f"/proc/{pid}/root/tmp")
                    seen.append((s.f_blocks - s.f_bfree) * s.f_frsize)
            time.sleep(0.05)

    t = threading.Thread(target=watch_tmp)
    t.start()
    try:
        r = run(user, project, "--session", "dk2", "--disk", "256M", "--", "sh", "-c", script)
    finally:
        done.set()
        t.join()
    err = r.stderr.decode()
    assert r.returncode == 122, err
    assert "disk-limit-hit (disk limit 256M: /tmp full (ENOSPC)), exited(1)" in err, err
    assert seen and 200 * MiB <= max(seen) <= 256 * MiB, seen
    assert upper_bytes(user, "dk2") < 8 * MiB  # /tmp is not the project's layer
    again = run(user, project, "--session", "dk2", "--", "sh", "-c", "df -k /tmp | tail -1")
    assert again.returncode == 0, again.stderr.decode()
    assert int(again.stdout.split()[2]) < 1024  # a fresh /tmp per run


def test_tmpfs_past_the_cap_together_end_the_run(user: User, project: Path) -> None:
    """Each tmpfs under the cap, their sum past it: the watchdog ends the run."""
    r = run(user, project, "--session", "dk4", "--disk", "128M", "--", "sh", "-c",
            "head -c 100000000 /dev/zero > /tmp/a; head -c 100000000 /dev/zero > /dev/shm/b; sleep 10; echo survived")
    err = r.stderr.decode()
    assert r.returncode == 122 and b"survived" not in r.stdout, err
    assert re.search(r"disk-limit-hit \(disk limit 128M: (/tmp|/dev/shm)\), signaled\(SIGKILL\)", err), err


def upper_entries(user: User, sid: str) -> int:
    return sum(len(d) + len(f) for _p, d, f in os.walk(user.state / "sessions" / sid / "upper"))


def test_many_empty_files_end_at_the_inode_share(user: User, project: Path) -> None:
    """Empty files grow no blocks: the layers are held to the cap's inode share (a
    tmpfs's nr_inodes for the same size: 4,096 for 16M), counted from the host."""
    r = run(user, project, "--session", "dk5", "--disk", "16M", "--", "sh", "-c",
            "mkdir many; i=0; while [ $i -lt 30000 ]; do : > many/f$i || exit 3; i=$((i+1)); done; echo wrote-all")
    err = r.stderr.decode()
    assert r.returncode == 122 and b"wrote-all" not in r.stdout, err
    assert re.search(r"ended: disk-limit-hit \(disk limit 16M: the project's layers hold [\d,]+ entries, "
                     r"the cap's inode share is 4,096\)", err), err
    held = upper_entries(user, "dk5")
    # near the share: a loaded host's late look may let one look's files through
    assert 1024 <= held <= 4096 + 4096, held


def test_deleted_files_held_open_count(user: User, project: Path) -> None:
    """Files opened, unlinked, then written: no walk sees them, yet they fill the host's
    disk until closed. The watchdog reads the sandbox's open files from /proc (st_nlink
    0 on the project's overlay) and ends the run near the cap."""
    opens = "; ".join(f"exec {fd}>g{fd}; rm g{fd}; head -c 26214400 /dev/zero >&{fd} || echo short >&2"
                      for fd in range(3, 10))  # 7 x 25 MiB, each under the cap alone
    r = run(user, project, "--session", "dk6", "--disk", "30M", "--", "sh", "-c", f"{opens}; sleep 4; echo survived")
    err = r.stderr.decode()
    assert r.returncode == 122 and b"survived" not in r.stdout, err
    m = re.search(r"ended: disk-limit-hit \(disk limit 30M: the project's layers hold ([\d.]+)M "
                  r"\(([\d.]+)M of it in deleted files still open\)\)", err)
    assert m is not None, err
    # near the cap, not 175M: early by up to one look ahead, or late by what one look
    # lets through at GB/s into the page cache (one 25M file here)
    assert 0 < float(m.group(2)) <= float(m.group(1)) <= 30 + 32, err
    assert err.count("short") <= 6, err  # killed while writing, not after all of it


def test_deleted_files_still_mapped_count(user: User, project: Path) -> None:
    """Mapped, closed, unlinked, then written through the mapping: no fd is left, the
    mapping is read through /proc/PID/map_files (root's: the kernel lets no one else)."""
    if user.name != "root":
        pytest.skip("/proc/PID/map_files needs CAP_CHECKPOINT_RESTORE in the host's namespace")
    code = ("import mmap, os, time\n"
            "ms = []\n"
            "for i in range(4):\n"
            "    f = open(f'm{i}', 'w+b'); f.truncate(16 << 20); m = mmap.mmap(f.fileno(), 16 << 20)\n"
            "    f.close(); os.unlink(f'm{i}'); ms.append(m)\n"
            # (mmap keeps a dup of the fd: closed, only the mapping is left)
            "    for n in os.listdir('/proc/self/fd'):\n"
            "        try:\n"
            "            if os.readlink(f'/proc/self/fd/{n}').endswith(f'/m{i} (deleted)'): os.close(int(n))\n"
            "        except OSError: pass\n"
            "    for o in range(0, 16 << 20, 1 << 20): m[o:o + (1 << 20)] = b'x' * (1 << 20)\n"
            "time.sleep(4); print('survived')\n")
    r = run(user, project, "--session", "dk7", "--disk", "30M", "--", "python3", "-c", code)
    err = r.stderr.decode()
    assert r.returncode == 122 and b"survived" not in r.stdout, err
    assert re.search(r"ended: disk-limit-hit \(disk limit 30M: the project's layers hold [\d.]+M "
                     r"\([\d.]+M of it in deleted files still open\)\)", err), err


@pytest.mark.vm
def test_a_full_tmpfs_survived_is_reported(user: User, project: Path) -> None:
    """The command gets ENOSPC inside, handles it and exits 0: the run goes on (one
    tmpfs at its own cap is the kernel's), and the summary still says the cap was reached."""
    r = run(user, project, "--session", "dk3", "--disk", "64M", "--", "sh", "-c",
            "head -c 100000000 /dev/zero > /dev/shm/big 2>/dev/null; sleep 0.5; echo handled")
    err = r.stderr.decode()
    assert r.returncode == 0 and r.stdout == b"handled\n", err
    assert "ended: exited(0)" in err and "events: disk-limit-hit: disk limit 64M: /dev/shm full (ENOSPC)" in err, err
    data = json.loads((user.state / "sessions" / "dk3" / "runs" / "1" / "run.json").read_text())
    assert data["outcome_kind"] == "exited" and data["disk"]["full"] == ["/dev/shm"]


@pytest.mark.vm
def test_the_tmpfs_caps_are_the_kernels(user: User, project: Path) -> None:
    """From the host: every tmpfs the sandbox can write has size= and nr_inodes=."""
    sleep, cmdline = unique_sleep(60)
    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--disk", "96M", "--", *sleep.split()],
                         cwd=project, env=user.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid = None
        deadline = time.monotonic() + 60
        while pid is None and time.monotonic() < deadline:
            pid = find_pid(cmdline)
            time.sleep(0.05)
        assert pid is not None, "the sandboxed sleep never started"
        mounts = Path(f"/proc/{pid}/mounts").read_text().splitlines()
        rw_tmpfs = {}
        for line in mounts:
            _src, target, fstype, opts = line.split()[:4]
            if fstype == "tmpfs" and "rw" in opts.split(","):
                rw_tmpfs[target] = opts
        assert {"/tmp", "/var/tmp", "/run", "/dev/shm"} <= set(rw_tmpfs), rw_tmpfs
        for target, opts in rw_tmpfs.items():
            size = re.search(r"size=(\d+)k", opts)
            assert size is not None and int(size.group(1)) * 1024 <= 96 * MiB, (target, opts)
            assert "nr_inodes=" in opts, (target, opts)
    finally:
        p.kill()
        p.wait(timeout=30)


@contextlib.contextmanager
def _small_state(user: User, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` as the state dir (root mounts it; unmounted at the end)."""
    need(os.geteuid() == 0, "mounting a small filesystem needs root")
    at = user.home / "small-state"
    at.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(at)], capture_output=True)
    need(r.returncode == 0, f"cannot mount a tmpfs: {r.stderr.decode(errors='replace').strip()}")
    try:
        os.chown(at, user.uid, user.gid)
        yield at
    finally:
        umount_when_free(at, at)


def test_the_floor_is_never_crossed(user: User, project: Path) -> None:
    floor = 256 * MiB
    with _small_state(user, "768M") as state:
        env = {"STOCKADE_STATE_DIR": str(state)}
        lowest = [os.statvfs(state).f_bavail * os.statvfs(state).f_frsize]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                s = os.statvfs(state)
                lowest[0] = min(lowest[0], s.f_bavail * s.f_frsize)
                time.sleep(0.002)

        t = threading.Thread(target=sample)
        t.start()
        try:
            r = user.cli(["run", "--session", "fl", "--disk", "none", "--disk-floor", "256M", "--", "sh", "-c",
                          _write_files(".", 16, 64)], cwd=project, env=env, timeout=180)
        finally:
            done.set()
            t.join()
        err = r.stderr.decode()
        assert r.returncode == 122, err
        assert "disk-limit-hit (disk floor 256M: the state dir's filesystem has" in err, err
        assert "warning: --disk none: nothing caps what the sandbox writes" in err, err
        # (a tmpfs fills at RAM speed, a worst case: on a loaded host one late look of the
        # watchdog may let some tens of MB through)
        assert lowest[0] >= floor - 64 * MiB, lowest[0]
        # still usable: a run that writes nothing, and the change set
        again = user.cli(["run", "--session", "fl", "--", "true"], cwd=project, env=env, timeout=120)
        assert again.returncode == 0, again.stderr.decode()
        d = user.cli(["diff", "--session", "fl", "--stat"], cwd=project, env=env, timeout=120)
        assert d.returncode == 0 and b"f0" in d.stdout, d.stderr.decode()
        shutil.rmtree(state / "sessions", ignore_errors=True)


def test_bad_input_runs_nothing(user: User, project: Path) -> None:
    r = run(user, project, "--disk", "10XB", "--", "sh", "-c", "echo ran")
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1 and "--disk: invalid value '10XB'" in err, err
    assert r.stdout == b""
    sessions = user.state / "sessions"
    assert not sessions.exists() or not [p for p in sessions.iterdir() if not p.name.startswith(".")]
    # a cap below what the session already holds: both figures named, nothing run
    w = run(user, project, "--session", "held", "--", "sh", "-c", "head -c 3000000 /dev/zero > blob")
    assert w.returncode == 0, w.stderr.decode()
    runs = sorted(os.listdir(sessions / "held" / "runs"))
    r = run(user, project, "--session", "held", "--disk", "1M", "--", "sh", "-c", "echo ran")
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert re.fullmatch(r"stockade: --disk 1M is smaller than the [\d.]+M session held already holds in its layers; "
                        r"raise it, or drop its changes \(stockade discard --session held\)\n", err), err
    assert r.stdout == b"" and sorted(os.listdir(sessions / "held" / "runs")) == runs


def test_a_directory_the_caller_cannot_read_is_counted(user: User, subids: int, project: Path) -> None:
    """Unprivileged with a subordinate range: root inside gives a directory to another id
    with mode 0700; on the host the caller cannot enter it, and the watchdog's walk
    (with the sandbox's ids) still counts what is written there."""
    if user.name == "root":
        pytest.skip("the subordinate-range case is the unprivileged caller's")
    script = "mkdir hide && chown 1000:1000 hide && chmod 700 hide && " + _write_files("hide", 8, 64)
    r = run(user, project, "--session", "rng", "--root", "--disk", "128M", "--", "sh", "-c", script)
    err = r.stderr.decode()
    assert r.returncode == 122, err
    assert "disk-limit-hit (disk limit 128M: the project's layers hold" in err, err
    hide = user.state / "sessions" / "rng" / "upper" / "hide"
    assert hide.stat().st_uid == subids + 1000
    assert upper_bytes(user, "rng") <= 128 * MiB + 32 * MiB  # (read as root)


def test_the_config_sets_it(user: User, project: Path) -> None:
    cfg = project / ".stockade.toml"
    cfg.write_text('limits = { disk = "96M" }\n')
    user.own(cfg)
    r = run(user, project, "--session", "cfg", "--", "sh", "-c", _write_files(".", 8, 64))
    err = r.stderr.decode()
    assert r.returncode == 122 and "disk-limit-hit (disk limit 96M" in err, err
    cfg.write_text('limits = { disk = "10XB" }\n')
    r = run(user, project, "--", "sh", "-c", "echo ran")
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b"" and err.count("\n") == 1, err
    assert re.match(r"stockade: \S*\.stockade\.toml:1: limits\.disk: invalid value '10XB'", err), err


def test_living_sandbox_has_the_same_cap(user: User, project: Path) -> None:
    r = user.cli(["start", "--name", "lvd", "--disk", "192M"], cwd=project, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    try:
        e = user.cli(["exec", "lvd", "--", "sh", "-c", _write_files(".", 8, 64)], cwd=project, timeout=120)
        err = e.stderr.decode()
        assert e.returncode == 122, err
        assert "disk-limit-hit (disk limit 192M" in err, err
        assert upper_bytes(user, "lvd") <= 192 * MiB + 48 * MiB
        ok = user.cli(["exec", "lvd", "--", "sh", "-c", "rm -f f*; echo still-here"], cwd=project, timeout=60)
        assert ok.returncode == 0 and ok.stdout == b"still-here\n", ok.stderr.decode()
    finally:
        user.cli(["stop", "lvd"], timeout=60)


def test_api_result_says_disk_limit_hit(user: User, project: Path) -> None:
    code = (
        "import stockade, sys\n"
        "from stockade import Limits\n"
        "r = stockade.run(['sh', '-c', 'i=0; while [ $i -lt 8 ]; do head -c 67108864 /dev/zero > f$i; i=$((i+1)); done'],"
        " project='.', limits=Limits(disk=128 << 20), capture_output=True)\n"
        "print(r.outcome_kind, r.exit_status, r.disk)\n"
    )
    r = user.py(code, cwd=project, timeout=180)
    assert r.returncode == 0, r.stderr.decode()
    kind, status, *what = r.stdout.decode().split()
    assert kind == "disk-limit-hit" and status == "137", r.stdout
    assert " ".join(what).startswith("disk limit 128M"), r.stdout


@pytest.mark.slow
def test_the_default_cap_holds_a_large_write(user: User, project: Path) -> None:
    """At the real default (10G), when this disk has room: 12 GiB written into the
    project stops near 10 GiB."""
    from stockade.cgroups.base import DEFAULT_DISK, DEFAULT_DISK_FLOOR

    s = os.statvfs(user.state.parent)
    if s.f_bavail * s.f_frsize <= DEFAULT_DISK + DEFAULT_DISK_FLOOR + 20 * GiB:
        # room on a disk is the host's, not a kernel feature: a skip even under STOCKADE_MUST_WORK
        pytest.skip("the disk has no room for a write at the default cap")
    if user.name != "root" or user.path == "served":
        pytest.skip("once is enough for 10 GiB of writes (root, in-process)")
    r = run(user, project, "--session", "dflt", "--", "sh", "-c", _write_files(".", 12, 1024), timeout=600)
    err = r.stderr.decode()
    assert r.returncode == 122, err
    assert "disk-limit-hit (disk limit 10G" in err, err
    held = upper_bytes(user, "dflt")
    assert 8 * GiB <= held <= DEFAULT_DISK + 64 * MiB, held
    shutil.rmtree(user.state / "sessions" / "dflt", ignore_errors=True)
