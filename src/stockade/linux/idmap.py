"""Which ids exist inside a sandbox: the user namespace's uid and gid maps.

A sandbox maps its user's id, and — where the host gives one — a range of 65,536
further ids, the way rootless container engines do, so that ``chown`` to another
id, ``setuid``, ``setgroups`` and GNU tar as root behave as on any machine:

* a real-root caller (the initial user namespace) takes its ids from the
  ``/etc/subuid`` and ``/etc/subgid`` entry of ``root`` when there is one, else
  from ``DEFAULT_ROOT_RANGE``, a block no distribution allocates (systemd's
  UIDS-GIDS.md leaves 1879048192–2147352575 unused); the map is written directly;
* an unprivileged caller takes its own ``/etc/subuid`` and ``/etc/subgid`` entry,
  written by the setuid helpers ``newuidmap``/``newgidmap`` (the only way an
  unprivileged process may map more than its own id);
* anyone else (root inside another user namespace, no entry, no helpers) keeps the
  single-id map, and ``stockade doctor`` says why.

Inside id k of the range is host id ``start + k``; the sandbox user's own id (and a
real root's mounter id, see plan._mounter_id) are single entries cut out of it.
"""

from __future__ import annotations

import os
import pwd
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxError

# inside ids 0..65535: what a distribution's users and groups occupy
SPAN = 65536
DEFAULT_ROOT_RANGE = (1879048192, SPAN)

Entry = tuple[int, int, int]  # (inside, outside, count), one line of uid_map


@dataclass(frozen=True)
class Range:
    """A block of host ids a sandbox may use for its other ids."""

    start: int
    count: int
    source: str  # where it came from: "/etc/subuid (root)", "built-in", ...
    helper: str | None = None  # newuidmap/newgidmap's path when it must write the map

    def outside(self, inside: int) -> int:
        return self.start + inside

    def inside(self, host: int) -> int | None:
        """The inside id a host id of this range stands for (None: not ours)."""
        k = host - self.start
        return k if 0 <= k < min(self.count, SPAN) else None


def _entries(path: Path, name: str, uid: int) -> list[tuple[int, int]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) != 3 or parts[0] not in (name, str(uid)):
            continue
        try:
            out.append((int(parts[1]), int(parts[2])))
        except ValueError:
            continue
    return out


def subordinate(kind: str, uid: int, etc: Path = Path("/etc")) -> tuple[int, int] | None:
    """The caller's first /etc/sub{uid,gid} entry with room for SPAN ids (``kind``:
    "uid" or "gid"; an entry names the user or its uid), else None."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    for start, count in _entries(etc / ("sub" + kind), name, uid):
        if count >= SPAN and start > 0:
            return (start, SPAN)
    return None


def initial_userns(proc: Path = Path("/proc")) -> bool:
    """True in the host's own user namespace (every id mapped onto itself)."""
    try:
        return (proc / "self" / "uid_map").read_text().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def setgroups_allowed(proc: Path = Path("/proc")) -> bool:
    """False where this user namespace (or an ancestor) has setgroups "deny", as after
    ``unshare -Ur`` or ``bwrap --unshare-user``: a sandbox's user may not call it."""
    try:
        return (proc / "self" / "setgroups").read_text().strip() == "allow"
    except OSError:
        return True  # kernels before 3.19 have no such file


def holds_setfcap(proc: Path = Path("/proc")) -> bool:
    """CAP_SETFCAP in this process's effective set: the kernel lets only its holder
    map the id 0 of the namespace it runs in into a new one (even as itself)."""
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 31 & 1)
    except (OSError, ValueError):
        pass
    return False


def ranges(euid: int, *, etc: Path = Path("/etc"), proc: Path = Path("/proc")) -> tuple[Range | None, Range | None, str]:
    """(uid range, gid range, why) for a caller. Both or neither: a sandbox with
    other uids but one gid (or the reverse) would fail half-way through tar."""
    if not initial_userns(proc):
        # newuidmap (and a root caller) can map only ids this namespace has, and a
        # subordinate range or a free block is not among them
        return None, None, (("root" if euid == 0 else "a user") + " inside another user namespace: only the ids "
                            "that namespace maps exist here, none of them free for a sandbox's other ids")
    if euid == 0:
        u, g = subordinate("uid", 0, etc), subordinate("gid", 0, etc)
        if u and g:
            return Range(*u, "/etc/subuid and /etc/subgid (root)"), Range(*g, "/etc/subuid and /etc/subgid (root)"), ""
        start, count = DEFAULT_ROOT_RANGE
        return Range(start, count, "built-in"), Range(start, count, "built-in"), ""
    u, g = subordinate("uid", euid, etc), subordinate("gid", euid, etc)
    if not (u and g):
        missing = " and ".join(f"/etc/sub{k}" for k, v in (("uid", u), ("gid", g)) if not v)
        return None, None, f"no entry of {SPAN} ids for this user in {missing}"
    nu, ng = shutil.which("newuidmap", path="/usr/bin:/bin:/usr/sbin:/sbin"), shutil.which("newgidmap", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if not (nu and ng):
        return None, None, "newuidmap/newgidmap are not installed (Debian/Ubuntu package: uidmap)"
    return Range(*u, f"/etc/subuid (uid {euid})", nu), Range(*g, f"/etc/subgid (uid {euid})", ng), ""


def build(singles: tuple[tuple[int, int], ...], rng: Range | None) -> tuple[Entry, ...]:
    """Map lines: each (inside, outside) single, then the range's inside ids 0..SPAN-1
    that no single took, in contiguous runs."""
    out: list[Entry] = [(i, o, 1) for i, o in singles]
    if rng is None:
        return tuple(out)
    taken = sorted({i for i, _ in singles if i < rng.count})
    lo = 0
    for cut in [*taken, min(rng.count, SPAN)]:
        if cut > lo:
            out.append((lo, rng.outside(lo), cut - lo))
        lo = cut + 1
    return tuple(out)


def write_with_helper(pid: int, helper: str, entries: tuple[Entry, ...], what: str) -> None:
    """Have newuidmap/newgidmap write /proc/PID/{uid,gid}_map (they check the entries
    against /etc/subuid, /etc/subgid)."""
    import subprocess  # only here: the run path of a single-id map never pays its import

    args = [helper, str(pid)] + [str(n) for e in entries for n in e]
    try:
        r = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=10, close_fds=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxError(f"run {helper} for /proc/{pid}/{what}", errno=getattr(e, "errno", None) or 0,
                           remedy=f"check that {helper} exists and is setuid root (Debian/Ubuntu package: uidmap)") from None
    if r.returncode != 0:
        msg = r.stderr.decode(errors="replace").strip().splitlines()
        raise SandboxError(
            f"{os.path.basename(helper)} {pid} {' '.join(args[2:])} (writing /proc/{pid}/{what}) failed: "
            + (msg[-1] if msg else f"exit status {r.returncode}"),
            remedy=f"check this user's entry in /etc/sub{what[:3]} (it needs {SPAN} ids) and that {helper} is setuid "
                   "root; or remove the entry to run with the single-id map")
