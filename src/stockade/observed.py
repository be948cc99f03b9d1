"""Observe mode's records as the user reads them: what a command tried, classified.

The kernel runs each observed call itself after the supervisor lets it continue
(csrc/observe.c), so its return value is never seen here. The result of each entry
is therefore *predicted*: the run's plan evaluated for that path or address (the
mount view and secret masks ``policy why`` explains, the read-only mounts and
Landlock rules for writes, the network mode for addresses). Every event says so
(``basis: "predicted"``). An allowed open of a file that does not exist still fails
with ENOENT; a prediction never claims the call succeeded, only that the sandbox's
walls let it through.

Three parts: ``classify`` (records to audit events, aggregated), ``group`` (the
events of a session for ``stockade log --observed``), ``suggest`` (blocked entries
as the config lines that would allow them, each with the risk it opens).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .audit import MAX_LINE, plain_fields
from .redact import printable, terminal_safe

LANDLOCK_DENIAL = "observed-landlock-denial"  # Landlock's own record of a denial (kernel audit)
OPERATIONS = ("observed-exec", "observed-open", "observed-connect", LANDLOCK_DENIAL)
SUPPRESSED = "observed-suppressed"
SUMMARY = "observed-summary"
MAX_EVENTS = 2000  # observed events one run writes at most; the rest are counted in one event
MAX_PIDS = 8
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()  # (fixed at start)
_PATH_OPS = {"exec": "observed-exec", "open": "observed-open"}  # a record's kind -> its operation

O_ACCMODE = 0o3
O_WRONLY = 0o1
O_RDWR = 0o2
O_CREAT = 0o100
O_TRUNC = 0o1000


class DecisionLike(Protocol):
    """``policy.rules.Decision``: what ``policy why PATH`` answers."""

    @property
    def path(self) -> str: ...

    @property
    def visible(self) -> bool: ...

    @property
    def access(self) -> str: ...

    @property
    def reason(self) -> str: ...

    @property
    def source(self) -> str: ...


class RecordLike(Protocol):
    """``linux.seccomp.observe.Record``."""

    @property
    def kind(self) -> int: ...

    @property
    def flags(self) -> int: ...

    @property
    def pid(self) -> int: ...

    @property
    def nr(self) -> int: ...

    @property
    def err(self) -> int: ...

    @property
    def arg(self) -> int: ...

    @property
    def data(self) -> bytes: ...

    @property
    def syscall(self) -> str: ...


class DenialLike(Protocol):
    """``linux.audit_netlink.Denial``."""

    @property
    def blockers(self) -> tuple[str, ...]: ...

    @property
    def target(self) -> str: ...

    @property
    def access(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def exe(self) -> str | None: ...

    @property
    def syscall(self) -> int | None: ...


@dataclass(frozen=True)
class Context:
    """The facts of a run's plan that predict a result."""

    project: str
    home: str
    network: str  # none | allow | host
    tcp_connect_ports: tuple[int, ...] | None  # Landlock TCP connect rule: None = not restricted
    why: Callable[[str], DecisionLike]  # a resolved host path's visibility (policy.Effective.why)
    # True: every path beneath this resolved directory is decided by the same rule (a
    # system directory with no deny, grant or project below): one decision for all
    uniform: Callable[[str], bool] | None = None
    grants: tuple[str, ...] = ()  # host paths granted (--allow): the host's own, wherever they are
    own_etc: tuple[str, ...] = ()  # the /etc files the runtime writes inside (/etc/hosts, ...): never the host's
    # Landlock's exec allowlist ([exec] allow, with the loaders the plan adds), resolved
    # host paths; None: no allowlist (or no Landlock), every visible program may run
    exec_allow: tuple[str, ...] | None = None
    kinds: Mapping[str, int] = field(default_factory=dict)  # KIND_* of linux.seccomp.observe, by name
    unreadable_flag: int = 1
    relative_flag: int = 4
    sockaddr: Callable[[bytes], tuple[str, str, int | None]] | None = None


def is_under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def access_of(flags: int) -> str:
    """"write" when an open's flags can change the file, else "read"."""
    if flags & O_ACCMODE in (O_WRONLY, O_RDWR) or flags & (O_CREAT | O_TRUNC):
        return "write"
    return "read"


@dataclass
class Decided:
    """What the policy alone decides, kept across the runs of one policy (the caller
    keys it: ``core/observe.py``): each resolved directory's uniform decision (or None:
    not uniform), and the result each of those gives an access. No filesystem fact is
    here: whether a path resolves to a directory is learnt in each run."""

    dirs: dict[str, DecisionLike | None] = field(default_factory=dict)
    results: dict[tuple[int, str], tuple[str, str, str]] = field(default_factory=dict)  # (id(decision), access)
    # a record's path as an earlier run named it (kind, syscall, access, raw bytes) -> what it was
    # classified as: good while its directory resolves where it did, with the same Stamp
    # (``Classifier._seen_still``). A command run again opens the same files: each is then
    # one lookup, not a classification.
    seen: dict[tuple[int, int, str, bytes], _Seen] = field(default_factory=dict)

    def bounded(self) -> Decided:
        """Itself, emptied first when it has grown past what one policy's runs need."""
        if len(self.dirs) > _DECIDED_MAX or len(self.seen) > _DECIDED_MAX:
            self.dirs.clear()
            self.results.clear()
            self.seen.clear()
        return self


_DECIDED_MAX = 100_000


# A directory as of one lstat: (dev, ino, mtime_ns, ctime_ns). Its names are what they were
# while all four hold: a change of its entries moves mtime, and putting mtime back (tar,
# rsync -a, touch -d) moves ctime.
Stamp = tuple[int, int, int, int]


class _Seen(NamedTuple):
    """A path's classification kept for later runs (``Decided.seen``)."""

    key: tuple[str, str, str]  # (operation, target, access): its aggregate's
    result: tuple[str, str, str]
    syscall: str
    extra: tuple[tuple[str, str], ...]
    d: str  # its directory as the command named it
    rd: str  # where that resolved on the host
    stamp: Stamp  # rd's, no newer than the racy margin when kept
    json: list[tuple[str, str]]  # its line's parts (``_parts``), once made: [] or one


