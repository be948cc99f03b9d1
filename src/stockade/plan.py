"""The Plan: pure, frozen data describing one sandboxed run, and build(), the one
place where a request and policy become mechanism.

Nothing here touches the kernel. ``build`` reads a few host facts (cached per
process), so plans can be unit-tested without privileges and printed by
``stockade explain``.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import pwd
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SandboxError, UsageError
from .linux import idmap
from .linux.idmap import Range
from .pathsig import RACY_NS
from .sandbox_fs import (
    CONNECT_PATH,
    DEVICES,
    DNS_PORT,
    ETC_ALLOW,
    PROC_MASKED,
    PROC_MASKED_DIRS,
    PROC_READONLY,
    PROXY_PORT,
    PROXY_URL,
    SOCKS_URL,
    system_layout,
)

# ---------------------------------------------------------------------------
# data

NAMESPACES = ("user", "mount", "pid", "net", "ipc", "uts", "cgroup")


@dataclass(frozen=True)
class MountOp:
    """One step of building the sandbox's filesystem, executed in order by csrc/mounts.c.

    ``target`` is a path inside the sandbox; ``source`` a host path (or, with
    ``source_in_sandbox``, a path already mounted in the sandbox).
    """

    kind: str  # bind tmpfs overlay proc devpts mqueue mkdir symlink file remount-ro
    target: str
    source: str | None = None
    data: str | bytes | None = None
    flags: frozenset[str] = frozenset()  # ro rec optional dev file noexec
    mode: int = 0
    lower: tuple[str, ...] = ()  # overlay: lower dirs, top first
    upper: str | None = None
    work: str | None = None
    source_in_sandbox: bool = False
    source_in_stage: bool = False  # the staging tmpfs (its /empty), reachable after detach-host
    why: str = ""

    def describe(self) -> str:
        fl = ",".join(sorted(self.flags))
        fl = f" [{fl}]" if fl else ""
        if self.kind == "bind":
            src = f"(sandbox){self.source}" if self.source_in_sandbox else f"(stage){self.source}" if self.source_in_stage else self.source
            s = f"bind     {src} -> {self.target}{fl}"
        elif self.kind == "overlay":
            low = ":".join(self.lower)
            s = f"overlay  {self.target} lower={low}"
            if self.upper:
                s += f" upper={self.upper}"
        elif self.kind == "symlink":
            s = f"symlink  {self.target} -> {self.data!s}"
        elif self.kind == "file":
            n = len(self.data or b"")
            s = f"file     {self.target} ({n} bytes, mode {self.mode:o})"
        elif self.kind in ("tmpfs", "devpts"):
            opts = self.data.decode() if isinstance(self.data, bytes) else self.data
            s = f"{self.kind:<8} {self.target} ({opts}){fl}"
        else:
            s = f"{self.kind:<8} {self.target}{fl}"
        if self.why:
            s += f"    # {self.why}"
        return s


@dataclass(frozen=True)
class IdMap:
    """One user namespace map (linux/idmap.py decides what it holds)."""

    entries: tuple[tuple[int, int, int], ...]  # (inside, outside, count) lines
    # newuidmap/newgidmap's path when they must write it (an unprivileged caller's
    # subordinate range); None: the parent writes it itself
    helper: str | None = None

    def line(self) -> str:
        return "".join(f"{i} {o} {n}\n" for i, o, n in self.entries)

    def ranged(self) -> bool:
        """More ids than the singles: a range of other ids is mapped."""
        return any(n > 1 for _i, _o, n in self.entries)


@dataclass(frozen=True)
class LandlockPlan:
    abi: int
    handled_fs: int
    handled_net: int
    scoped: int
    rules: tuple[tuple[str, int, bool], ...]  # (sandbox path, access, optional)
    bind_ports: tuple[int, ...] = ()
    connect_ports: tuple[int, ...] = ()
    # observe mode on ABI 7+: landlock_restrict_self(LOG_NEW_EXEC_ON), so the command's
    # denials (after init's execve) reach the kernel audit stream (linux/audit_netlink.py)
    log_denials: bool = False

    @property
    def restrict_flags(self) -> int:
        return LL_RESTRICT_SELF_LOG_NEW_EXEC_ON if self.log_denials and self.abi >= 7 else 0


@dataclass(frozen=True)
class Plan:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str
    project: str
    uid: int
    gid: int
    user_name: str
    home: str
    uid_map: IdMap
    gid_map: IdMap
    deny_setgroups: bool
    drop_groups: bool
    namespaces: tuple[str, ...]
    hostname: str
    mounts: tuple[MountOp, ...]
    rlimits: tuple[tuple[int, int, int], ...] = ()
    landlock: LandlockPlan | None = None
    seccomp_name: str | None = None
    seccomp_bpf: bytes = b""
    keep_fds: tuple[int, ...] = ()
    network: str = "none"
    forward: tuple[int, ...] = ()  # host loopback ports reached through the proxy's listeners (net/)
    read_only: bool = False
    hidden: tuple[str, ...] = ()
    degraded: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # variables passed in that name a host path the sandbox does not show (run summary)
    env_warnings: tuple[str, ...] = ()
    # capabilities root inside keeps in its own user namespace (KEEP_CAPS), only
    # where a range of other ids is mapped and no host id but its own and the range's
    keep_caps: tuple[str, ...] = ()
    # the tmpfs mounts the sandbox can write (sandbox paths; the disk watchdog adds them
    # up) and the size= each has (None: no --disk)
    writable_tmpfs: tuple[str, ...] = ()
    tmpfs_size: int | None = None

    @property
    def path_env(self) -> str:
        return dict(self.env).get("PATH", "/usr/local/bin:/usr/bin:/bin")

    def describe(self) -> str:
        out: list[str] = []
        from .redact import record_argv

        out.append(f"command:     {' '.join(record_argv(self.argv))}")
        out.append(f"project:     {self.project}" + (" (read-only)" if self.read_only else " (copy-on-write overlay)"))
        out.append(f"cwd:         {self.cwd}")
        out.append(f"namespaces:  {' '.join(self.namespaces)}")
        out.append(
            f"identity:    uid {self.uid} gid {self.gid} ({self.user_name}), home {self.home}; "
            f"uid_map '{self.uid_map.line().strip().replace(chr(10), ', ')}', gid_map '{self.gid_map.line().strip().replace(chr(10), ', ')}'"
        )
        out.append(f"hostname:    {self.hostname or '(kept: --allow-degraded hostname)'}")
        out.append(f"network:     {network_line(self.network, self.forward)}")
        out.append("mounts (in order):")
        for i, m in enumerate(self.mounts):
            out.append(f"  {i:3d} {m.describe()}")
        out.append("environment:")
        for k, v in self.env:
            out.append(f"  {k}={v}")
        if self.rlimits:
            import resource

            names = {getattr(resource, n): n for n in dir(resource) if n.startswith("RLIMIT_")}
            out.append("rlimits:     " + ", ".join(f"{names.get(r, r)}={s}" for r, s, _ in self.rlimits))
        if self.landlock:
            ll = self.landlock
            out.append(f"landlock:    ABI {ll.abi}, fs rights 0x{ll.handled_fs:x}, net 0x{ll.handled_net:x}, scoped 0x{ll.scoped:x}")
            if ll.restrict_flags:
                out.append("  denials logged (landlock_restrict_self LOG_NEW_EXEC_ON: observe mode reads the "
                           "kernel's audit records of them while kernel audit is on)")
            for p, acc, _opt in ll.rules:
                out.append(f"  allow 0x{acc:05x} beneath {p}")
        else:
            out.append("landlock:    off")
        out.append(f"seccomp:     {self.seccomp_name or 'off'}" + (f" ({len(self.seccomp_bpf) // 8} BPF instructions)" if self.seccomp_bpf else ""))
        if self.keep_caps:
            out.append(f"privileges:  root inside keeps {', '.join(self.keep_caps)} in its own user namespace only "
                       "(other ids are the mapped range; no host id but its own); the rest dropped, bounding set "
                       "cut to these, securebits locked, no_new_privs")
        else:
            out.append("privileges:  all capabilities dropped, bounding set cleared, securebits locked, no_new_privs")
        if self.keep_fds:
            out.append(f"passed fds:  {', '.join(map(str, self.keep_fds))}")
        if self.hidden:
            out.append("hidden:      " + ", ".join(self.hidden))
        if self.degraded:
            out.append("DEGRADED:    " + ", ".join(self.degraded))
        for n in self.notes:
            out.append(f"note:        {n}")
        for w in self.env_warnings:
            out.append(f"warning:     {w}")
        return "\n".join(out)


# ---------------------------------------------------------------------------
# host facts (cached per process: the run path must stay lean)

ETC_MAX_COPY = 1 << 20

# The pieces of /sys the sandbox sees, read-only; the rest of /sys is absent. Each is
# read by common programs and shows nothing of the host but its hardware's shape and
# a kernel policy value; the ones left out are listed in the README (filesystem view).
SYS_EXPOSED = (
    ("/sys/devices/system/cpu", "CPU topology, online/possible: lscpu, sysconf(_SC_NPROCESSORS_*), OpenMP, hwloc"),
    ("/sys/devices/system/node", "NUMA topology: lscpu, libnuma, hwloc, JVM"),
    ("/sys/kernel/mm/transparent_hugepage", "THP policy: jemalloc, glibc malloc, databases read it at start"),
)


@dataclass(frozen=True)
class HostFacts:
    euid: int
    egid: int
    system: tuple[tuple[str, str | None], ...]  # (path, symlink target or None for a dir)
    etc: tuple[tuple[str, str, str | bytes], ...]  # (name, kind file|symlink|dir, data)
    proc_entries: frozenset[str]
    landlock_abi: int
    # root that may map any id and call setgroups: real root, or a rootless
    # container's root; not root after `unshare -Ur` (setgroups "deny", one id)
    privileged: bool = False
    # may map its own id when that is 0 (CAP_SETFCAP): not root under `bwrap --uid 0`
    maps_root: bool = True
    # the sandbox's other ids (linux/idmap.py): both or neither, with why not
    uid_range: Range | None = None
    gid_range: Range | None = None
    range_why: str = ""


_etc_cache: dict[str, tuple[tuple[int, int], tuple[str, str, str | bytes] | None]] = {}


def _etc_entry(name: str, extra: bool = False) -> tuple[str, str, str | bytes] | None:
    path = "/etc/" + name
    try:
        st = os.lstat(path)
    except OSError:
        return None
    key = (st.st_mtime_ns, st.st_size)
    hit = _etc_cache.get(path)
    if hit and hit[0] == key:
        return hit[1]
    entry: tuple[str, str, str | bytes] | None
    if stat.S_ISLNK(st.st_mode):
        entry = (name, "symlink", os.readlink(path))
    elif stat.S_ISDIR(st.st_mode):
        entry = (name, "dir", "")
    elif stat.S_ISREG(st.st_mode) and st.st_size <= ETC_MAX_COPY:
        try:
            with open(path, "rb") as f:
                entry = (name, "file", f.read())
        except OSError:
            entry = None  # unreadable for this user: leave it out
    elif stat.S_ISREG(st.st_mode):
        entry = (name, "bindfile", "")
    else:
        entry = None
    _etc_cache[path] = (key, entry)
    return entry


# etc_extra -> (/etc's identity, [(path, identity) of the regular files copied], facts)
_facts_memo: dict[tuple[str, ...], tuple[tuple[int, int, int], list[tuple[str, tuple[int, int, int, int]]], HostFacts]] = {}


def _dir_sig(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


FactsSig = tuple[tuple[int, int, int], tuple[tuple[str, tuple[int, int, int, int]], ...]]


def facts_sig(etc_extra: Sequence[str] = ()) -> FactsSig | None:
    """What the memoised host facts for ``etc_extra`` were taken from: /etc's signature
    and each copied file's (a prepared-run cache revalidates against it); None when no
    facts are memoised for it (they were taken too close to a change of /etc)."""
    hit = _facts_memo.get(tuple(etc_extra))
    return None if hit is None else (hit[0], tuple(hit[1]))


def host_facts(etc_extra: Sequence[str] = ()) -> HostFacts:
    """The host facts a plan depends on; the same object while they are unchanged.

    /etc's entries appear, vanish or change type only through its directory (its
    mtime changes); the content of the files copied in can change in place, so
    those are checked one by one."""
    key = tuple(etc_extra)
    etc_sig = _dir_sig("/etc")
    hit = _facts_memo.get(key)
    euid, egid = os.geteuid(), os.getegid()
    if hit is not None and etc_sig is not None and hit[0] == etc_sig and hit[2].euid == euid and hit[2].egid == egid:
        for path, sig in hit[1]:
            try:
                st = os.lstat(path)
                now = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            except OSError:
                now = (0, 0, 0, 0)
            if now != sig:
                break
        else:
            return hit[2]
    started = time.time_ns()
    etc = []
    files: list[tuple[str, tuple[int, int, int, int]]] = []
    # etc.extra entries are absolute (/etc/NAME); ETC_ALLOW's are names
    for name in (*ETC_ALLOW, *(e.removeprefix("/etc/") for e in etc_extra)):
        e = _etc_entry(name)
        if e is not None:
            etc.append(e)
            if e[1] == "file":
                try:
                    st = os.lstat("/etc/" + name)
                except OSError:
                    continue
                files.append(("/etc/" + name, (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)))
    for sub in ("/etc/subuid", "/etc/subgid"):  # edited in place by hand
        try:
            st = os.lstat(sub)
            files.append((sub, (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)))
        except OSError:
            files.append((sub, (0, 0, 0, 0)))
    uid_range, gid_range, range_why = idmap.ranges(euid)
    facts = HostFacts(
        euid=euid,
        egid=egid,
        system=system_layout(),
        etc=tuple(etc),
        proc_entries=_proc_entries(),
        landlock_abi=landlock_abi(),
        privileged=euid == 0 and idmap.setgroups_allowed(),
        maps_root=euid != 0 or idmap.holds_setfcap(),
        uid_range=uid_range,
        gid_range=gid_range,
        range_why=range_why,
    )
    # a directory changed within the timestamp granularity may change again unseen
    if etc_sig is not None and etc_sig[1] < started - RACY_NS and _dir_sig("/etc") == etc_sig:
        if len(_facts_memo) > 16:
            _facts_memo.clear()
        _facts_memo[key] = (etc_sig, files, facts)
    return facts


@functools.lru_cache(maxsize=1)
def _proc_entries() -> frozenset[str]:
    try:
        return frozenset(os.listdir("/proc"))
    except OSError:
        return frozenset()


@functools.lru_cache(maxsize=1)
def landlock_abi() -> int:
    from .linux import native

    return native.landlock_abi()


_LOADER_GLOBS = ("ld-linux*.so*", "ld64.so*", "ld-musl-*.so*")
_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")


def _pt_interp(path: str) -> str | None:
    """The ELF interpreter (PT_INTERP) a 64- or 32-bit little-endian binary names."""
    import struct

    try:
        with open(path, "rb") as f:
            h = f.read(64)
            if len(h) < 52 or h[:4] != b"\x7fELF" or h[5] != 1:
                return None
            wide = h[4] == 2
            phoff, phsz, phnum = (struct.unpack_from("<Q", h, 32)[0], *struct.unpack_from("<HH", h, 54)) if wide else (
                struct.unpack_from("<I", h, 28)[0], *struct.unpack_from("<HH", h, 42))
            f.seek(phoff)
            table = f.read(phsz * phnum)
            for i in range(phnum):
                e = table[i * phsz:(i + 1) * phsz]
                if len(e) < 16 or struct.unpack_from("<I", e, 0)[0] != 3:  # PT_INTERP
                    continue
                if wide:
                    off = struct.unpack_from("<Q", e, 8)[0]
                    size = struct.unpack_from("<Q", e, 32)[0]
                else:
                    off = struct.unpack_from("<I", e, 4)[0]
                    size = struct.unpack_from("<I", e, 16)[0]
                f.seek(off)
                return f.read(size).rstrip(b"\0").decode()
    except (OSError, UnicodeDecodeError, struct.error):
        return None
    return None


@functools.lru_cache(maxsize=1)
def elf_loaders() -> tuple[str, ...]:
    """The host's dynamic loaders (resolved): every dynamically linked program is
    started by one, so an exec allowlist without them runs nothing (the kernel opens
    the loader for execution). Found by their standard names in the library dirs and
    as the PT_INTERP of the shell and env."""
    import glob

    found: set[str] = set()
    for d in _LIB_DIRS:
        for sub in (d, d + "/*-linux-*"):
            for pat in _LOADER_GLOBS:
                found.update(glob.glob(os.path.join(sub, pat)))
    for b in ("/bin/sh", "/usr/bin/env"):
        interp = _pt_interp(b)
        if interp:
            found.add(interp)
    out = set()
    for p in found:
        r = os.path.realpath(p)
        if os.path.isfile(r):
            out.add(r)
    return tuple(sorted(out))


# ---------------------------------------------------------------------------
# Landlock access rights (include/uapi/linux/landlock.h)

LL_EXECUTE = 1 << 0
LL_WRITE_FILE = 1 << 1
LL_READ_FILE = 1 << 2
LL_READ_DIR = 1 << 3
LL_REMOVE_DIR = 1 << 4
LL_REMOVE_FILE = 1 << 5
LL_MAKE_CHAR = 1 << 6
LL_MAKE_DIR = 1 << 7
LL_MAKE_REG = 1 << 8
LL_MAKE_SOCK = 1 << 9
LL_MAKE_FIFO = 1 << 10
LL_MAKE_BLOCK = 1 << 11
LL_MAKE_SYM = 1 << 12
LL_REFER = 1 << 13  # ABI 2
LL_TRUNCATE = 1 << 14  # ABI 3
LL_IOCTL_DEV = 1 << 15  # ABI 5
LL_NET_BIND_TCP = 1 << 0  # ABI 4
LL_NET_CONNECT_TCP = 1 << 1
LL_SCOPE_ABSTRACT_UNIX = 1 << 0  # ABI 6
LL_SCOPE_SIGNAL = 1 << 1
LL_RESTRICT_SELF_LOG_NEW_EXEC_ON = 1 << 1  # ABI 7: landlock_restrict_self's flag


def landlock_fs_rights(abi: int) -> int:
    """Every filesystem right the ABI knows (the kernel documentation's degradation table)."""
    rights = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        rights |= LL_REFER
    if abi >= 3:
        rights |= LL_TRUNCATE
    if abi >= 5:
        rights |= LL_IOCTL_DEV
    return rights


def network_line(network: str, forward: tuple[int, ...]) -> str:
    if network == "allow":
        line = (f"allow: own network namespace with only lo; the host-side proxy listens inside on "
                f"127.0.0.1:{PROXY_PORT} (HTTP CONNECT, absolute-URI HTTP, SOCKS5) and answers DNS on "
                f"127.0.0.1:{DNS_PORT} for allowlisted names only")
    elif network == "none":
        line = "none: own network namespace with only lo"
    else:
        line = "host: the host's network namespace (opt-in)"
    if forward:
        line += "; forwarded host ports (the host's localhost): " + ", ".join(map(str, forward))
    return line


def proxied(network: str, forward: tuple[int, ...]) -> bool:
    """The run has listeners the host-side proxy serves (``net/``)."""
    return network == "allow" or (network == "none" and bool(forward))


def tcp_wall(network: str, foreign_fds: bool) -> bool:
    """Whether Landlock's TCP bind/connect rules (deny all) add a wall.

    With network "none" the sandbox's own namespace has only lo: a socket it makes
    reaches nothing of the host whatever it binds or connects, so denying loopback
    only breaks local servers (HTTP, asyncio, multiprocessing managers). A socket
    handed in from outside (--pass-fd, or an inet socket as stdin) belongs to the
    caller's namespace: bind/connect on it would reach the host's network, so then
    the rules stay. With "host" the user asked for the host's network."""
    return network in ("none", "allow") and foreign_fds


def tcp_note(network: str, foreign_fds: bool, abi: int) -> str:
    if network == "allow":
        if not tcp_wall(network, foreign_fds):
            return ("network allow: own network namespace with only lo and the proxy's listeners; TCP bind/connect "
                    "on loopback allowed (nothing else is reachable)")
        if abi < 4:
            return "network allow: a socket may be handed in, but this kernel's Landlock (ABI < 4) has no TCP rules"
        return ("network allow: a descriptor handed in may be a socket of the caller's namespace: Landlock denies "
                "TCP bind, and connect but to the proxy's, DNS's and forwarded ports")
    if network != "none":
        return "network host: the host's network namespace; TCP bind/connect are not restricted"
    if not tcp_wall(network, foreign_fds):
        return ("network none: own network namespace with only lo; TCP bind/connect on loopback allowed "
                "(they reach nothing of the host; Landlock's TCP rules would add no wall)")
    if abi < 4:
        return "network none: a socket may be handed in, but this kernel's Landlock (ABI < 4) has no TCP rules"
    return ("network none: TCP bind/connect denied by Landlock (EACCES), loopback too: a descriptor handed in "
            "(--pass-fd, or an inet socket as stdin) may be a socket of the caller's network namespace")


def landlock_plan(
    abi: int,
    *,
    read_only_trees: Sequence[str],
    writable_trees: Sequence[str],
    device_files: Sequence[str],
    exec_allow: Sequence[str] | None,
    network: str,
    scope: bool = True,
    foreign_fds: bool = False,
    connect_ports: tuple[int, ...] = (),
    log_denials: bool = False,
) -> LandlockPlan:
    handled = landlock_fs_rights(abi)
    read = LL_READ_FILE | LL_READ_DIR
    write = handled & ~(LL_EXECUTE | LL_READ_FILE | LL_READ_DIR | LL_MAKE_CHAR | LL_MAKE_BLOCK | LL_IOCTL_DEV)
    exec_everywhere = exec_allow is None
    rules: list[tuple[str, int, bool]] = [("/", LL_READ_DIR, False)]
    # Read-only trees get read (+ execute) and nothing else, not even TRUNCATE, though
    # their read-only bind already stops truncation with EROFS. The kernel asks for
    # TRUNCATE on every open (as an optional right), so lacking it here makes every
    # open beneath a system dir walk on to the root instead of stopping at the tree;
    # granting it would save about 1.4 points of the `find /usr` overhead. But a rule
    # belongs to the tree's host inode, not to our bind of it: it also covers the tree
    # reached through a passed host directory fd or a writable mount the host adds
    # beneath it mid-run (our binds are mount slaves), where the right would be real.
    # tests/security/test_landlock_rights.py holds this line.
    for p in read_only_trees:
        rules.append((p, read | (LL_EXECUTE if exec_everywhere else 0), True))
    for p in writable_trees:
        rules.append((p, read | write | (LL_EXECUTE if exec_everywhere else 0), True))
    for p in device_files:
        rules.append((p, (LL_READ_FILE | LL_WRITE_FILE | LL_TRUNCATE | LL_IOCTL_DEV) & handled, True))
    for p in exec_allow or ():
        rules.append((p, LL_EXECUTE | read, True))
    handled_net = 0
    ports: tuple[int, ...] = ()
    if abi >= 4 and tcp_wall(network, foreign_fds):
        # no bind rule: every port denied; connect only to the proxy's listeners. An inet
        # socket handed in directly is refused with --net allow (prepare); this holds for
        # one a passed Unix socket may still bring in (SCM_RIGHTS) on the listeners' ports,
        # whose address Landlock cannot name
        handled_net = LL_NET_BIND_TCP | LL_NET_CONNECT_TCP
        ports = connect_ports
    scoped = (LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL) if (abi >= 6 and scope) else 0
    return LandlockPlan(abi, handled, handled_net, scoped, tuple(rules), connect_ports=ports,
                        log_denials=log_denials and abi >= 7)


# ---------------------------------------------------------------------------
# --net allow: what the sandbox gets to reach the host-side proxy (net/)

RESOLV_CONF = b"nameserver 127.0.0.1\noptions timeout:2 attempts:2\n"


def connector_path() -> Path:
    """stockade-connect, built beside the launcher (setup.py)."""
    p = Path(__file__).resolve().parent / "stockade-connect"
    if not os.access(p, os.X_OK):
        raise UsageError(f"--net allow needs {p}, which is missing: rebuild stockade's native parts (make native, "
                         "or reinstall the package)")
    return p


def _proxy_ports(network: str, forward: tuple[int, ...]) -> tuple[int, ...]:
    return ((PROXY_PORT, DNS_PORT) if network == "allow" else ()) + tuple(forward)


def proxy_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that point pip, npm, git, curl, Node and Python's urllib at the
    proxy inside; git's settings added after any the caller passed (GIT_CONFIG_COUNT)."""
    out = {name: PROXY_URL for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "PIP_PROXY",
                                        "npm_config_proxy", "npm_config_https_proxy")}
    out.update({"ALL_PROXY": SOCKS_URL, "all_proxy": SOCKS_URL, "NO_PROXY": "localhost,127.0.0.1,::1",
                "no_proxy": "localhost,127.0.0.1,::1", "NODE_USE_ENV_PROXY": "1",
                "GIT_PROXY_COMMAND": CONNECT_PATH,
                "GIT_SSH_COMMAND": f"ssh -o ProxyCommand='{CONNECT_PATH} %h %p'"})
    try:
        n = int(env.get("GIT_CONFIG_COUNT", "0"))
    except ValueError:
        n = 0
    out.update({"GIT_CONFIG_COUNT": str(n + 1), f"GIT_CONFIG_KEY_{n}": "http.proxy", f"GIT_CONFIG_VALUE_{n}": PROXY_URL})
    return out