class RawLayout(NamedTuple):
    """The records' format as the supervisor's loop hands them over
    (``linux.seccomp.observe``): the header (length, kind, flags, pid, nr, err, data
    length, arg) its path or address follows, the name of a syscall number, and a
    record made of the fields (for the general path)."""

    header: struct.Struct
    syscall: Callable[[int], str]
    record: Callable[[int, int, int, int, int, int, bytes], RecordLike]


class _Resolver:
    """Host paths resolved (symlinks followed, as the sandbox's view follows the same
    links) and decided, with one ``lstat`` per new path and a memo per directory."""

    def __init__(self, ctx: Context, decided: Decided | None = None) -> None:
        self.ctx = ctx
        self.real: dict[str, str] = {"/": "/"}
        self.stamp: dict[str, Stamp] = {}  # resolved dir -> its Stamp, this run's lstat
        decided = (decided or Decided()).bounded()
        self.dirs = decided.dirs
        self.results = decided.results  # (uniform decision, access) -> result
        # a path starting with none of these needs none of _path_result's special cases
        self.special = ("/tmp", "/dev", "/proc", ctx.home, ctx.project, *ctx.grants, *ctx.own_etc)
        self.own_home = not is_under(ctx.project, ctx.home)

    def realpath(self, p: str) -> str:
        """``p`` with its symlinks followed, as the sandbox's view follows them: one
        ``lstat`` per component not seen before in this run. Iterative, from the nearest
        component already resolved down: a path of two thousand components (a command's
        to choose) is one call, not two thousand frames past Python's recursion limit."""
        hit = self.real.get(p)
        if hit is not None:
            return hit
        down: list[tuple[str, str]] = []  # (path, its last component), the deepest first
        q = p
        while True:
            parent, base = os.path.split(q.rstrip("/") or "/")
            down.append((q, base))
            if parent == q:
                rp = parent
                break
            up = self.real.get(parent)
            if up is not None:
                rp = up
                break
            q = parent
        for q, base in reversed(down):
            child = rp.rstrip("/") + "/" + base if base else rp
            try:
                st = os.lstat(child)
                if stat.S_ISLNK(st.st_mode):
                    # (a chain of links a command made in a granted directory: Python's
                    # realpath recurses per link, where the kernel stops at 40)
                    with contextlib.suppress(RecursionError):
                        child = os.path.realpath(child)
                    st = os.lstat(child)  # (a directory it leads to is stamped as one reached directly)
                if stat.S_ISDIR(st.st_mode) and len(self.stamp) < 200_000:
                    self.stamp[child] = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            except OSError:
                pass
            if len(self.real) < 200_000:
                self.real[q] = child
            rp = child
        return rp

    def uniform_dir(self, d: str) -> DecisionLike | None:
        """The one decision for everything beneath ``d`` (resolved), or None.

        A uniform directory's subdirectories are uniform, with its decision: the
        ancestors are decided first (iteratively, from the nearest one decided before),
        so a run decides the few directories at the top of a uniform tree (``/usr``),
        not each of the hundreds its command opens files in."""
        if d in self.dirs:
            return self.dirs[d]
        u = self.ctx.uniform
        if u is None:
            self.dirs[d] = None
            return None
        down = [d]
        hit: DecisionLike | None = None
        q = d
        while True:
            up = os.path.dirname(q)
            if up == q:
                break
            if up in self.dirs:
                hit = self.dirs[up]
                break
            down.append(up)
            q = up
        for q in reversed(down):
            if hit is None and u(q):
                hit = self.ctx.why(q)
            self.dirs[q] = hit
        return hit

    def decide(self, path: str) -> tuple[str, DecisionLike, bool]:
        """(resolved path, its decision, whether that decision is a uniform directory's)."""
        rp = self.realpath(path)
        d = self.uniform_dir(os.path.dirname(rp))
        if d is not None:
            return rp, d, True
        return rp, self.ctx.why(rp), False


# Names known by directory, as of the directory's Stamp: None for a name
# that is no symlink, or the name of the file in the same directory it links to (a
# library's soname: libz.so.1 -> libz.so.1.2.13, itself no link). Kept across runs (a
# process runs many commands that open the same files), so a later run's opens in an
# unchanged directory need no lstat. Making, replacing or retargeting a link changes its
# directory's mtime; a directory changed within the last seconds is not remembered (two
# changes within one tick of the clock share an mtime: "racy git").
_NAMES: dict[str, tuple[Stamp, dict[str, str | None]]] = {}
_NAMES_MAX = 200_000  # names in all (a `find /` starts it over)
_RACY_NS = 2_000_000_000
_names_count = 0
_NOT_PLAIN = "\0"  # a link _quick leaves to the general path (no file name holds a NUL)


def _remember(d: str, stamp: Stamp | None, name: str, target: str | None) -> None:
    global _names_count
    if stamp is None or time.time_ns() - stamp[2] < _RACY_NS:
        return
    known = _NAMES.get(d)
    if known is None or known[0] != stamp:
        known = _NAMES[d] = (stamp, {})
    if _names_count >= _NAMES_MAX:
        _NAMES.clear()
        _names_count = 0
        known = _NAMES[d] = (stamp, {})
    known[1][name] = target
    _names_count += 1


def _look(d: str, stamp: Stamp | None, name: str, full: str) -> str | None:
    """What ``name`` in the resolved directory ``d`` is (``full``: its path there): None
    when it is no link (or not there: it resolves to itself, as realpath says), the name
    it links to when that is a file of the same directory that is no link, else
    ``_NOT_PLAIN``. Remembered for later runs (``_NAMES``)."""
    try:
        st = os.lstat(full)
    except OSError:
        return None
    if not stat.S_ISLNK(st.st_mode):
        _remember(d, stamp, name, None)
        return None
    try:
        target = os.readlink(full)
        if "/" in target or target in ("", ".", ".."):
            return _NOT_PLAIN  # (elsewhere: the general path follows it)
        if stat.S_ISLNK(os.lstat(d.rstrip("/") + "/" + target).st_mode):
            return _NOT_PLAIN  # (a chain)
    except OSError:
        return _NOT_PLAIN  # (a dangling link)
    _remember(d, stamp, target, None)
    _remember(d, stamp, name, target)
    return target


def _path_result(ctx: Context, path: str, access: str, res: _Resolver | None = None) -> tuple[str, str, str]:
    """(allowed | blocked, policy, reason) predicted for ``access`` of the sandbox path."""
    res = res or _Resolver(ctx)
    if path.startswith(res.special):
        in_tree = is_under(path, ctx.project) or any(is_under(path, g) for g in ctx.grants)
        if not in_tree and (is_under(path, "/tmp") or is_under(path, "/dev/shm")):
            return "allowed", "sandbox-tmpfs", "the sandbox's private tmpfs (gone with the run)"
        if not in_tree and res.own_home and (path == ctx.home or (is_under(path, ctx.home) and access == "write")):
            return "allowed", "sandbox-tmpfs", f"the sandbox's own empty $HOME {ctx.home} (a tmpfs, gone with the run)"
        own = None if in_tree else _own_result(ctx, path, access)
        if own is not None:
            return own
    rp, d, uniform = res.decide(path)
    if rp != path:
        r, pol, why = _decided(ctx, d, path, access)
        return r, pol, f"{path} resolves to {rp} on the host: {why}"
    if not uniform:
        return _decided(ctx, d, path, access)
    key = (id(d), access)
    hit = res.results.get(key)
    if hit is None:
        hit = res.results[key] = _decided(ctx, d, path, access)
    return hit


# Links of the sandbox's minimal /dev into the command's own descriptors (/proc/self/fd)
_FD_LINKS = ("/dev/fd", "/dev/stdin", "/dev/stdout", "/dev/stderr")


def _own_result(ctx: Context, path: str, access: str) -> tuple[str, str, str] | None:
    """The result for a path of the sandbox's own procfs, minimal /dev or runtime-written
    /etc files, decided by the sandbox's view with no host lookup (on the host,
    ``/proc/self`` is the supervisor and ``/dev/stdout`` its caller's output; a
    ``/proc/N`` inside is a process of the sandbox's own PID namespace); None for any
    other path."""
    if is_under(path, "/proc"):
        top = path[len("/proc/"):].split("/", 1)[0]
        if top in ("self", "thread-self") or top.isdigit():
            return "allowed", "view", "the sandbox's own procfs: a process of its own PID namespace"
    elif any(is_under(path, link) for link in _FD_LINKS):
        return "allowed", "view", f"the command's own open files: {path.split('/')[2]} links to /proc/self/fd inside"
    elif not is_under(path, "/dev") and not any(is_under(path, e) for e in ctx.own_etc):
        return None
    return _decided(ctx, ctx.why(path), path, access)  # (policy why's view of them: no lookup)


def _decided(ctx: Context, d: DecisionLike, path: str, access: str) -> tuple[str, str, str]:
    if not d.visible:
        policy = {"masked": "secret-mask", "denied": "path-deny"}.get(d.access, "mount-view")
        err = "ENOENT" if d.access != "masked" else "empty or absent"
        if is_under(path, ctx.home) and d.access == "absent":
            return "blocked", policy, f"{d.reason} (reads {err} unless the command made it)"
        return "blocked", policy, f"{d.reason} ({err})"
    if access == "write" and d.access == "ro":
        return "blocked", "read-only", f"{d.reason}; writes fail (EROFS/EACCES: read-only mount and Landlock)"
    if access == "exec" and d.access == "rw" and is_under(path, ctx.project):
        return "allowed", "project", d.reason
    return "allowed", d.source if d.source != "default" else "view", d.reason


def _net_result(ctx: Context, family: str, addr: str, port: int | None, sock_type: int) -> tuple[str, str, str]:
    if family == "unix":
        if addr.startswith("@"):
            return "allowed", "net-" + ctx.network, "an abstract Unix socket of the sandbox's own network namespace"
        return _path_result(ctx, addr, "read")
    if family not in ("inet", "inet6"):
        return "allowed", "net-" + ctx.network, f"{family} socket"
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return "allowed", "net-" + ctx.network, "unparsed address"
    loopback = ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None
                                  and ip.ipv4_mapped.is_loopback)
    tcp = sock_type == 1  # SOCK_STREAM
    if ctx.network == "host":
        return "allowed", "net-host", "--net host: the host's network"
    if tcp and ctx.tcp_connect_ports is not None and port not in ctx.tcp_connect_ports:
        why = "Landlock refuses TCP connect to every port" if not ctx.tcp_connect_ports else (
            "Landlock allows TCP connect only to ports " + ", ".join(map(str, ctx.tcp_connect_ports)))
        return "blocked", "landlock-net", f"{why} (EACCES)"
    if loopback:
        if ctx.network == "allow":
            return "allowed", "net-allow", "the sandbox's own loopback (the run's proxy listens there)"
        return "allowed", "net-none", "the sandbox's own loopback (its own network namespace, not the host's)"
    if ctx.network == "allow":
        return "blocked", "net-allow", "no route out: --net allow reaches hosts only through the run's proxy (ENETUNREACH)"
    return "blocked", "net-none", "no route out: --net none has only loopback (ENETUNREACH)"


@dataclass(slots=True)
class _Agg:
    operation: str
    target: str
    result: str
    policy: str
    reason: str
    access: str
    syscall: str
    count: int = 0
    pids: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # its line's fields before and after count and host_pids (``line_of``), once made;
    # ("", "") when they are not all plain (the general path then)
    json: tuple[str, str] | None = field(default=None, repr=False, compare=False)