# ---------------------------------------------------------------------------
# /etc/hosts and what the environment points at

# names a hosts line may carry for the loopback; others (the host's own name) stay out
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "localhost4", "localhost4.localdomain4",
                         "localhost6", "localhost6.localdomain6", "ip6-localhost", "ip6-loopback"})


def hosts_file(hostname: str, host: str | bytes | None) -> bytes:
    """The sandbox's /etc/hosts: the host's lines for the loopback names, in the host's
    order (getaddrinfo("localhost") then returns what it returns on the host: a host
    that lists only 127.0.0.1 does not get ::1 first inside), and the sandbox's own
    hostname on 127.0.0.1. Without any such line on the host: 127.0.0.1 for localhost,
    ::1 only under the ip6- names."""
    text = host.decode("utf-8", "replace") if isinstance(host, bytes) else (host or "")
    lines: list[str] = []
    for raw in text.splitlines():
        fields = raw.split("#", 1)[0].split()
        if len(fields) < 2:
            continue
        names = [n for n in fields[1:] if n.lower() in LOCAL_NAMES]
        if names:
            lines.append(fields[0] + "\t" + " ".join(names))
    if not any("localhost" in ln.split()[1:] for ln in lines):
        lines = ["127.0.0.1\tlocalhost", "::1\tip6-localhost ip6-loopback", *lines]
    lines.append(f"127.0.0.1\t{hostname}")
    return ("\n".join(lines) + "\n").encode()