class Classifier:
    """Records in, aggregated events out (one per operation, target, access and result).
    Fed as the records arrive (a thread during the run), so the run's end only adds the
    last ones."""

    def __init__(self, ctx: Context, decided: Decided | None = None) -> None:
        """``decided``: what earlier runs of the same policy decided (``Decided``)."""
        self.ctx = ctx
        self.kinds = {v: k for k, v in ctx.kinds.items()}
        decided = (decided or Decided()).bounded()
        self.resolver = _Resolver(ctx, decided)
        self.seen = decided.seen
        # a directory a kept classification names -> (where it resolves now, its Stamp now)
        self.dir_now: dict[str, tuple[str, Stamp | None]] = {}
        self.aggs: dict[tuple[str, str, str], _Agg] = {}
        # a recorded directory -> (its uniform decision, the directory it resolves to), or
        # None: not uniform
        self.dir_memo: dict[str, tuple[DecisionLike, str] | None] = {}
        self.touched: dict[tuple[str, str, str], _Agg] = {}  # changed since ``take_touched``
        # records whose classification failed (skipped, the rest go on), and the first error
        self.failed = 0
        self.first_error: str | None = None
        self._accesses: dict[int, str] = {}  # an open's flags -> access_of(flags)

    def feed(self, records: Iterable[RecordLike]) -> None:
        ctx, aggs, touched = self.ctx, self.aggs, self.touched
        kinds, skip = self.kinds, ctx.unreadable_flag | ctx.relative_flag
        ops = _PATH_OPS
        accesses = self._accesses
        for r in records:
            try:
                op = ops.get(kinds.get(r.kind, ""))
                if op is not None and not r.flags & skip:
                    # the bulk of every run: a path seen before is one lookup; a new one in
                    # a system directory, one lstat (``_quick``)
                    target = r.data.decode(_FS_ENCODING, _FS_ERRORS)  # (os.fsdecode, without its call)
                    if op == "observed-exec":
                        access = "exec"
                    else:
                        access = accesses.get(r.arg) or accesses.setdefault(r.arg, access_of(r.arg))
                    k = (op, target, access)
                    a = aggs.get(k)
                    if a is None:
                        quick = self._quick(target, access)
                        res = quick or _path_result(ctx, target, access, self.resolver)
                        listed = access == "exec" and ctx.exec_allow is not None
                        if listed and res[0] == "allowed":
                            res = self._exec_allowed(target, res)
                        extra: dict[str, Any] = {}
                        if res[0] == "blocked" and " resolves to " in res[2]:
                            extra = {"resolved": res[2].split(" resolves to ", 1)[1].split(" on the host:", 1)[0]}
                        a = aggs[k] = touched[k] = _Agg(op, target, res[0], res[1], res[2], access, r.syscall, 1,
                                                        [r.pid], extra)
                        if not listed:  # (the allowlist's answer reads the file's own path)
                            self._keep_seen(r.kind, r.nr, r.data, a, quick is not None)
                        continue
                else:
                    k, a = self._other(r, kinds.get(r.kind, ""))
                a.count += 1
                if len(a.pids) < MAX_PIDS and r.pid not in a.pids:
                    a.pids.append(r.pid)
                touched[k] = a
            except Exception as e:  # one record never costs the run the rest of its log
                self.failed += 1
                if self.first_error is None:
                    self.first_error = f"{type(e).__name__}: {e}"[:300]

    def feed_raw(self, buf: bytes, layout: RawLayout) -> int:
        """``feed`` of the whole records at the start of ``buf`` as the supervisor's loop
        hands them over (``layout``), the bytes taken. A path an earlier run classified,
        in a directory that resolves where it did and is unchanged since (``Decided.seen``),
        is one lookup and no record object: the bulk of a command run again."""
        ctx, aggs, touched, seen = self.ctx, self.aggs, self.touched, self.seen
        size, unpack = layout.header.size, layout.header.unpack_from
        open_kind = ctx.kinds.get("open")
        # (an exec under an exec allowlist is answered by the program's own path: never kept)
        exec_kind = ctx.kinds.get("exec") if ctx.exec_allow is None else None
        skip = ctx.unreadable_flag | ctx.relative_flag
        accesses, still = self._accesses, self._seen_still
        off, n = 0, len(buf)
        while off + size <= n:
            ln, kind, flags, pid, nr, err, dlen, arg = unpack(buf, off)
            if ln != size + dlen or off + ln > n:
                break
            raw = buf[off + size:off + ln]
            off += ln
            if kind in (open_kind, exec_kind) and not flags & skip:
                try:
                    access = "exec" if kind == exec_kind else (
                        accesses.get(arg) or accesses.setdefault(arg, access_of(arg)))
                    s = seen.get((kind, nr, access, raw))
                    if s is not None and still(s):
                        k = s.key
                        a = aggs.get(k)
                        if a is None:
                            r3, j = s.result, s.json
                            a = _Agg(k[0], k[1], r3[0], r3[1], r3[2], access, s.syscall, 1, [pid], dict(s.extra),
                                     j[0] if j else None)
                            if not j:
                                j.append(_parts(a))  # (before it is counted: a failure here goes the general path)
                            aggs[k] = touched[k] = a
                        else:
                            a.count += 1
                            if len(a.pids) < MAX_PIDS and pid not in a.pids:
                                a.pids.append(pid)
                            touched[k] = a
                        continue
                except Exception:
                    pass  # (the general path below says what failed)
            self.feed((layout.record(kind, flags, pid, nr, err, arg, raw),))
        return off

    def _keep_seen(self, kind: int, nr: int, raw: bytes, a: _Agg, quick: bool) -> None:
        """``a``'s classification kept for later runs (``Decided.seen``), when its
        directory's Stamp is old enough to tell a later change: a change of its names
        moves its ctime to a later tick than one this far back (``_RACY_NS``). One the
        quick path made (``_quick``: its directory's memo says where it resolves), or the
        general path for a name that is no symlink (its result is then the plan's for the
        path and where its directory resolves: a PATH search's misses in $HOME), out of
        /proc and /dev (the sandbox's own: decided with no host lookup) and of the grants
        (the command may change a writable one's names while it runs, after its directory
        was checked: a path seen first then is looked up afresh)."""
        if len(self.seen) >= _DECIDED_MAX:
            return  # (the next run's ``bounded`` starts it over)
        res = self.resolver
        i = a.target.rfind("/")
        d = a.target[:i] or "/"
        if quick:
            m = self.dir_memo.get(d)
            if m is None:
                return
            rd = m[1]
        else:
            t = a.target
            if is_under(t, "/proc") or is_under(t, "/dev") or any(is_under(t, g) for g in self.ctx.grants):
                return
            rd = res.realpath(d)
            try:  # (the name itself: a loop of links, or a chain past the recursion limit, resolves to itself)
                if stat.S_ISLNK(os.lstat(rd.rstrip("/") + "/" + t[i + 1:]).st_mode):
                    return  # (where it leads is in no Stamp of this directory's)
            except FileNotFoundError:
                pass  # (not there: making it changes the directory)
            except OSError:
                return
        stamp = res.stamp.get(rd)
        if stamp is None or time.time_ns() - stamp[3] < _RACY_NS:
            return
        self.seen[(kind, nr, a.access, raw)] = _Seen((a.operation, a.target, a.access), (a.result, a.policy, a.reason),
                                                 a.syscall, tuple(a.extra.items()), d, rd, stamp, [])

    def _seen_still(self, s: _Seen) -> bool:
        """Whether a kept classification holds in this run: its directory resolves to the
        same host directory, unchanged (its Stamp: no name in it made, removed or
        retargeted since)."""
        now = self.dir_now.get(s.d)
        if now is None:
            rd = self.resolver.realpath(s.d)
            now = self.dir_now[s.d] = (rd, self.resolver.stamp.get(rd))
        return now[0] == s.rd and now[1] == s.stamp

    def _exec_allowed(self, path: str, res: tuple[str, str, str]) -> tuple[str, str, str]:
        """``res`` for an exec the walls let through, unless the exec allowlist leaves
        its program out: Landlock then refuses it (the rules hold the listed paths'
        inodes, so the program is checked where it resolves to)."""
        allow = self.ctx.exec_allow or ()
        if is_under(path, "/proc") or is_under(path, "/dev"):
            return res  # (the sandbox's own: /proc/self/exe is not the host's to resolve)
        rp = self.resolver.realpath(path)
        if any(is_under(rp, a) for a in allow) or not os.path.lexists(rp):
            return res  # (a program that is not there fails ENOENT first: a PATH search's misses)
        where = f"{path} resolves to {rp} on the host: " if rp != path else ""
        return ("blocked", "landlock",
                f"{where}outside the exec allowlist ([exec] allow): Landlock refuses to execute it (EACCES)")

    def _quick(self, path: str, access: str) -> tuple[str, str, str] | None:
        """``_path_result`` for a path (absolute, normalized: csrc/observe.c) that is no
        symlink or one to a file beside it (a library's soname), in a directory that is
        uniform (one decision for all beneath it) where it resolves to
        (``/lib/x86_64-linux-gnu`` on a merged-/usr system: every library the dynamic
        loader opens), with none of ``_path_result``'s special cases; else None."""
        res = self.resolver
        if path.startswith(res.special):
            return None
        i = path.rfind("/")
        d = path[:i] or "/"
        m = self.dir_memo.get(d)
        if m is None:
            if d in self.dir_memo:
                return None  # (not uniform)
            rd = res.realpath(d)
            u = res.uniform_dir(rd)
            m = self.dir_memo[d] = (u, rd) if u is not None else None
            if m is None:
                return None
        hit, rd = m
        name = path[i + 1:]
        stamp = res.stamp.get(rd)
        known = _NAMES.get(rd) if stamp is not None else None
        if known is not None and known[0] == stamp and name in known[1]:
            target = known[1][name]
        else:
            target = _look(rd, stamp, name, path if rd == d else rd.rstrip("/") + "/" + name)
            if target == _NOT_PLAIN:
                return None
        key = (id(hit), access)
        out = res.results.get(key)
        if out is None:
            out = res.results[key] = _decided(self.ctx, hit, path, access)
        if rd == d and target is None:
            return out
        full = rd.rstrip("/") + "/" + (name if target is None else target)
        return out[0], out[1], f"{path} resolves to {full} on the host: {out[2]}"

    def _other(self, r: RecordLike, kind: str) -> tuple[tuple[str, str, str], _Agg]:
        """The aggregate of a connect or send, or of an exec or open whose argument could
        not be read or resolved."""
        ctx = self.ctx
        extra: dict[str, Any] = {}
        if r.flags & ctx.unreadable_flag:
            op = {"exec": "observed-exec", "open": "observed-open"}.get(kind, "observed-connect")
            target = f"(unreadable: errno {r.err})"
            res: tuple[str, str, str] = ("info", "observe", "the argument could not be read from the process "
                                         "(it changed or unmapped it, or ptrace access was refused)")
            access = "exec" if kind == "exec" else "read" if kind == "open" else "connect"
        elif kind in ("exec", "open"):  # (a relative path whose directory could not be resolved)
            op = "observed-" + kind
            target = os.fsdecode(r.data)
            access = "exec" if kind == "exec" else access_of(r.arg)
            res = ("info", "observe", "a relative path whose directory could not be resolved")
        else:
            op = "observed-connect"
            assert ctx.sockaddr is not None
            fam, addr, port = ctx.sockaddr(r.data)
            if fam in ("inet", "inet6"):
                target = f"[{addr}]:{port}" if fam == "inet6" else f"{addr}:{port}"
            else:
                target = f"{fam}:{addr}" if addr else fam
            access = "connect" if kind == "connect" else "send"
            sock_type = r.arg if kind == "connect" else 2
            res = _net_result(ctx, fam, addr, port, sock_type)
            extra = {"family": fam}
        k = (op, target, access)
        a = self.aggs.get(k)
        if a is None:
            a = self.aggs[k] = _Agg(op, target, res[0], res[1], res[2], access, r.syscall, extra=extra)
        return k, a

    def take_touched(self) -> list[_Agg]:
        """The aggregates changed since the last call."""
        out = list(self.touched.values())
        self.touched.clear()
        return out

    def events(self) -> list[dict[str, Any]]:
        """Blocked first, in the order first seen within each; each a dict of
        AuditLog.event's arguments."""
        return [event_of(a) for a in self._ordered()]

    def written(self, limit: int = MAX_EVENTS) -> tuple[list[_Agg], dict[str, int]]:
        """The first ``limit`` aggregates of ``events()``'s order (``event_of`` makes each
        an event), without making the events left out (a ``find /`` has tens of
        thousands), and the counts of those by operation and result."""
        ordered = self._ordered()
        left: dict[str, int] = {}
        for a in ordered[limit:]:
            k = f"{a.operation} {a.result}"
            left[k] = left.get(k, 0) + 1
        return ordered[:limit], left

    def blocked(self) -> int:
        return sum(1 for a in self.aggs.values() if a.result == "blocked")

    def _ordered(self) -> list[_Agg]:
        return sorted(self.aggs.values(), key=lambda a: a.result != "blocked")