def sees(mounts: Sequence[MountOp], path: str, depth: int = 0) -> bool:
    """Whether the sandbox built from ``mounts`` shows the host's ``path`` (absolute,
    resolved on the host) at the same place: the deepest mount covering it must be a
    bind of that tree (or the project's overlay), not a tmpfs, a synthesized file or a
    mask; nothing covering it means the empty root."""
    return _Covering(mounts).sees(path, depth)


class _Covering:
    """The mounts by target (the last of a target wins, as it is mounted last): which
    one covers a path is then a lookup per parent, not a walk over every mount."""

    def __init__(self, mounts: Sequence[MountOp]) -> None:
        self.by_target: dict[str, MountOp] = {}
        for m in mounts:
            if m.kind not in ("detach-host", "remount-ro"):
                self.by_target[m.target.rstrip("/") or "/"] = m

    def sees(self, path: str, depth: int = 0) -> bool:
        t, best = path, self.by_target.get(path)
        while best is None and t != "/":
            t = os.path.dirname(t) or "/"
            best = self.by_target.get(t)
        if best is None:
            return False
        if best.kind == "symlink" and depth < 8:
            link = str(best.data)
            base = link if link.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(t), link))
            return self.sees(base + path[len(t):], depth + 1)
        if best.kind == "overlay":
            return True
        if best.kind == "bind":
            return not best.source_in_sandbox and not best.source_in_stage and best.source == best.target
        return path == t and best.kind in ("tmpfs", "file")