def event_of(a: _Agg) -> dict[str, Any]:
    return {"operation": a.operation, "target": a.target, "result": a.result, "policy": a.policy,
            "reason": a.reason, "access": a.access, "syscall": a.syscall, "count": a.count, "host_pids": a.pids,
            "basis": "predicted", **a.extra}


class LineMaker(Protocol):
    """``audit.AuditLog``: what ``line_of`` needs of it."""

    def line_start(self, run: int | None) -> str | None: ...

    def render(self, operation: str, target: str, result: str, /, **fields: Any) -> bytes: ...


# An event's fields before and after its count and pids, as its line holds them, by the
# fields: kept across runs (a process runs many commands that open the same files)
_LINE_PARTS: dict[tuple[object, ...], tuple[str, str]] = {}
_LINE_PARTS_MAX = 50_000


def _parts(a: _Agg) -> tuple[str, str]:
    """``a``'s line's fields before and after its count and pids (``_Agg.json``), made
    once per set of fields (``_LINE_PARTS``)."""
    j = a.json
    if j is not None:
        return j
    key: tuple[object, ...] = (a.operation, a.target, a.result, a.policy, a.reason, a.access, a.syscall,
                               *a.extra.items())
    try:
        j = _LINE_PARTS.get(key)
    except TypeError:  # (an unhashable extra)
        key = ()
    if j is None:
        head = plain_fields((("operation", a.operation), ("target", a.target), ("result", a.result),
                             ("policy", a.policy), ("reason", a.reason)), extra=False)
        mid = plain_fields((("access", a.access), ("syscall", a.syscall)))
        tail = plain_fields((("basis", "predicted"), *a.extra.items()))
        j = (head + mid, tail) if head is not None and mid is not None and tail is not None else ("", "")
        if key:
            if len(_LINE_PARTS) >= _LINE_PARTS_MAX:
                _LINE_PARTS.clear()
            _LINE_PARTS[key] = j
    a.json = j
    return j


def line_of(a: _Agg, log: LineMaker, run: int, start: str | None = None) -> bytes:
    """``log.render`` of ``event_of(a)`` (run=run), byte for byte (a test compares them),
    from the aggregate's other fields rendered once. ``start``: ``log.line_start(run)``
    made once for a batch of lines (their timestamp)."""
    j = a.json or _parts(a)
    if start is None:
        start = log.line_start(run)
    if (j[0] and start is not None and type(a.count) is int and len(a.pids) <= MAX_PIDS
            and all(type(p) is int for p in a.pids)):  # (a bool is no int here: json writes it true)
        line = (start + j[0] + ',"count":' + int.__repr__(a.count) + ',"host_pids":['
                + ",".join(map(int.__repr__, a.pids)) + "]" + j[1] + "}\n").encode("utf-8")
        if len(line) <= MAX_LINE:
            return line
    ev = event_of(a)
    return log.render(ev.pop("operation"), ev.pop("target"), ev.pop("result"), run=run, **ev)


def landlock_events(denials: Iterable[DenialLike]) -> list[dict[str, Any]]:
    """Landlock's records of our domain's denials, aggregated like the predicted events
    (one per target and access). These are the kernel's word (``basis: "kernel"``):
    the call was refused, which a prediction never says for what Landlock alone stops
    (the mount view showed the path, or seccomp never saw the call)."""
    aggs: dict[tuple[str, str], dict[str, Any]] = {}
    for d in denials:
        k = (d.target, d.access)
        e = aggs.get(k)
        if e is None:
            net = d.access in ("connect", "bind")
            e = aggs[k] = {"operation": LANDLOCK_DENIAL, "target": d.target, "result": "blocked",
                           "policy": "landlock", "reason": "", "access": d.access, "blockers": [], "count": 0,
                           "host_pids": [], "basis": "kernel"}
            if net:
                e["family"] = "inet6" if d.target.startswith("[") else "inet"
            if d.exe:
                e["exe"] = d.exe
            if d.syscall is not None:
                e["syscall_nr"] = d.syscall
        for b in d.blockers:
            if b not in e["blockers"]:
                e["blockers"].append(b)
        e["count"] += 1
        if d.pid is not None and d.pid not in e["host_pids"] and len(e["host_pids"]) < MAX_PIDS:
            e["host_pids"].append(d.pid)
    for e in aggs.values():
        e["reason"] = f"Landlock denied {', '.join(e['blockers']) or 'it'} (kernel audit record)"
    return list(aggs.values())


def classify(records: Iterable[RecordLike], ctx: Context) -> list[dict[str, Any]]:
    """``Classifier`` in one call."""
    c = Classifier(ctx)
    c.feed(records)
    return c.events()


# --------------------------------------------------------------------------- reading back


@dataclass
class Grouped:
    """A session's observed events, as ``stockade log --observed`` shows them."""

    programs: dict[str, int] = field(default_factory=dict)  # exec'd path -> times
    denied: list[Mapping[str, Any]] = field(default_factory=list)  # blocked execs and opens
    opened: dict[str, int] = field(default_factory=dict)  # allowed opens outside the project -> times
    hosts: list[Mapping[str, Any]] = field(default_factory=list)  # connect/send targets
    suppressed: dict[str, int] = field(default_factory=dict)
    runs: set[int] = field(default_factory=set)
    summaries: list[Mapping[str, Any]] = field(default_factory=list)