# ---------------------------------------------------------------------------
# request


class Request:
    """What to run and how: the input of ``build``.

    A plain class, not a dataclass: a run that reuses a prepared plan never makes
    one, and defining a 23-field dataclass costs every CLI start a couple of ms."""

    __slots__ = (
        "argv", "cwd", "degraded", "env", "etc_extra", "exec_allow", "foreign_stdin", "forward", "grants", "hostname",
        "keep_fds", "landlock", "landlock_log", "lower_layers", "masked", "network", "project", "read_only", "rlimits", "root",
        "seccomp_bpf", "seccomp_name", "stage_dir", "tmpfs_size", "upper", "user", "work",
    )

    def __init__(
        self,
        argv: tuple[str, ...],
        project: Path,
        cwd: Path,
        env: Mapping[str, str],
        lower_layers: tuple[Path, ...] = (),  # snapshots (and masks), top first; the project is added last
        upper: Path | None = None,
        work: Path | None = None,
        root: bool = False,
        user: int | None = None,
        read_only: bool = False,
        network: str = "none",
        hostname: str = "stockade",
        forward: tuple[int, ...] = (),  # host loopback ports the sandbox reaches (net/)
        keep_fds: tuple[int, ...] = (),
        # stdin is an inet socket of the caller's network namespace: like a passed fd, it
        # reaches the host's network, so Landlock's TCP rules come back (tcp_note)
        foreign_stdin: bool = False,
        masked: tuple[tuple[str, bool], ...] = (),  # (host path inside a grant or system tree, is_dir)
        grants: tuple[tuple[str, bool], ...] = (),  # (host path, writable)
        exec_allow: tuple[str, ...] | None = None,
        etc_extra: tuple[str, ...] = (),
        landlock: bool = True,
        seccomp_name: str | None = None,
        seccomp_bpf: bytes = b"",
        rlimits: tuple[tuple[int, int, int], ...] = (),
        degraded: tuple[str, ...] = (),
        stage_dir: str = "/tmp",
        tmpfs_size: int | None = None,  # size= of each writable tmpfs (the --disk cap); None: none
        landlock_log: bool = False,  # observe mode: Landlock logs the command's denials (ABI 7+)
    ) -> None:
        self.tmpfs_size = tmpfs_size
        self.landlock_log = landlock_log
        self.argv = argv
        self.project = project
        self.cwd = cwd
        self.env = env
        self.lower_layers = lower_layers
        self.upper = upper
        self.work = work
        self.root = root
        self.user = user
        self.read_only = read_only
        self.network = network
        self.forward = forward
        self.hostname = hostname
        self.keep_fds = keep_fds
        self.foreign_stdin = foreign_stdin
        self.masked = masked
        self.grants = grants
        self.exec_allow = exec_allow
        self.etc_extra = etc_extra
        self.landlock = landlock
        self.seccomp_name = seccomp_name
        self.seccomp_bpf = seccomp_bpf
        self.rlimits = rlimits
        self.degraded = degraded
        self.stage_dir = stage_dir

    def __repr__(self) -> str:
        return "Request(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def resolve_project(project: str | os.PathLike[str]) -> Path:
    raw = os.fspath(project)
    try:
        real = os.path.realpath(raw, strict=True)
        is_dir = stat.S_ISDIR(os.stat(real).st_mode)
    except FileNotFoundError:
        raise UsageError(f"project {raw!r} does not exist; pass --project DIR with an existing directory") from None
    except OSError as e:
        raise UsageError(f"project {raw!r} cannot be resolved: {e.strerror}") from None
    if not is_dir:
        raise UsageError(f"project {raw!r} is not a directory; pass --project DIR")
    if real == "/":
        raise UsageError("the project cannot be / ; pass --project DIR with a project directory")
    _apart_from_state_dir(real)
    return Path(real)