def is_observed(rec: Mapping[str, Any]) -> bool:
    op = str(rec.get("operation", ""))
    return op in OPERATIONS or op in (SUPPRESSED, SUMMARY)


def group(events: Iterable[Mapping[str, Any]], run: int | None = None) -> Grouped:
    g = Grouped()
    hosts: dict[tuple[str, str], dict[str, Any]] = {}
    denied: dict[tuple[str, str, str], dict[str, Any]] = {}
    for e in events:
        if not is_observed(e) or (run is not None and e.get("run") != run):
            continue
        if isinstance(e.get("run"), int):
            g.runs.add(int(e["run"]))
        op, target, count = e.get("operation"), str(e.get("target", "")), int(e.get("count") or 1)
        if op == SUPPRESSED:
            for k, v in (e.get("counts") or {}).items():
                g.suppressed[str(k)] = g.suppressed.get(str(k), 0) + int(v)
            continue
        if op == SUMMARY:
            g.summaries.append(e)
            continue
        if op == "observed-exec" and e.get("result") != "blocked":
            g.programs[target] = g.programs.get(target, 0) + count
        if op == LANDLOCK_DENIAL and e.get("access") in ("connect", "bind"):
            op = "observed-connect"  # with the hosts tried (its policy and reason say it is Landlock's record)
        if op in ("observed-exec", "observed-open", LANDLOCK_DENIAL) and e.get("result") == "blocked":
            k = (str(op), target, str(e.get("access", "")))
            if k in denied:
                denied[k]["count"] += count
            else:
                denied[k] = {**e, "count": count}
        elif op == "observed-open":
            g.opened[target] = g.opened.get(target, 0) + count
        elif op == "observed-connect":
            hk = (target, str(e.get("result")))
            if hk in hosts:
                hosts[hk]["count"] += count
            else:
                hosts[hk] = {**e, "count": count}
    g.denied = list(denied.values())
    g.hosts = list(hosts.values())
    return g