def _apart_from_state_dir(project: str) -> None:
    """The project and the state dir must not nest: the sessions' upper layers inside
    the tree they are stacked on is a loop overlayfs refuses (ELOOP), and a project
    inside the state dir would show the sandbox every session's records."""
    from .paths import state_dir

    sd = os.path.realpath(state_dir())
    if sd == project or sd.startswith(project.rstrip("/") + "/"):
        raise UsageError(f"the state dir {sd} is inside the project {project}; set STOCKADE_STATE_DIR "
                         "to a directory outside the project")
    if project.startswith(sd.rstrip("/") + "/"):
        raise UsageError(f"the project {project} is inside the state dir {sd}; pick a project outside it, "
                         "or set STOCKADE_STATE_DIR to a directory elsewhere")


def resolve_cwd(project: Path, cwd: str | os.PathLike[str] | None) -> Path:
    """The working directory inside: the caller's own when it is inside the project."""
    if cwd is None:
        try:
            here = Path(os.getcwd()).resolve()
        except OSError:
            return project
        return here if here == project or project in here.parents else project
    c = Path(cwd)
    if not c.is_absolute():
        c = project / c
    try:
        c = c.resolve(strict=True)
    except OSError:
        raise UsageError(f"--cwd {str(cwd)!r} does not exist inside the project {project}") from None
    if c != project and project not in c.parents:
        raise UsageError(f"--cwd {str(cwd)!r} is outside the project {project}; pick a directory inside it")
    if not c.is_dir():
        raise UsageError(f"--cwd {str(cwd)!r} is not a directory")
    return c


def _identity(req: Request, facts: HostFacts) -> tuple[int, int, int, int, str, str]:
    """(outside uid, outside gid, inside uid, inside gid, user name, home)."""
    if not facts.privileged:
        # root after `unshare -Ur` (setgroups "deny", its one id) is planned like
        # any unprivileged caller: it has nothing more to map
        out_uid, out_gid = facts.euid, facts.egid
        if not facts.maps_root:
            from .linux import remedies

            rem = remedies.map_root(remedies.detect())  # doctor's words
            raise SandboxError("map uid 0 into the sandbox's user namespace", errno=errno.EPERM, detail=rem.cause,
                               remedy=rem.fix)
        if req.user is not None and req.user != out_uid:
            raise UsageError("--user needs real root; an unprivileged caller always runs as itself (use --root to appear as uid 0)")
    elif req.user is not None:
        out_uid = req.user
        try:
            out_gid = pwd.getpwuid(req.user).pw_gid
        except KeyError:
            out_gid = req.user
    else:
        st = os.stat(req.project)
        out_uid, out_gid = st.st_uid, st.st_gid
    in_uid, in_gid = (0, 0) if req.root else (out_uid, out_gid)
    if in_uid == 0:
        name, home = "root", "/root"
    else:
        try:
            pw = pwd.getpwuid(out_uid)
            name, home = pw.pw_name, pw.pw_dir
        except KeyError:
            name, home = "sandbox", "/home/sandbox"
    if not home.startswith("/") or home in ("/", "/nonexistent") or home.startswith(("/proc", "/dev", "/sys", "/usr", "/etc")):
        home = "/home/" + name
    return out_uid, out_gid, in_uid, in_gid, name, home


def _mounter_id(mine: int, out_id: int, in_id: int) -> tuple[tuple[int, int], ...]:
    """The extra (inside, outside) map entry for a real-root caller's own uid or gid.

    The namespaces' mounts are made with the caller's credentials (overlayfs keeps
    them to reach the session's upper layer in the caller's state dir), and a new
    inode on a filesystem mounted in the namespace (the staging tmpfs, a mount point)
    needs its creator's ids mapped there: unmapped, mkdir fails with EOVERFLOW. So
    when the sandbox user is another id (the project's owner, ``--user``), the
    caller's own is mapped too: as 0 inside, or as nobody (65534) when the sandbox
    user is 0 inside (``--root``). The command itself runs as the sandbox user with
    every capability dropped and no_new_privs on nosuid mounts: a mapped host root
    gives it nothing (it shows as that owner on root's files)."""
    if out_id == mine:
        return ()
    return ((65534 if in_id == 0 else 0, mine),)


# what root inside keeps when other ids are mapped: what `tar x`, `chown`, `su`,
# `setpriv` and test suites run as root need, as rootless podman keeps; never
# CAP_SYS_ADMIN (unmounting a mask would uncover what it hides), DAC_READ_SEARCH
# (open_by_handle_at) or SETFCAP (file capabilities reaching the host through apply)
KEEP_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
             "CAP_NET_BIND_SERVICE")


def _maps(facts: HostFacts, out_uid: int, out_gid: int, in_uid: int, in_gid: int) -> tuple[IdMap, IdMap, str]:
    """The uid and gid maps, and the explain note saying which ids exist inside.

    The sandbox user's id (and a real root's mounter id) are single entries; the
    caller's range (linux/idmap.py) fills the rest of 0..65535. Root inside then
    keeps a few capabilities in its own namespace, and those reach every inode
    owned by a mapped id: so no range where host root is mapped as the mounter
    beside a root inside that is someone else (``--root`` over another owner's
    project), since its capabilities would then reach host root's files."""
    su = ((in_uid, out_uid), *(_mounter_id(facts.euid, out_uid, in_uid) if facts.privileged else ()))
    sg = ((in_gid, out_gid), *(_mounter_id(facts.egid, out_gid, in_gid) if facts.privileged else ()))
    ur, gr, why = facts.uid_range, facts.gid_range, facts.range_why
    if ur and gr and in_uid == 0 and len(su) > 1:
        ur = gr = None
        why = ("--root over a project owned by another user: host root is mapped too (it makes the mounts), and root "
               "inside must not reach its files; run as the owner (without --root), or as root on a root-owned copy")
    if not (ur and gr):
        return IdMap(tuple((i, o, 1) for i, o in su)), IdMap(tuple((i, o, 1) for i, o in sg)), (
            f"ids: only the sandbox user's id is mapped ({why}): chown to another id and setuid/setgid give EINVAL, "
            "setgroups EPERM (GNU tar as root exits 2; pass it --no-same-owner)")
    um, gm = IdMap(idmap.build(su, ur), ur.helper), IdMap(idmap.build(sg, gr), gr.helper)
    return um, gm, (f"ids: inside 0..{idmap.SPAN - 1} are mapped, the others onto host {ur.start}+id "
                    f"(uids, from {ur.source}) and {gr.start}+id (gids)" + (f", written by {ur.helper}" if ur.helper else "")
                    + ("; root inside keeps " + ", ".join(KEEP_CAPS) + " in its own namespace" if in_uid == 0 else ""))


def _passwd(uid: int, gid: int, name: str, home: str) -> tuple[bytes, bytes]:
    users = {0: "root:x:0:0:root:/root:/bin/sh", 65534: "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin"}
    users[uid] = f"{name}:x:{uid}:{gid}:{name}:{home}:/bin/sh"
    groups = {0: "root:x:0:", 65534: "nogroup:x:65534:"}
    if gid not in groups:
        groups[gid] = f"{name}:x:{gid}:"
    return (
        ("\n".join(users[k] for k in sorted(users)) + "\n").encode(),
        ("\n".join(groups[k] for k in sorted(groups)) + "\n").encode(),
    )


#: One inode of a capped tmpfs per this many bytes of its size (tmpfs' own default is
#: one per page of RAM / 2): a sandbox cannot pin kernel memory with millions of
#: empty files, and 10G still allows 655,360 of them.
TMPFS_BYTES_PER_INODE = 16 * 1024
TMPFS_MIN_INODES = 4096