def top_dirs(paths: Mapping[str, int], depth: int = 2) -> dict[str, int]:
    """Paths counted by their first ``depth`` components (/usr/lib, /etc/ssl...)."""
    out: dict[str, int] = {}
    for p, n in paths.items():
        parts = p.split("/")[1:depth + 1]
        d = "/" + "/".join(parts) if parts else p
        out[d] = out.get(d, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def format_grouped(g: Grouped, *, summary: bool) -> list[str]:
    lines: list[str] = []
    if not (g.programs or g.denied or g.opened or g.hosts or g.summaries):
        return ["no observed events: run with `stockade run --observe` (or [audit] observe = true)"]
    n_runs = len(g.runs)
    lines.append(f"observed: {n_runs} run{'s' if n_runs != 1 else ''} "
                 "(results are predicted from each run's plan, not the calls' return values"
                 + ("; entries marked (kernel record) are Landlock's own denial records)"
                    if any(e.get("basis") == "kernel" for e in (*g.denied, *g.hosts)) else ")"))
    lines.append("")
    lines.append(f"programs run ({len(g.programs)}):")
    for p, n in sorted(g.programs.items(), key=lambda kv: (-kv[1], kv[0]))[: 15 if summary else None]:
        lines.append(f"  {p}" + (f"  x{n}" if n > 1 else ""))
    lines.append("")
    lines.append(f"paths denied ({len(g.denied)}):")
    for e in g.denied[: 15 if summary else None]:
        n = int(e.get("count") or 1)
        lines.append(f"  {e.get('access', '')} {e.get('target')}" + (f"  x{n}" if n > 1 else "")
                     + (f"  denied by Landlock (kernel record): {', '.join(map(str, e.get('blockers') or ()))}"
                        + (f"  ({e['exe']})" if e.get("exe") else "")
                        if e.get("operation") == LANDLOCK_DENIAL else f"  [{e.get('policy')}]  {e.get('reason')}"))
    lines.append("")
    lines.append(f"hosts tried ({len(g.hosts)}):")
    for e in g.hosts[: 15 if summary else None]:
        n = int(e.get("count") or 1)
        lines.append(f"  {e.get('access', '')} {e.get('target')}  {str(e.get('result', '')).upper()}"
                     + (f"  x{n}" if n > 1 else "") + f"  [{e.get('policy')}]  {e.get('reason')}")
    lines.append("")
    if summary:
        dirs = top_dirs(g.opened)
        lines.append(f"opened outside the project: {sum(g.opened.values())} opens of {len(g.opened)} paths, by directory:")
        for d, n in list(dirs.items())[:10]:
            lines.append(f"  {d}  {n}")
    else:
        lines.append(f"opened outside the project ({len(g.opened)}):")
        for p, n in sorted(g.opened.items()):
            lines.append(f"  {p}" + (f"  x{n}" if n > 1 else ""))
    if g.suppressed:
        lines.append("")
        lines.append("not logged one by one (over the per-run cap): "
                     + ", ".join(f"{k} {v}" for k, v in sorted(g.suppressed.items())))
    for s in g.summaries:
        lost = [f"{k} {s[k]}" for k in ("stale", "unreadable", "lost") if s.get(k)]
        if lost:
            lines.append(f"run {s.get('run')}: " + ", ".join(lost))
        ll = s.get("landlock_audit")
        if ll is not None and ll != "on":
            lines.append(f"run {s.get('run')}: Landlock's own denial records not read: {ll}")
    # what the sandbox chose (the paths it opened, the addresses it tried) cannot forge
    # a line or drive the terminal
    return [terminal_safe(line) for line in lines]


# --------------------------------------------------------------------------- policy suggest


@dataclass(frozen=True)
class Suggestion:
    line: str  # a config line (TOML) for .stockade.toml
    section: str  # the table it goes in
    risk: str  # what allowing it opens
    because: str  # the observed entry


_TOML_SHORT = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _quote(s: str) -> str:
    """``s`` as a TOML basic string that stays on its line: a path the sandbox chose
    cannot end the string or the line and add a key or a table. Controls (C0, DEL, C1)
    and the characters a terminal reorders are ``\\uNNNN`` escapes, which TOML reads
    back as the same character."""
    out = []
    for c in printable(s):
        short = _TOML_SHORT.get(c)
        if short is not None:
            out.append(short)
        elif terminal_safe(c) != c:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def suggest(events: Iterable[Mapping[str, Any]], *, project: str) -> list[Suggestion]:
    """The config lines that would allow what the observed runs were denied. Never
    applied: the user copies what they accept."""
    out: dict[tuple[str, str], Suggestion] = {}
    for e in events:
        if e.get("operation") not in OPERATIONS or e.get("result") != "blocked":
            continue
        target, pol, access = str(e.get("target", "")), str(e.get("policy", "")), str(e.get("access", ""))
        because = f"{e.get('operation')} {access} {target}: {e.get('reason')}"
        if e.get("operation") == "observed-connect" or (e.get("operation") == LANDLOCK_DENIAL
                                                         and access in ("connect", "bind")):
            if access == "bind":
                continue  # a listening port: no config line allows it (the sandbox's own network)
            host = target.rsplit(":", 1)[0].strip("[]")
            port = target.rsplit(":", 1)[-1]
            if pol in ("landlock-net", "landlock") and is_loopback(host):
                s = Suggestion(f"forward = [{port}]", "[network]",
                               f"the sandbox reaches the host's loopback port {port} (a service there acts for it)",
                               because)
            else:
                s = Suggestion(f'mode = "allow"\nallow = [{_quote(host + ":" + port)}]', "[network]",
                               f"a host: the command can send data to {host} port {port} (through the proxy)", because)
            out[(s.section, s.line)] = s
            continue
        path = str(e.get("resolved") or target)
        if pol == "landlock" and (access not in ("read", "write", "exec")
                                  or any(is_under(path, d) for d in _SANDBOX_OWN)
                                  or {"fs.make_char", "fs.make_block"} & set(e.get("blockers") or ())):
            continue  # the sandbox's own /proc, /dev, tmpfs (or an ioctl, a device node): no grant names them
        if not os.path.lexists(path):
            continue  # nothing on the host to allow (a PATH search, a probe for an optional file)
        home = _home_note(path)
        if pol == "landlock" and access == "exec":
            s = Suggestion(f"allow = [{_quote(os.path.dirname(path) or path)}]", "[exec]",
                           f"programs in {os.path.dirname(path)} may run (the exec allowlist grows)", because)
        elif pol == "secret-mask":
            rel = os.path.relpath(path, project) if is_under(path, project) else path
            s = Suggestion(f"allow = [{_quote(rel)}]", "[secrets]",
                           f"a secret pattern: {rel} matched a sensitive-file pattern; the command could read it "
                           "(and send it out, if the network allows)", because)
        elif pol == "read-only" or access == "write":
            s = Suggestion(f'path = {_quote(path)}\naccess = "rw"', "[[paths]]",
                           f"a write outside the project: the command can change {path} on the host directly, "
                           "bypassing the change set and its review" + home, because)
        elif pol in ("mount-view", "path-deny", "landlock"):
            if is_under(path, "/etc"):
                s = Suggestion(f"extra = [{_quote(path)}]", "[etc]",
                               f"read access to the host's {path} (check it holds no secret: /etc/shadow, "
                               "credentials in service configs)", because)
            else:
                what = "everything under it becomes readable" if os.path.isdir(path) else "the file becomes readable"
                s = Suggestion(f'path = {_quote(path)}\naccess = "ro"', "[[paths]]",
                               f"read access to {path} on the host: {what} (secret patterns still mask matching files)"
                               + home + ("; it is denied by a path rule now: remove that rule instead"
                                         if pol == "path-deny" else ""), because)
        else:
            continue
        out.setdefault((s.section, s.line), s)
    return list(out.values())


_SANDBOX_OWN = ("/proc", "/dev", "/sys", "/tmp", "/run")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _home_note(path: str) -> str:
    homes = {os.path.expanduser("~"), "/root"}
    if any(is_under(path, h) or is_under(h, path) for h in homes if h):
        return "; it is (or holds) a home directory, where credentials live (~/.ssh, ~/.aws, tokens in dotfiles)"
    return ""


def render(sugg: Sequence[Suggestion]) -> list[str]:
    """The suggestions as one TOML document (tables merged, each value's risk in a
    comment above it), for a user to copy from; it parses as a config tier would."""
    out: list[str] = []
    lists: dict[tuple[str, str], list[Suggestion]] = {}
    tables: list[Suggestion] = []
    for s in sugg:
        key, _, rest = s.line.partition(" = ")
        if s.section == "[[paths]]" or not rest.startswith("[") or "\n" in rest:
            if s.section == "[network]" and "\nallow = [" in s.line:  # mode = "allow" + the host
                lists.setdefault(("[network]", "allow"), []).append(s)
            else:
                tables.append(s)
            continue
        lists.setdefault((s.section, key), []).append(s)
    sections: dict[str, list[str]] = {}
    for (section, key), items in lists.items():
        body = sections.setdefault(section, [])
        if section == "[network]" and key == "allow":
            body.append('mode = "allow"')
        body.append(f"{key} = [")
        for s in items:
            # the one item of "key = [item]" (on the last line: mode = "allow" comes first);
            # a quoted value holds no raw newline, and its own " = " comes after the key's
            value = s.line.rsplit("\n", 1)[-1].partition(" = ")[2][1:-1]
            body.append(f"    # risk: {terminal_safe(s.risk)}")
            body.append(f"    # because: {terminal_safe(s.because)}")
            body.append(f"    {value},")
        body.append("]")
    for section, body in sections.items():
        out += ["", section, *body]
    for s in tables:
        # a comment is one line: what the sandbox chose is escaped in it
        out += ["", f"# risk: {terminal_safe(s.risk)}", f"# because: {terminal_safe(s.because)}", s.section, s.line]
    return out