def tmpfs_inodes(size: int) -> int:
    """The inodes a cap of ``size`` bytes allows: a tmpfs's ``nr_inodes=``, and the
    share the disk watchdog holds the project's layers to."""
    return max(TMPFS_MIN_INODES, size // TMPFS_BYTES_PER_INODE)


def tmpfs_cap(size: int | None) -> str:
    """The ``size=`` and ``nr_inodes=`` options of a writable tmpfs ("" without a cap).
    Each writable tmpfs gets the whole cap, so none passes it on its own; the
    supervisor's disk watchdog holds their sum (and the project's layers) to it."""
    if size is None:
        return ""
    size = max(size // 4096 * 4096, 4096)  # (a size of 0 would be no limit at all)
    return f",size={size},nr_inodes={tmpfs_inodes(size)}"


def _still_tmpfs(paths: list[str], ops: list[MountOp]) -> tuple[str, ...]:
    """Those of ``paths`` whose last mount is a writable tmpfs (a grant bound over /tmp
    is the host's filesystem: the watchdog must not count it)."""
    last = {m.target: m for m in ops if m.kind not in ("mkdir", "symlink", "file", "remount-ro", "detach-host")}
    return tuple(p for p in paths if p in last and last[p].kind == "tmpfs" and "ro" not in last[p].flags)


def _overlay_lowers(req: Request) -> tuple[str, ...]:
    return (*(str(p) for p in req.lower_layers), str(req.project))


def build(req: Request, facts: HostFacts | None = None) -> Plan:
    """Turn a request into a Plan. Pure apart from the cached host facts."""
    if not req.argv:
        raise UsageError("no command given; usage: stockade run [OPTIONS] -- CMD [ARGS...]")
    if not req.argv[0]:
        raise UsageError("the command is an empty string; give a program name: stockade run [OPTIONS] -- CMD [ARGS...]")
    if req.user is not None and not 0 <= req.user < 2**32 - 1:
        raise UsageError(f"user {req.user} is not a uid; give a number from 0 to 4294967294")
    facts = facts or host_facts(req.etc_extra)
    out_uid, out_gid, in_uid, in_gid, name, home = _identity(req, facts)
    privileged = facts.privileged
    uid_map, gid_map, id_note = _maps(facts, out_uid, out_gid, in_uid, in_gid)
    ranged = uid_map.ranged()
    project = str(req.project)
    ops: list[MountOp] = []
    hidden: list[str] = []
    notes: list[str] = []

    # system dirs: read-only, merged-usr symlinks reproduced
    ro_trees: list[str] = []
    for path, link in facts.system:
        if link is not None:
            ops.append(MountOp("symlink", path, data=link, why="merged /usr"))
        else:
            ops.append(MountOp("bind", path, source=path, flags=frozenset({"ro", "rec"}), why="system, read-only"))
            ro_trees.append(path)
    # a few read-only pieces of /sys (SYS_EXPOSED): before the new procfs, so a
    # launcher's shared base holds them; a host without one just goes without
    for spath, swhy in SYS_EXPOSED:
        ops.append(MountOp("bind", spath, source=spath, flags=frozenset({"ro", "optional"}), why="read-only: " + swhy))
        ro_trees.append(spath)
    # /var/run and /var/lock lead to the private /run, as on the host
    ops.append(MountOp("symlink", "/var/run", data="../run"))
    ops.append(MountOp("symlink", "/var/lock", data="../run/lock"))

    # walls a container refused that the caller allowed a run without (prepare, linux/walls.py)
    gone = {d.split(" ", 1)[0] for d in req.degraded}
    # kept: the sandbox's own UTS namespace starts as a copy of this one
    hostname = os.uname().nodename if "hostname" in gone else req.hostname

    # /etc: curated; passwd/group synthesized for the sandbox user
    passwd, group = _passwd(in_uid, in_gid, name, home)
    ops.append(MountOp("file", "/etc/passwd", data=passwd, mode=0o644, why="synthesized"))
    ops.append(MountOp("file", "/etc/group", data=group, mode=0o644, why="synthesized"))
    ops.append(MountOp("file", "/etc/hostname", data=(hostname + "\n").encode(), mode=0o644))
    host_hosts = next((d for n, k, d in facts.etc if n == "hosts" and k == "file"), None)
    ops.append(MountOp("file", "/etc/hosts", data=hosts_file(hostname, host_hosts), mode=0o644,
                       why="synthesized: the host's localhost lines, in its order"))
    whole_hosts = "/etc/hosts" in req.etc_extra or "hosts" in req.etc_extra
    etc_names = [e[0] for e in facts.etc]
    if req.network == "allow":
        # names resolve through the proxy's DNS responder inside (allowlisted ones only)
        facts = dataclasses.replace(facts, etc=tuple(e for e in facts.etc if e[0] != "resolv.conf"))
        ops.append(MountOp("file", "/etc/resolv.conf", data=RESOLV_CONF, mode=0o644,
                           why="synthesized: the proxy's DNS responder (allowlisted names only)"))
        etc_names.append("resolv.conf")
    if req.forward and req.network == "host":
        raise UsageError("--forward: the host's network already reaches its ports; forward with --net none or allow")
    if req.network == "host":
        e = _etc_entry("resolv.conf")
        if e:
            etc_names.append("resolv.conf")
            facts = dataclasses.replace(facts, etc=(*facts.etc, e))
    for ename, kind, data in facts.etc:
        if ename == "hosts" and not whole_hosts:
            continue
        target = "/etc/" + ename
        if kind == "file":
            ops.append(MountOp("file", target, data=data, mode=0o644))
        elif kind == "symlink":
            ops.append(MountOp("symlink", target, data=data))
        else:
            flags = {"ro", "rec", "optional"} | ({"file"} if kind == "bindfile" else set())
            ops.append(MountOp("bind", target, source=target, flags=frozenset(flags)))
    hidden.append("/etc (except " + ", ".join(sorted({"passwd", "group", "hosts", "hostname", *etc_names})) + ")")
    ro_trees.append("/etc")

    # /dev: minimal, a new devpts
    ops.append(MountOp("tmpfs", "/dev", data="mode=0755", why="minimal /dev"))
    for d in DEVICES:
        ops.append(MountOp("bind", "/dev/" + d, source="/dev/" + d, flags=frozenset({"dev", "file", "optional"})))
    ops.append(MountOp("devpts", "/dev/pts", data="newinstance,ptmxmode=0666,mode=0620"))
    ops.append(MountOp("symlink", "/dev/ptmx", data="pts/ptmx"))
    cap = tmpfs_cap(req.tmpfs_size)
    ops.append(MountOp("tmpfs", "/dev/shm", data="mode=1777" + cap))
    for n, t in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        ops.append(MountOp("symlink", "/dev/" + n, data=t))

    # /proc: new procfs; kernel tunables read-only, leaky files masked
    proc_entries = facts.proc_entries
    if "proc" in gone:
        # never this process's /proc bound in: it shows its processes, same-uid ones' environ
        # included (docs/ARCHITECTURE.md)
        ops.append(MountOp("tmpfs", "/proc", data="mode=0555,size=0", flags=frozenset({"ro"}),
                           why="empty: a new procfs is refused here (--allow-degraded proc)"))
        proc_entries = frozenset()
    else:
        ops.append(MountOp("proc", "/proc", why="new procfs for the sandbox's PID namespace"))
    for pe in PROC_READONLY:
        if pe in proc_entries:
            ops.append(MountOp("bind", "/proc/" + pe, source="/proc/" + pe, source_in_sandbox=True, flags=frozenset({"ro", "rec"}), why="read-only"))
    for pe in PROC_MASKED:
        if pe in proc_entries:
            ops.append(MountOp("bind", "/proc/" + pe, source="/dev/null", source_in_sandbox=True, flags=frozenset({"ro", "file"}), why="masked"))
    for pe in PROC_MASKED_DIRS:
        if pe in proc_entries:
            ops.append(MountOp("tmpfs", "/proc/" + pe, data="mode=0555,size=0", flags=frozenset({"ro"}), why="masked"))
    hidden.append("/sys (except " + ", ".join(p for p, _ in SYS_EXPOSED) + ", read-only)")

    # private /tmp, empty $HOME, the project and grants (parents before children)
    tree_ops: list[MountOp] = []
    tree_ops.append(MountOp("tmpfs", "/tmp", data="mode=1777" + cap, why="private /tmp"))
    # /var/tmp is a fresh tmpfs per run like /tmp (nothing of a run survives it but the
    # project's change set); /run the same, owned by the sandbox user as the host's is
    # by root, never the host's (its sockets: dbus, docker, systemd)
    tree_ops.append(MountOp("tmpfs", "/var/tmp", data="mode=1777" + cap, why="private /var/tmp"))
    tree_ops.append(MountOp("tmpfs", "/run", data=f"mode=0755,uid={in_uid},gid={in_gid}" + cap, why="private /run (not the host's)"))
    if not any(g == "/run" for g, _w in req.grants):  # a grant of the host's /run is the user's to shape
        tree_ops.append(MountOp("mkdir", "/run/lock", mode=0o1777, why="lock files (/var/lock)"))
    if req.network == "allow":
        tree_ops.append(MountOp("mkdir", os.path.dirname(CONNECT_PATH), mode=0o755, why="stockade's helpers"))
        tree_ops.append(MountOp("bind", CONNECT_PATH, source=str(connector_path()), flags=frozenset({"ro", "file"}),
                                why="SOCKS5 connector for ssh and git (read-only)"))
    proj = Path(project)
    home_p = Path(home)
    writable = ["/tmp", "/var/tmp", "/run", "/dev/shm"]
    if home_p == proj or proj in home_p.parents:
        notes.append(f"$HOME {home} is the project or inside it: no separate home tmpfs")
    else:
        tree_ops.append(MountOp("tmpfs", home, data=f"mode=0700,uid={in_uid},gid={in_gid}" + cap, why="empty $HOME"))
        writable.append(home)
    if req.read_only and req.lower_layers:
        # masks as overlay content; no upper layer makes the overlay read-only (EROFS)
        tree_ops.append(MountOp("overlay", project, lower=_overlay_lowers(req), flags=frozenset({"ro"}), why="project, read-only, secrets masked"))
        ro_trees.append(project)
    elif req.read_only:
        tree_ops.append(MountOp("bind", project, source=project, flags=frozenset({"ro", "rec"}), why="project, read-only"))
        ro_trees.append(project)
    else:
        if req.upper is None or req.work is None:
            raise UsageError("internal: an overlay run needs a session (upper and work dirs)")
        tree_ops.append(
            MountOp("overlay", project, lower=_overlay_lowers(req), upper=str(req.upper), work=str(req.work), why="project, copy-on-write")
        )
        writable.append(project)
    rw_grants = [Path(g) for g, w in req.grants if w]
    for gpath, _gw in req.grants:
        gp = Path(gpath)
        # A mount point inside a tree the sandbox could write in an earlier run would be
        # resolved through what it planted there (a symlink aimed at the host).
        if gp == proj or proj in gp.parents:
            raise UsageError(f"granted path {gpath} is inside the project, which is already visible; grant paths outside it")
        for rw in rw_grants:
            if rw != gp and rw in gp.parents:
                raise UsageError(f"granted path {gpath} is inside the read-write grant {rw}; grant one or the other")
    for gpath, gw in req.grants:
        tree_ops.append(MountOp("bind", gpath, source=gpath, flags=frozenset({"rec"} if gw else {"ro", "rec"}), why="granted " + ("read-write" if gw else "read-only")))
        (writable if gw else ro_trees).append(gpath)
    tree_ops.sort(key=lambda m: m.target.rstrip("/").count("/"))  # stable: parents first
    ops.extend(tree_ops)

    # Everything below works on the sandbox's view only: a planted symlink can no longer
    # lead a mount point (or the creation of one) to the host.
    ops.append(MountOp("detach-host", "/", why="the host's tree is unreachable from here on"))
    # secrets and denied paths inside grants, denied system and /etc paths (the project's
    # are overlay content: the session's mask layer)
    for mpath, is_dir in req.masked:
        if is_dir:
            ops.append(MountOp("tmpfs", mpath, data="mode=0555,size=0", flags=frozenset({"ro"}), why="secret or denied, masked"))
        else:
            ops.append(MountOp("bind", mpath, source="/empty", source_in_stage=True, flags=frozenset({"ro", "file"}), why="secret or denied, masked"))

    ops.append(MountOp("remount-ro", "/dev", why="device nodes are bound in; the tmpfs itself is read-only"))
    ops.append(MountOp("remount-ro", "/", why="the root tmpfs itself is read-only"))

    ll: LandlockPlan | None = None
    foreign = bool(req.keep_fds) or req.foreign_stdin
    exec_allow = req.exec_allow
    if req.landlock and exec_allow is not None:
        # the kernel opens a dynamic program's loader for execution too: without it an
        # allowlist of /usr/bin runs nothing ("Permission denied"). The loader file
        # alone gets read+execute; the libraries it maps need only read (system dirs).
        extra = [p for p in elf_loaders() if not any(p == d or p.startswith(d.rstrip("/") + "/") for d in exec_allow)]
        exec_allow = (*exec_allow, *extra)
        if req.network == "allow":
                exec_allow = (*exec_allow, CONNECT_PATH)  # ssh's and git's proxy command
        notes += [f"exec allowlist: the dynamic loader {p} may execute too (read+execute, never write; "
                  "programs in the allowed dirs cannot start without it)" for p in extra]
    if req.landlock:
        ll = landlock_plan(
            facts.landlock_abi,
            read_only_trees=[*ro_trees, "/proc", "/dev"],
            writable_trees=writable,
            device_files=["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx", "/dev/pts"],
            exec_allow=exec_allow,
            network=req.network,
            foreign_fds=foreign,
            connect_ports=_proxy_ports(req.network, req.forward),
            log_denials=req.landlock_log,
        )
    notes.append(tcp_note(req.network, foreign, ll.abi if ll else 0))
    notes.append(id_note)

    # cwd: same absolute path inside
    cwd = str(req.cwd)

    namespaces = tuple(n for n in NAMESPACES if not (n == "net" and req.network == "host"))
    env = dict(req.env)
    env["HOME"] = home
    env.setdefault("USER", name)
    env.setdefault("LOGNAME", name)
    env["PWD"] = cwd
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    if req.network == "allow":
        env.update(proxy_env(env))
    from .policy.env import hidden_refs, hidden_warning

    env_warnings = tuple(hidden_warning(n, p) for n, p in hidden_refs(env, _Covering(ops).sees))
    return Plan(
        argv=tuple(req.argv),
        env=tuple(sorted(env.items())),
        cwd=cwd,
        project=project,
        uid=in_uid,
        gid=in_gid,
        user_name=name,
        home=home,
        uid_map=uid_map,
        gid_map=gid_map,
        deny_setgroups=not (privileged or ranged),
        drop_groups=privileged or ranged,
        keep_caps=KEEP_CAPS if ranged and in_uid == 0 else (),
        namespaces=namespaces,
        hostname="" if "hostname" in gone else req.hostname,  # "": sethostname is not called
        mounts=tuple(ops),
        rlimits=req.rlimits,
        landlock=ll,
        seccomp_name=req.seccomp_name,
        seccomp_bpf=req.seccomp_bpf,
        keep_fds=req.keep_fds,
        network=req.network,
        forward=tuple(req.forward),
        read_only=req.read_only,
        hidden=(*tuple(hidden), "other homes and projects", "parent directories of the project"),
        degraded=req.degraded,
        notes=tuple(notes),
        env_warnings=env_warnings,
        writable_tmpfs=_still_tmpfs(writable, ops),
        tmpfs_size=req.tmpfs_size,
    )
