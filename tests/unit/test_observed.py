"""Observe mode without a sandbox: the notifying filter (run on the BPF evaluator), the
records' decoding, the classification of what a command tried, the grouping for
`log --observed`, `policy suggest`, and the bad input around it."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from stockade import observed, policy
from stockade.cgroups.rlimit import kernel_version
from stockade.errors import PolicyError, UsageError
from stockade.linux.native import lib
from stockade.linux.seccomp import evaluate
from stockade.linux.seccomp import observe as kobs
from stockade.linux.seccomp.bpf import SECCOMP_RET_ALLOW

pytestmark = pytest.mark.skipif(kobs.supported() is not None, reason="observe mode knows x86_64 and aarch64 only")

NOTIF = kobs.SECCOMP_RET_USER_NOTIF
NRS = kobs._TABLES[os.uname().machine][1]


# ---- the filter ---------------------------------------------------------------------------

def test_filter_notifies_the_observed_calls_and_allows_the_rest() -> None:
    bpf = kobs.observe_bpf()
    for name in ("execve", "execveat", "openat", "openat2", "connect"):
        assert evaluate(bpf, NRS[name]) == NOTIF, name
    for nr in (0, 1, 3, 39, 60, 231):  # read/write/close/getpid/exit... (never one of ours)
        if nr not in NRS.values():
            assert evaluate(bpf, nr) == SECCOMP_RET_ALLOW, nr


def test_sendto_without_an_address_is_not_notified() -> None:
    bpf = kobs.observe_bpf()
    assert evaluate(bpf, NRS["sendto"], [3, 0x1000, 10, 0, 0, 0]) == SECCOMP_RET_ALLOW
    assert evaluate(bpf, NRS["sendto"], [3, 0x1000, 10, 0, 0x2000, 16]) == NOTIF
    assert evaluate(bpf, NRS["sendto"], [3, 0x1000, 10, 0, 1 << 40, 16]) == NOTIF  # a high word alone


def test_sendmsg_of_inits_handoff_only_is_let_through() -> None:
    bpf = kobs.observe_bpf()
    k = lib.SK_OBSERVE_SOCK_K  # init's socket number goes here (csrc/observe.c)
    handoff = lib.SK_OBSERVE_HANDOFF_FLAGS
    assert evaluate(bpf, NRS["sendmsg"], [k, 0x1000, handoff]) == SECCOMP_RET_ALLOW
    assert evaluate(bpf, NRS["sendmsg"], [5, 0x1000, handoff]) == NOTIF
    # the number alone is not the handoff: a later socket of the command's may get it
    for flags in (0, socket.MSG_NOSIGNAL, socket.MSG_DONTWAIT):
        assert evaluate(bpf, NRS["sendmsg"], [k, 0x1000, flags]) == NOTIF, flags


def test_filter_leaves_other_abis_to_the_policy_filter() -> None:
    bpf = kobs.observe_bpf()
    assert evaluate(bpf, NRS["openat"], arch=0x40000003) == SECCOMP_RET_ALLOW  # i386
    assert evaluate(bpf, NRS["openat"] | 0x40000000) == SECCOMP_RET_ALLOW  # x32 numbers


def test_every_jump_lands_inside_the_program() -> None:
    for machine in kobs._TABLES:
        bpf = kobs.observe_bpf(machine)
        n = len(bpf) // 8
        for i in range(n):
            code, jt, jf, _k = struct.unpack_from("=HBBI", bpf, i * 8)
            if code & 0x07 == 0x05:
                assert i + 1 + jt < n and i + 1 + jf < n
        assert n < 256  # csrc/observe.c's copy


# ---- records ------------------------------------------------------------------------------

def rec(kind: int, data: bytes, *, pid: int = 7, nr: int = 257, flags: int = 0, err: int = 0, arg: int = 0) -> bytes:
    return kobs.REC.pack(kobs.REC.size + len(data), kind, flags, pid, nr, err, len(data), arg) + data


def test_records_decode_and_a_torn_tail_waits() -> None:
    buf = rec(kobs.KIND_OPEN, b"/etc/hosts") + rec(kobs.KIND_EXEC, b"/usr/bin/true", nr=NRS["execve"])
    torn = rec(kobs.KIND_OPEN, b"/etc/passwd")[:-3]
    got, used = kobs.parse_records(buf + torn)
    assert [r.path for r in got] == ["/etc/hosts", "/usr/bin/true"]
    assert used == len(buf)
    assert got[1].syscall == "execve"


def test_sockaddrs() -> None:
    v4 = struct.pack("=H", socket.AF_INET) + struct.pack("!H", 443) + socket.inet_aton("10.1.2.3") + b"\0" * 8
    assert kobs.sockaddr(v4) == ("inet", "10.1.2.3", 443)
    v6 = struct.pack("=H", socket.AF_INET6) + struct.pack("!H", 80) + b"\0" * 4 + socket.inet_pton(socket.AF_INET6, "::1")
    assert kobs.sockaddr(v6) == ("inet6", "::1", 80)
    assert kobs.sockaddr(struct.pack("=H", socket.AF_UNIX) + b"/run/x.sock\0") == ("unix", "/run/x.sock", None)
    assert kobs.sockaddr(struct.pack("=H", socket.AF_UNIX) + b"\0abs") == ("unix", "@abs", None)
    assert kobs.sockaddr(b"\x01") == ("unknown", "", None)


# ---- classification -----------------------------------------------------------------------

@dataclass(frozen=True)
class D:
    path: str
    visible: bool
    access: str
    reason: str
    source: str = "default"


def ctx(tmp_path: Path, network: str = "none", ports: tuple[int, ...] | None = None) -> observed.Context:
    proj = str(tmp_path / "proj")

    def why(p: str) -> D:
        if p.endswith("/.env"):
            return D(p, False, "masked", "masked: matches sensitive pattern '.env'")
        if p.startswith("/usr/"):
            return D(p, True, "ro", "visible read-only: system directory /usr")
        if p.startswith(proj):
            return D(p, True, "rw", "visible: inside the project")
        return D(p, False, "absent", "not visible: outside the project and every grant")

    return observed.Context(project=proj, home="/home/u", network=network, tcp_connect_ports=ports, why=why,
                            kinds={"exec": kobs.KIND_EXEC, "open": kobs.KIND_OPEN, "connect": kobs.KIND_CONNECT,
                                   "sendto": kobs.KIND_SENDTO, "sendmsg": kobs.KIND_SENDMSG},
                            unreadable_flag=kobs.F_UNREADABLE, relative_flag=kobs.F_RELATIVE, sockaddr=kobs.sockaddr)


def inet(addr: str, port: int) -> bytes:
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(addr) + b"\0" * 8


def test_classify_paths_and_hosts(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    proj = c.project
    recs, _ = kobs.parse_records(
        rec(kobs.KIND_EXEC, b"/usr/bin/git", nr=NRS["execve"])
        + rec(kobs.KIND_OPEN, b"/usr/lib/x.so") * 3
        + rec(kobs.KIND_OPEN, b"/srv/data", arg=os.O_RDONLY)
        + rec(kobs.KIND_OPEN, b"/usr/lib/new", arg=os.O_WRONLY | os.O_CREAT)
        + rec(kobs.KIND_OPEN, proj.encode() + b"/.env")
        + rec(kobs.KIND_OPEN, b"/tmp/scratch", arg=os.O_RDWR | os.O_CREAT)
        + rec(kobs.KIND_OPEN, b"/home/u/.cache/x", arg=os.O_WRONLY | os.O_CREAT)
        + rec(kobs.KIND_CONNECT, inet("127.0.0.1", 5432), nr=NRS["connect"], arg=1)
        + rec(kobs.KIND_CONNECT, inet("93.184.216.34", 443), nr=NRS["connect"], arg=1)
        + rec(kobs.KIND_OPEN, b"", flags=kobs.F_UNREADABLE, err=14)
    )
    ev = observed.classify(recs, c)
    by = {(e["operation"], e["target"]): e for e in ev}
    assert ev[0]["result"] == "blocked"  # blocked ones first
    assert by[("observed-exec", "/usr/bin/git")]["result"] == "allowed"
    assert by[("observed-open", "/usr/lib/x.so")]["count"] == 3
    assert by[("observed-open", "/srv/data")]["result"] == "blocked"
    assert by[("observed-open", "/srv/data")]["policy"] == "mount-view"
    w = by[("observed-open", "/usr/lib/new")]
    assert (w["result"], w["policy"], w["access"]) == ("blocked", "read-only", "write")
    s = by[("observed-open", proj + "/.env")]
    assert (s["result"], s["policy"]) == ("blocked", "secret-mask")
    assert by[("observed-open", "/tmp/scratch")]["policy"] == "sandbox-tmpfs"
    assert by[("observed-open", "/home/u/.cache/x")]["result"] == "allowed"  # the sandbox's own $HOME
    assert by[("observed-connect", "127.0.0.1:5432")]["result"] == "allowed"
    out = by[("observed-connect", "93.184.216.34:443")]
    assert (out["result"], out["policy"]) == ("blocked", "net-none")
    assert by[("observed-open", "(unreadable: errno 14)")]["result"] == "info"
    assert all(e["basis"] == "predicted" for e in ev)


def test_landlock_tcp_rules_decide_a_loopback_connect(tmp_path: Path) -> None:
    recs, _ = kobs.parse_records(rec(kobs.KIND_CONNECT, inet("127.0.0.1", 5432), nr=NRS["connect"], arg=1)
                                 + rec(kobs.KIND_CONNECT, inet("127.0.0.1", 8080), nr=NRS["connect"], arg=1)
                                 + rec(kobs.KIND_CONNECT, inet("127.0.0.1", 53), nr=NRS["connect"], arg=2))
    ev = {e["target"]: e for e in observed.classify(recs, ctx(tmp_path, ports=(5432,)))}
    assert ev["127.0.0.1:5432"]["result"] == "allowed"
    assert (ev["127.0.0.1:8080"]["result"], ev["127.0.0.1:8080"]["policy"]) == ("blocked", "landlock-net")
    assert ev["127.0.0.1:53"]["result"] == "allowed"  # UDP: Landlock has no rule for it


def test_host_network_allows(tmp_path: Path) -> None:
    recs, _ = kobs.parse_records(rec(kobs.KIND_SENDTO, inet("8.8.8.8", 53), nr=NRS["sendto"]))
    (e,) = observed.classify(recs, ctx(tmp_path, network="host"))
    assert (e["result"], e["access"]) == ("allowed", "send")


def test_cap_counts_what_is_left_out(tmp_path: Path) -> None:
    recs, _ = kobs.parse_records(b"".join(rec(kobs.KIND_OPEN, f"/usr/lib/x{i}".encode()) for i in range(5)))
    c = observed.Classifier(ctx(tmp_path))
    c.feed(recs)
    kept, left = c.written(2)
    assert len(kept) == 2 and left == {"observed-open allowed": 3}


def test_the_sandboxs_own_proc_dev_and_etc_are_decided_with_no_host_lookup(tmp_path: Path) -> None:
    """On the host, /proc/self is the supervisor, /dev/stdout its caller's output and
    /proc/1 the host's init; inside they are the command's own (its PID namespace, its
    descriptors), and /etc/hosts is the runtime's. Resolving them on the host predicted
    them blocked (and `policy suggest` offered the caller's output file for writing)."""
    asked: list[str] = []
    base = ctx(tmp_path)

    def why(p: str) -> D:
        asked.append(p)
        if p == "/proc/kcore":
            return D(p, False, "masked", "masked: /proc/kcore is hidden in the sandbox's procfs")
        if p.startswith("/etc/hosts"):
            return D(p, True, "ro", "visible read-only: written by the runtime (/etc/hosts)")
        if p.startswith("/dev/"):
            return D(p, True, "rw", "visible: a device of the sandbox's minimal /dev")
        return base.why(p)

    c = observed.Context(**{**base.__dict__, "why": why, "own_etc": ("/etc/hosts", "/etc/passwd")})
    own = [("/proc/self/status", os.O_RDONLY), ("/proc/thread-self/comm", os.O_WRONLY), ("/proc/1/cmdline", 0),
           ("/proc/4242/fd", 0), ("/dev/stdout", os.O_WRONLY), ("/dev/fd/3", 0), ("/dev/fd", 0), ("/dev/stdin", 0),
           ("/etc/hosts", 0), ("/dev/null", os.O_WRONLY), ("/proc/kcore", 0)]
    recs, _ = kobs.parse_records(b"".join(rec(kobs.KIND_OPEN, p.encode(), arg=f) for p, f in own))
    real_lstat = os.lstat

    def lstat(p: Any, *a: Any, **k: Any) -> os.stat_result:
        assert not str(p).startswith(("/proc", "/dev", "/etc/hosts")), f"looked up on the host: {p}"
        return real_lstat(p, *a, **k)

    with mock.patch("os.lstat", lstat), mock.patch("os.path.realpath", side_effect=AssertionError("realpath")):
        ev = {e["target"]: e for e in observed.classify(recs, c)}
    for p, _f in own[:-1]:
        assert (ev[p]["result"], "resolves to" in ev[p]["reason"]) == ("allowed", False), ev[p]
    assert ev["/proc/1/cmdline"]["reason"] == "the sandbox's own procfs: a process of its own PID namespace"
    assert "/proc/self/fd" in ev["/dev/stdout"]["reason"]
    assert ev["/proc/kcore"]["result"] == "blocked"
    # policy why's view of the rest, asked with the path as the sandbox names it
    assert set(asked) == {"/etc/hosts", "/dev/null", "/proc/kcore"}


@pytest.fixture()
def var_tmp() -> Iterator[Path]:
    """A directory outside /tmp (a path under /tmp is the sandbox's own tmpfs: decided apart)."""
    d = Path(tempfile.mkdtemp(prefix="stockade-test-", dir="/var/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d)


def test_the_quick_path_decides_as_the_general_one(var_tmp: Path) -> None:
    """A new path in a uniform system directory is decided by one lstat (``_quick``):
    the events are those the general path (``_path_result`` for every record) makes,
    symlinks, directories that resolve elsewhere and missing files included."""
    tmp_path = var_tmp
    sysd = tmp_path / "sys"
    (sysd / "lib" / "sub").mkdir(parents=True)
    (sysd / "lib" / "a.so").write_text("x")
    (sysd / "lib" / "sub" / "b.py").write_text("x")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / ".env").write_text("x")
    (sysd / "lib" / "alias").symlink_to(tmp_path / "secret" / ".env")  # a file link out of the system dir
    (sysd / "lib" / "inner").symlink_to(sysd / "lib" / "a.so")  # a link within it
    (sysd / "linked").symlink_to(sysd / "lib")  # a directory that resolves elsewhere
    (sysd / "lib" / "libz.so.1.2.13").write_text("x")
    (sysd / "lib" / "libz.so.1").symlink_to("libz.so.1.2.13")  # a soname: a link to a file beside it
    (sysd / "lib" / "chain").symlink_to("libz.so.1")  # a link to a link
    (sysd / "lib" / "dangling").symlink_to("nothere")
    (sysd / "lib" / "up").symlink_to("../lib/a.so")
    old = time.time() - 60  # old directories: what a run learns of their names is kept for the next
    for d in (sysd / "lib", sysd / "lib" / "sub", sysd):
        os.utime(d, (old, old), follow_symlinks=False)
    base = ctx(tmp_path)

    def why(p: str) -> D:
        if p.startswith(str(sysd) + "/") or p == str(sysd):
            return D(p, True, "ro", f"visible read-only: system directory {sysd}")
        return base.why(p)  # type: ignore[return-value]

    c = observed.Context(**{**base.__dict__, "why": why,
                            "uniform": lambda d: d == str(sysd) or d.startswith(str(sysd) + "/")})
    paths = [f"{sysd}/lib/a.so", f"{sysd}/lib/a.so", f"{sysd}/lib/sub/b.py", f"{sysd}/lib/missing",
             f"{sysd}/lib/alias", f"{sysd}/lib/inner", f"{sysd}/linked/a.so", f"{sysd}/linked/sub/b.py",
             f"{sysd}/lib/libz.so.1", f"{sysd}/linked/libz.so.1", f"{sysd}/lib/chain", f"{sysd}/lib/dangling",
             f"{sysd}/lib/up", f"{tmp_path}/secret/.env", "/tmp/x", f"{c.project}/src/main.py", f"{sysd}"]
    data = b"".join(rec(kobs.KIND_OPEN, p.encode(), arg=flags) for p in paths for flags in (os.O_RDONLY, os.O_WRONLY))
    data += rec(kobs.KIND_EXEC, f"{sysd}/lib/a.so".encode(), nr=NRS["execve"])
    recs, _ = kobs.parse_records(data)
    general: list[str] = []
    real_path_result = observed._path_result

    def path_result(*a: Any, **kw: Any) -> tuple[str, str, str]:
        general.append(a[1])
        return real_path_result(*a, **kw)

    runs = []
    for _ in range(2):  # the second run with what the first learnt of the names
        general.clear()
        cl = observed.Classifier(c)
        with mock.patch.object(observed, "_path_result", path_result):
            cl.feed(recs)
        runs.append({(a.operation, a.target, a.access): (a.result, a.policy, a.reason, a.count, a.extra)
                     for a in cl.aggs.values()})
        assert cl.dir_memo.get(f"{sysd}/lib") is not None  # the quick path was taken
        assert cl.dir_memo.get(f"{sysd}/linked") is not None  # there too (resolved elsewhere: merged /usr's /lib)
        # a soname (through either directory) is the quick path's; a chain, a dangling
        # link and one leading up and back are the general path's
        assert not {f"{sysd}/lib/libz.so.1", f"{sysd}/linked/libz.so.1", f"{sysd}/lib/a.so"} & set(general)
        assert {f"{sysd}/lib/chain", f"{sysd}/lib/dangling", f"{sysd}/lib/up"} <= set(general)
    assert observed._NAMES[f"{sysd}/lib"][1].get("libz.so.1") == "libz.so.1.2.13"
    got = runs[1]
    assert runs[0] == got
    want: dict[tuple[str, str, str], tuple[str, str, str, int, dict[str, str]]] = {}
    for r in recs:
        kind = "exec" if r.kind == kobs.KIND_EXEC else "open"
        access = "exec" if kind == "exec" else observed.access_of(r.arg)
        k = ("observed-" + kind, r.path, access)
        res = observed._path_result(c, r.path, access)  # a fresh resolver each time: no memo at all
        extra = ({"resolved": res[2].split(" resolves to ", 1)[1].split(" on the host:", 1)[0]}
                 if res[0] == "blocked" and " resolves to " in res[2] else {})
        n = want[k][3] + 1 if k in want else 1
        want[k] = (res[0], res[1], res[2], n, extra)
    assert got == want
    assert got[("observed-open", f"{sysd}/lib/alias", "read")][0] == "blocked"  # the link out is seen


def test_a_uniform_tree_is_decided_at_its_top(var_tmp: Path) -> None:
    """Files in forty directories of a uniform tree cost one policy decision (its top's:
    a subdirectory of a uniform directory is uniform, with its decision), while a deny
    below makes the directories above it non-uniform: decided one by one, and right."""
    sysd = var_tmp / "sys"
    dirs = [sysd / "lib" / f"m{i}" / "__pycache__" for i in range(40)]
    for d in dirs:
        d.mkdir(parents=True)
        (d / "x.pyc").write_text("x")
    deny = sysd / "lib" / "m7"
    asked: list[str] = []

    def why(p: str) -> D:
        asked.append(p)
        if observed.is_under(p, str(deny)):
            return D(p, False, "denied", f"denied by path rule {deny}")
        return D(p, True, "ro", f"visible read-only: system directory {sysd}")

    def uniform(d: str) -> bool:  # beneath sysd, the deny neither at, below nor above it
        return observed.is_under(d, str(sysd)) and not observed.is_under(str(deny), d) and not observed.is_under(d, str(deny))

    base = ctx(var_tmp)
    for with_deny in (False, True):
        asked.clear()
        u = uniform if with_deny else (lambda d: observed.is_under(d, str(sysd)))
        c = observed.Context(**{**base.__dict__, "why": why, "uniform": u})
        cl = observed.Classifier(c)
        cl.feed(kobs.parse_records(b"".join(rec(kobs.KIND_OPEN, str(d / "x.pyc").encode()) for d in dirs))[0])
        results = {a.target: a.result for a in cl.aggs.values()}
        assert results == {str(d / "x.pyc"): "blocked" if with_deny and d.parent == deny else "allowed" for d in dirs}
        # without the deny: sysd itself; with it: sysd/lib's 39 other children, m7's file
        assert len(asked) == (1 if not with_deny else 40), asked


# ---- reading back -------------------------------------------------------------------------

EVENTS = [
    {"operation": "observed-exec", "target": "/usr/bin/git", "result": "allowed", "count": 2, "run": 1},
    {"operation": "observed-open", "target": "/etc/shadow", "result": "blocked", "policy": "mount-view",
     "reason": "/etc is hidden", "access": "read", "count": 1, "run": 1},
    {"operation": "observed-open", "target": "/usr/lib/a.so", "result": "allowed", "count": 4, "run": 1},
    {"operation": "observed-open", "target": "/usr/lib/b.so", "result": "allowed", "count": 1, "run": 2},
    {"operation": "observed-connect", "target": "10.0.0.1:443", "result": "blocked", "policy": "net-none",
     "reason": "no route out", "access": "connect", "count": 1, "run": 2},
    {"operation": "observed-suppressed", "counts": {"observed-open allowed": 9}, "run": 2},
    {"operation": "run", "target": "/p", "result": "started", "run": 1},
]


def test_group_and_format() -> None:
    g = observed.group(EVENTS)
    assert g.programs == {"/usr/bin/git": 2}
    assert [e["target"] for e in g.denied] == ["/etc/shadow"]
    assert g.opened == {"/usr/lib/a.so": 4, "/usr/lib/b.so": 1}
    assert [e["target"] for e in g.hosts] == ["10.0.0.1:443"]
    assert g.suppressed == {"observed-open allowed": 9}
    assert g.runs == {1, 2}
    assert observed.group(EVENTS, run=2).programs == {}
    text = "\n".join(observed.format_grouped(g, summary=True))
    for part in ("programs run (1)", "paths denied (1)", "/etc/shadow", "hosts tried (1)", "10.0.0.1:443",
                 "/usr/lib  5", "not logged one by one"):
        assert part in text, part
    assert "no observed events" in observed.format_grouped(observed.group([]), summary=False)[0]


def test_suggest_marks_each_line_with_its_risk(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / ".env").write_text("x")
    data = tmp_path / "data"
    data.mkdir()
    events = [
        {"operation": "observed-open", "target": str(proj / ".env"), "result": "blocked", "policy": "secret-mask",
         "access": "read"},
        {"operation": "observed-open", "target": "/etc/hostname", "result": "blocked", "policy": "mount-view",
         "access": "read"},
        {"operation": "observed-open", "target": str(data), "result": "blocked", "policy": "mount-view",
         "access": "read"},
        {"operation": "observed-open", "target": str(data / "out"), "result": "blocked", "policy": "read-only",
         "access": "write", "resolved": str(data)},
        {"operation": "observed-connect", "target": "93.184.216.34:443", "result": "blocked", "policy": "net-none",
         "access": "connect"},
        {"operation": "observed-exec", "target": "/nonexistent/x", "result": "blocked", "policy": "mount-view",
         "access": "exec"},  # nothing on the host to allow: no line
        {"operation": "observed-open", "target": "/usr/lib/a", "result": "allowed"},
    ]
    sugg = observed.suggest(events, project=str(proj))
    by = {s.section + " " + s.line: s for s in sugg}
    assert '[secrets] allow = [".env"]' in by and "secret pattern" in by['[secrets] allow = [".env"]'].risk
    assert '[etc] extra = ["/etc/hostname"]' in by
    assert f'[[paths]] path = "{data}"\naccess = "ro"' in by
    rw = by[f'[[paths]] path = "{data}"\naccess = "rw"']
    assert "write outside the project" in rw.risk
    net = by['[network] mode = "allow"\nallow = ["93.184.216.34:443"]']
    assert "a host" in net.risk
    assert len(sugg) == 5
    import tomllib

    doc = tomllib.loads("\n".join(observed.render(sugg)))
    assert doc["secrets"]["allow"] == [".env"] and doc["etc"]["extra"] == ["/etc/hostname"]
    assert doc["network"] == {"mode": "allow", "allow": ["93.184.216.34:443"]}
    assert sorted(p["access"] for p in doc["paths"]) == ["ro", "rw"]



# ---- what the sandbox chose, printed: no forged line, no escape sequence ------------------

HOSTILE = ["/tmp/x\n  /etc/FAKE-LINE-INJECTED", "/tmp/\x1b[2J\x1b[31mRED", "@abs\n\x1b[31mUNIX", "/tmp/a\rb",
           "/tmp/c1\x9b31m\x85", "/tmp/del\x7f", "/tmp/bidi\u202egpj.exe", "/tmp/ls\u2028x"]


def _no_controls(text: str) -> None:
    bad = [c for c in text if ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f or c in "\u2028\u2029\u202e"]
    assert not bad, (bad, text)


def test_format_grouped_escapes_what_the_sandbox_chose() -> None:
    events = [{"operation": "observed-open", "target": t, "result": "allowed", "run": 1, "access": "read"}
              for t in HOSTILE]
    events += [{"operation": "observed-open", "target": "/etc/sh\nadow", "result": "blocked", "run": 1,
                "access": "read", "policy": "mount-view", "reason": "not in the view: /etc/sh\nadow"},
               {"operation": "observed-connect", "target": "@abs\n\x1b[31mUNIX", "result": "blocked", "run": 1,
                "access": "sendto", "policy": "net-none", "reason": "no network"},
               {"operation": "observed-exec", "target": "/bin/\x1b]0;title\x07x", "result": "allowed", "run": 1}]
    for summary in (False, True):
        lines = observed.format_grouped(observed.group(events), summary=summary)
        for line in lines:
            _no_controls(line)
        assert not any("FAKE-LINE-INJECTED" in ln and not ln.startswith("  /tmp/x\\n") for ln in lines)
    text = "\n".join(observed.format_grouped(observed.group(events), summary=False))
    for shown in ("/tmp/x\\n  /etc/FAKE-LINE-INJECTED", "/tmp/\\x1b[2J\\x1b[31mRED", "@abs\\n\\x1b[31mUNIX",
                  "/tmp/a\\rb", "/tmp/c1\\x9b31m\\x85", "/tmp/del\\x7f", "/tmp/bidi\\u202egpj.exe",
                  "/etc/sh\\nadow", "/bin/\\x1b]0;title\\x07x"):
        assert shown in text, shown


def test_format_event_escapes_targets_reasons_and_argv() -> None:
    from stockade import audit

    for t in HOSTILE:
        line = audit.format_event({"timestamp": "T", "run": 1, "operation": "observed-open", "target": t,
                                   "result": "allowed", "reason": f"why {t}", "argv": ["sh", t]})
        _no_controls(line)
    line = audit.format_event({"timestamp": "T", "run": 1, "operation": "net-connect", "target": "h\n:1",
                               "result": "blocked", "reason": "x\x1b[2J"})
    _no_controls(line)
    assert "h\\n:1" in line and "x\\x1b[2J" in line


def test_suggest_of_a_hostile_path_is_one_value_of_valid_toml(tmp_path: Path) -> None:
    import tomllib

    proj = tmp_path / "proj"
    proj.mkdir()
    # a name that would end the string, the line and open a table if it were printed raw
    evil = tmp_path / 'd"]\n[network]\nmode = "allow"\nallow = ["*"]\n# \x1b[2J\u202e'
    evil.mkdir()
    etc_like = tmp_path / "plain"
    etc_like.mkdir()
    events = [
        {"operation": "observed-open", "target": str(evil), "result": "blocked", "policy": "mount-view",
         "access": "read", "reason": f"not in the view: {evil}"},
        {"operation": "observed-open", "target": str(evil / "f"), "result": "blocked", "policy": "read-only",
         "access": "write", "resolved": str(evil), "reason": "read-only"},
    ]
    sugg = observed.suggest(events, project=str(proj))
    assert len(sugg) == 2
    text = "\n".join(observed.render(sugg))
    _no_controls(text.replace("\n", " "))
    doc = tomllib.loads(text)
    assert set(doc) == {"paths"}, doc
    assert [p["path"] for p in doc["paths"]] == [str(evil), str(evil)]
    assert sorted(p["access"] for p in doc["paths"]) == ["ro", "rw"]
    assert all(set(p) == {"path", "access"} for p in doc["paths"])
    # in a list table too ([etc] extra, [secrets] allow): one item, the same string back
    evil_secret = proj / '.env"]\nx = 1\n['
    evil_secret.write_text("x")
    sugg = observed.suggest([{"operation": "observed-open", "target": str(evil_secret), "result": "blocked",
                              "policy": "secret-mask", "access": "read"}], project=str(proj))
    doc = tomllib.loads("\n".join(observed.render(sugg)))
    assert doc == {"secrets": {"allow": ['.env"]\nx = 1\n[']}}


# ---- bad input and config -----------------------------------------------------------------

def test_observe_needs_seccomp() -> None:
    from stockade.core.prepare import check_observe

    with pytest.raises(UsageError, match="--observe needs seccomp"):
        check_observe(True, "off")
    check_observe(True, "default")
    check_observe(False, "off")


def test_profiles_still_refuse_notify(tmp_path: Path) -> None:
    import json

    from stockade.linux import seccomp

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_NATIVE"],
                                "syscalls": [{"names": ["openat"], "action": "SCMP_ACT_NOTIFY"}]}))
    with pytest.raises(PolicyError, match="observe mode"):
        seccomp.compile_profile(str(prof))


def test_audit_observe_config(config_env: dict[str, Path]) -> None:
    config_env["workspace"].write_text("[audit]\nobserve = true\n")
    eff = policy.load(config_env["proj"], None)
    assert eff.observe is True and eff.observe_origin.layer == "workspace"
    config_env["workspace"].write_text("[audit]\nobserve = \"yes\"\n")
    policy.clear_cache()
    with pytest.raises(PolicyError, match=r"audit\.observe"):
        policy.load(config_env["proj"], None)


def test_doctor_says_what_this_host_gives() -> None:
    from stockade import doctor

    p = doctor.probe_observe()
    assert p.name == "observe" and p.status in ("ok", "info")
    first, second = p.detail.split("\n")
    assert first.startswith("observe via seccomp: ") and second.startswith("Landlock denial audit: ")
    assert p.data["seccomp"] is (p.status == "ok")
    if p.data["seccomp"]:  # and what an observed call costs here, by the kernel's release
        rel = kernel_version()
        same = rel >= (6, 6)
        assert p.data["observe_wakeup"] == ("same-cpu" if same else "usual")
        assert ("handed over on one CPU" in first) is same and ("no synchronous hand-over" in first) is not same


def test_an_events_line_is_the_audit_logs_line(tmp_path: Path) -> None:
    """``line_of`` (an aggregate's other fields rendered once, and kept for later runs)
    writes, byte for byte, what ``AuditLog.render`` writes for its event."""
    from stockade import audit
    from tests.unit.test_audit import render_general

    @dataclass(frozen=True)
    class Sess:
        id: str
        events_path: Path

    log = audit.AuditLog(Sess("0101-abcdef", tmp_path / "events.jsonl"))

    def aggs() -> list[observed._Agg]:
        return [
            observed._Agg("observed-open", "/usr/lib/x.so", "allowed", "view", "system directory /usr", "read",
                          "openat"),
            observed._Agg("observed-open", "/p/caf\u00e9\n\"x\"", "blocked", "mount-view", "r" * 3000, "write",
                          "openat", extra={"resolved": "/etc/x"}),
            observed._Agg("observed-connect", "10.0.0.1:443", "blocked", "net-none",
                          "no route out (token=hunter2hunter2)", "connect", "connect", extra={"family": "inet"}),
            observed._Agg("observed-exec", "/bin/x", "allowed", "view", "ok", "exec", "execve", extra={"odd": 1.5}),
            observed._Agg("observed-exec", "/bin/y", "allowed", "view", "ok", "exec", "execve", extra={"l": [1]}),
        ]

    now = audit._now
    try:
        audit._now = lambda: "2026-01-01T00:00:00.000Z"
        for run in (3, 4):  # the second run's aggregates take their parts from the first's
            for a in aggs():
                for count, pids in ((1, [10]), (2, [10, 11]), (9, list(range(8))), (1, [True]), (True, [7])):
                    a.count, a.pids = count, pids
                    ev = observed.event_of(a)
                    want = render_general(log, ev.pop("operation"), ev.pop("target"), ev.pop("result"), run=run, **ev)
                    assert observed.line_of(a, log, run) == want
    finally:
        audit._now = now
    a = aggs()[0]
    observed.line_of(a, log, 1)
    assert a.json and a.json[0]  # made directly
    b = aggs()[3]
    observed.line_of(b, log, 1)
    assert b.json == ("", "")  # a float: the general path


@pytest.mark.parametrize("via", ["lib", "linked"])
@pytest.mark.parametrize("mtime_put_back", [False, True])
def test_a_file_known_to_be_no_link_is_checked_again_when_its_directory_changes(
        var_tmp: Path, via: str, mtime_put_back: bool) -> None:
    """Across runs, a name known to be no symlink needs no lstat while its directory is
    unchanged; replacing it by a symlink changes the directory, and the next run sees it.
    The same through a directory that is a symlink (``/lib`` -> ``usr/lib``): what is
    known is the resolved directory's; and when the directory's mtime is put back after
    the change (tar, rsync -a, touch -d do), by its ctime."""
    sysd = var_tmp / "sys"
    (sysd / "lib").mkdir(parents=True)
    (sysd / "linked").symlink_to("lib")
    (sysd / "lib" / "a.so").write_text("x")
    (var_tmp / "secret").mkdir()
    (var_tmp / "secret" / ".env").write_text("x")
    old = time.time() - 60  # an old directory: not "racy"
    os.utime(sysd / "lib", (old, old))
    base = ctx(var_tmp)

    def why(p: str) -> D:
        if p == str(sysd) or p.startswith(str(sysd) + "/"):
            return D(p, True, "ro", "visible read-only: system directory")
        return base.why(p)  # type: ignore[return-value]

    c = observed.Context(**{**base.__dict__, "why": why,
                            "uniform": lambda d: d == str(sysd) or d.startswith(str(sysd) + "/")})
    path = f"{sysd}/{via}/a.so"
    recs, _ = kobs.parse_records(rec(kobs.KIND_OPEN, path.encode()))

    def result() -> str:
        cl = observed.Classifier(c)
        cl.feed(recs)
        (a,) = cl.aggs.values()
        assert cl.dir_memo.get(f"{sysd}/{via}") is not None  # (the quick path)
        return a.result

    assert result() == "allowed"
    assert "a.so" in observed._NAMES[f"{sysd}/lib"][1]  # remembered for the next run
    assert result() == "allowed"
    before = os.stat(sysd / "lib").st_mtime_ns
    (sysd / "lib" / "a.so").unlink()
    (sysd / "lib" / "a.so").symlink_to(var_tmp / "secret" / ".env")
    if mtime_put_back:
        os.utime(sysd / "lib", ns=(before, before))
        assert os.stat(sysd / "lib").st_mtime_ns == before
    assert result() == "blocked"  # the directory changed: looked at again


def test_a_soname_retargeted_out_of_its_directory_is_seen_in_the_next_run(var_tmp: Path) -> None:
    """A soname link (a file beside it) is remembered across runs with its target, as of
    its directory; pointing it elsewhere changes the directory, and the next run follows
    the new target."""
    sysd = var_tmp / "sys"
    (sysd / "lib").mkdir(parents=True)
    (sysd / "lib" / "libx.so.1.0").write_text("x")
    (sysd / "lib" / "libx.so.1").symlink_to("libx.so.1.0")
    (var_tmp / "secret").mkdir()
    (var_tmp / "secret" / ".env").write_text("x")
    old = time.time() - 60
    os.utime(sysd / "lib", (old, old))
    base = ctx(var_tmp)

    def why(p: str) -> D:
        if observed.is_under(p, str(sysd)):
            return D(p, True, "ro", "visible read-only: system directory")
        return base.why(p)  # type: ignore[return-value]

    c = observed.Context(**{**base.__dict__, "why": why, "uniform": lambda d: observed.is_under(d, str(sysd))})
    recs, _ = kobs.parse_records(rec(kobs.KIND_OPEN, f"{sysd}/lib/libx.so.1".encode()))

    def result() -> tuple[str, str]:
        cl = observed.Classifier(c)
        cl.feed(recs)
        (a,) = cl.aggs.values()
        return a.result, a.reason

    assert result() == ("allowed", f"{sysd}/lib/libx.so.1 resolves to {sysd}/lib/libx.so.1.0 on the host: "
                                   "visible read-only: system directory")
    assert observed._NAMES[f"{sysd}/lib"][1]["libx.so.1"] == "libx.so.1.0"
    assert result()[0] == "allowed"  # (from what the first run learnt)
    (sysd / "lib" / "libx.so.1").unlink()
    (sysd / "lib" / "libx.so.1").symlink_to(var_tmp / "secret" / ".env")
    assert result()[0] == "blocked"


LAYOUT = observed.RawLayout(kobs.REC, kobs.syscall_name, kobs.Record)


@pytest.mark.parametrize("change", ["file-to-link", "mtime-put-back", "soname-retargeted", "dir-retargeted",
                                    "general-file-to-link", "none"])
def test_a_kept_classification_is_one_lookup_until_its_directory_changes(var_tmp: Path, change: str) -> None:
    """A path an earlier run of the same policy classified (``Decided.seen``) is taken
    as it was, with no decision and no record object, while its directory resolves to
    the same host directory with the same Stamp; a name made a link, a soname pointed
    elsewhere (its mtime put back or not), a directory link retargeted: the next run
    classifies it again, and agrees with the general path. The same for a file of a
    directory that is not uniform (the general path's answer), unless the file is a
    link (where it leads is no Stamp of its directory's). An exec under an exec
    allowlist is never kept (its answer reads the program's own path)."""
    sysd = var_tmp / "sys"
    for d in ("lib", "other", "gen"):
        (sysd / d).mkdir(parents=True)
    (sysd / "gen" / "b.cfg").write_text("x")
    (sysd / "gen" / "link").symlink_to("../lib/a.so")
    (sysd / "lib" / "a.so").write_text("x")
    (sysd / "lib" / "libx.so.1.0").write_text("x")
    (sysd / "lib" / "libx.so.1").symlink_to("libx.so.1.0")
    (var_tmp / "secret").mkdir()
    (var_tmp / "secret" / ".env").write_text("x")
    (sysd / "other" / "a.so").symlink_to(var_tmp / "secret" / ".env")
    (sysd / "linked").symlink_to("lib")
    old = time.time() - 60  # old directories: not "racy"
    for d in (sysd / "lib", sysd / "other", sysd / "gen", sysd):
        os.utime(d, (old, old), follow_symlinks=False)
    racy = 50_000_000  # (their ctimes are now's: what is kept needs them this old)
    time.sleep(racy * 2 / 1e9)
    base = ctx(var_tmp)

    def why(p: str) -> D:
        if observed.is_under(p, str(sysd)):
            return D(p, True, "ro", "visible read-only: system directory")
        return base.why(p)  # type: ignore[return-value]

    def uniform(d: str) -> bool:
        return observed.is_under(d, str(sysd)) and not observed.is_under(d, str(sysd / "gen"))

    c = observed.Context(**{**base.__dict__, "why": why, "uniform": uniform, "exec_allow": (str(sysd / "other"),)})
    paths = [f"{sysd}/lib/a.so", f"{sysd}/lib/libx.so.1", f"{sysd}/linked/a.so", f"{sysd}/gen/b.cfg",
             f"{sysd}/gen/link"]
    data = b"".join(rec(kobs.KIND_OPEN, p.encode(), arg=fl) for p in paths for fl in (os.O_RDONLY, os.O_RDWR))
    data += rec(kobs.KIND_EXEC, f"{sysd}/lib/a.so".encode(), nr=NRS["execve"])
    dec = observed.Decided()
    calls: list[str] = []
    real_quick = observed.Classifier._quick

    def quick(self: observed.Classifier, path: str, access: str) -> tuple[str, str, str] | None:
        calls.append(path)
        return real_quick(self, path, access)

    general_calls: list[str] = []
    real_path_result = observed._path_result

    def path_result(*a: Any, **kw: Any) -> tuple[str, str, str]:
        general_calls.append(a[1])
        return real_path_result(*a, **kw)

    def run() -> dict[tuple[str, str, str], tuple[str, str, str, str, int]]:
        calls.clear()
        general_calls.clear()
        cl = observed.Classifier(c, dec)
        with mock.patch.object(observed.Classifier, "_quick", quick), mock.patch.object(observed, "_RACY_NS", racy), \
                mock.patch.object(observed, "_path_result", path_result):
            assert cl.feed_raw(data + rec(kobs.KIND_OPEN, b"/torn")[:-2], LAYOUT) == len(data)
        return {k: (a.result, a.policy, a.reason, a.syscall, a.count) for k, a in cl.aggs.items()}

    def general() -> dict[tuple[str, str, str], tuple[str, str, str, str, int]]:
        cl = observed.Classifier(c)
        cl.feed(kobs.parse_records(data)[0])
        return {k: (a.result, a.policy, a.reason, a.syscall, a.count) for k, a in cl.aggs.items()}

    first = run()
    assert first == general()
    assert len(calls) == 11  # every path classified
    assert {k[2] for k in dec.seen} == {"read", "write"}  # (the exec is the allowlist's: not kept)
    assert run() == first
    # only the exec and the link of the directory that is not uniform: the rest were one lookup each
    assert sorted(set(calls)) == [f"{sysd}/gen/link", f"{sysd}/lib/a.so"]
    assert set(general_calls) == {f"{sysd}/gen/link"}
    a_so = {f"{sysd}/lib/a.so", f"{sysd}/linked/a.so"}  # (one file, named through the link too)
    targets = {"file-to-link": a_so | {f"{sysd}/gen/link"}, "mtime-put-back": a_so | {f"{sysd}/gen/link"},
               "soname-retargeted": {f"{sysd}/lib/libx.so.1"}, "dir-retargeted": {f"{sysd}/linked/a.so"},
               "general-file-to-link": {f"{sysd}/gen/b.cfg"}}.get(change, set())
    if change in ("file-to-link", "mtime-put-back"):
        before = os.stat(sysd / "lib").st_mtime_ns
        (sysd / "lib" / "a.so").unlink()
        (sysd / "lib" / "a.so").symlink_to(var_tmp / "secret" / ".env")
        if change == "mtime-put-back":
            os.utime(sysd / "lib", ns=(before, before))
    elif change == "soname-retargeted":
        (sysd / "lib" / "libx.so.1").unlink()
        (sysd / "lib" / "libx.so.1").symlink_to(var_tmp / "secret" / ".env")
    elif change == "general-file-to-link":
        (sysd / "gen" / "b.cfg").unlink()
        (sysd / "gen" / "b.cfg").symlink_to(var_tmp / "secret" / ".env")
    elif change == "dir-retargeted":
        (sysd / "linked").unlink()
        (sysd / "linked").symlink_to("other")
        os.utime(sysd, (old, old))  # (its own Stamp put back: what changed is where the link leads)
    time.sleep(racy * 2 / 1e9)  # (a later run would keep the new answers: the same either way)
    got = run()
    assert got == general()
    changed = {k[1] for k, v in got.items() if v[0] != first[k][0]}
    assert changed == targets
    assert all(got[k][0] == "blocked" for k in got if k[1] in targets)


def test_a_path_search_miss_in_home_is_kept_until_its_directory_changes(var_tmp: Path) -> None:
    """A PATH search's misses in $HOME (``/root/.cargo/bin/true``: every run of a command
    tries them) are the general path's, kept like the rest while the directory they
    would be in is unchanged; the sandbox's own /proc and /dev paths are never kept
    (decided with no host lookup: a host Stamp says nothing of them)."""
    home = var_tmp / "home"
    (home / "bin").mkdir(parents=True)
    old = time.time() - 60
    os.utime(home / "bin", (old, old))
    time.sleep(0.1)
    base = ctx(var_tmp)
    c = observed.Context(**{**base.__dict__, "home": str(home)})
    paths = [f"{home}/bin/tool", "/proc/self/status", "/dev/null"]
    data = b"".join(rec(kobs.KIND_OPEN, p.encode()) for p in paths)
    dec = observed.Decided()
    general_calls: list[str] = []
    real_path_result = observed._path_result

    def path_result(*a: Any, **kw: Any) -> tuple[str, str, str]:
        general_calls.append(a[1])
        return real_path_result(*a, **kw)

    def run() -> list[str]:
        general_calls.clear()
        cl = observed.Classifier(c, dec)
        with mock.patch.object(observed, "_RACY_NS", 50_000_000), mock.patch.object(observed, "_path_result", path_result):
            cl.feed_raw(data, LAYOUT)
        assert {a.target: a.result for a in cl.aggs.values()}[f"{home}/bin/tool"] == "blocked"
        return sorted(general_calls)

    assert run() == sorted(paths)
    assert run() == ["/dev/null", "/proc/self/status"]
    (home / "bin" / "tool").write_text("x")
    assert f"{home}/bin/tool" in run()


def test_what_is_never_kept_or_kept_apart(var_tmp: Path) -> None:
    """Kept classifications are one per syscall (``open`` and ``openat`` of a path are
    two events); a name that is a link in a loop (which ``realpath`` leaves as itself),
    and a grant's files (the command may change a writable grant's names after its
    directory was checked in a run) are never kept; the memo stops growing at its cap;
    and a kept entry whose line cannot be made is classified once, by the general path."""
    gen = var_tmp / "gen"
    other = var_tmp / "other"
    grant = var_tmp / "grant"
    for d in (gen, other, grant):
        d.mkdir()
    (gen / "x").symlink_to(other / "y")
    (other / "y").symlink_to(gen / "x")  # a loop across two directories
    (gen / "f").write_text("x")
    (grant / "cfg").write_text("x")
    old = time.time() - 60
    for d in (gen, other, grant):
        os.utime(d, (old, old))
    time.sleep(0.1)
    base = ctx(var_tmp)

    def why(p: str) -> D:
        if observed.is_under(p, str(grant)):
            return D(p, True, "rw", "visible read-write: granted", "grant")
        if observed.is_under(p, str(gen)) or observed.is_under(p, str(other)):
            return D(p, True, "ro", "visible read-only")
        return base.why(p)  # type: ignore[return-value]

    c = observed.Context(**{**base.__dict__, "why": why, "grants": (str(grant),)})
    other_nr = NRS.get("open", NRS["openat2"])
    data = (rec(kobs.KIND_OPEN, f"{gen}/f".encode(), nr=NRS["openat"]) + rec(kobs.KIND_OPEN, f"{gen}/x".encode())
            + rec(kobs.KIND_OPEN, f"{grant}/cfg".encode()))
    dec = observed.Decided()
    with mock.patch.object(observed, "_RACY_NS", 50_000_000):
        observed.Classifier(c, dec).feed_raw(data, LAYOUT)
        assert [(k[1], k[3]) for k in dec.seen] == [(NRS["openat"], f"{gen}/f".encode())]
        cl = observed.Classifier(c, dec)
        cl.feed_raw(rec(kobs.KIND_OPEN, f"{gen}/f".encode(), nr=other_nr), LAYOUT)  # the other syscall
    (a,) = cl.aggs.values()
    assert a.syscall == kobs.syscall_name(other_nr) != "openat"
    # the cap: nothing more is kept once it is reached
    with mock.patch.object(observed, "_DECIDED_MAX", len(dec.seen)), mock.patch.object(observed, "_RACY_NS", 0):
        observed.Classifier(c, observed.Decided(seen=dict(dec.seen))).feed_raw(
            rec(kobs.KIND_OPEN, f"{gen}/new".encode()), LAYOUT)
    # a kept entry whose line parts fail: one count, by the general path
    kept = observed.Decided(seen={k: v._replace(json=[]) for k, v in dec.seen.items()})
    cl = observed.Classifier(c, kept)
    with mock.patch.object(observed, "_parts", side_effect=ValueError("x")):
        cl.feed_raw(rec(kobs.KIND_OPEN, f"{gen}/f".encode(), nr=NRS["openat"]), LAYOUT)
    assert [a.count for a in cl.aggs.values()] == [1]


def test_a_kept_entry_stops_growing_at_its_cap(var_tmp: Path) -> None:
    """One run probing more missing names than the memo's cap keeps no more than it."""
    d = var_tmp / "d"
    d.mkdir()
    old = time.time() - 60
    os.utime(d, (old, old))
    time.sleep(0.05)
    c = ctx(var_tmp)
    dec = observed.Decided()
    data = b"".join(rec(kobs.KIND_OPEN, f"{d}/n{i}".encode()) for i in range(50))
    with mock.patch.object(observed, "_DECIDED_MAX", 20), mock.patch.object(observed, "_RACY_NS", 10_000_000):
        observed.Classifier(c, dec).feed_raw(data, LAYOUT)
    assert len(dec.seen) == 20


def test_a_path_deeper_than_the_recursion_limit_is_classified(var_tmp: Path) -> None:
    """Thousands of components (a command's to choose: no such file needs to exist) are
    resolved and decided iteratively, in a uniform tree and out of one, as one level is."""
    sysd = var_tmp / "sys"
    (sysd / "lib").mkdir(parents=True)
    base = ctx(var_tmp)

    def why(p: str) -> D:
        if observed.is_under(p, str(sysd)):
            return D(p, True, "ro", f"visible read-only: system directory {sysd}")
        return base.why(p)  # type: ignore[return-value]

    c = observed.Context(**{**base.__dict__, "why": why, "uniform": lambda d: observed.is_under(d, str(sysd))})
    deep = "/a" * 2500
    paths = [f"{sysd}/lib{deep}/x", f"{var_tmp}/elsewhere{deep}/x", f"{sysd}/lib/y"]
    cl = observed.Classifier(c)
    cl.feed(kobs.parse_records(b"".join(rec(kobs.KIND_OPEN, p.encode()) for p in paths))[0])
    got = {a.target: (a.result, a.reason) for a in cl.aggs.values()}
    assert got[paths[0]] == got[paths[2]] == ("allowed", f"visible read-only: system directory {sysd}")
    assert got[paths[1]][0] == "blocked"
    assert observed._Resolver(c).realpath(paths[1]) == paths[1]  # (nothing there: itself)


def test_a_long_chain_of_links_is_decided_as_itself(var_tmp: Path) -> None:
    """A chain of 1,500 symlinks (a command can make one in a directory granted to it;
    Python's realpath recurses per link, where the kernel stops at 40) is decided for the
    link's own path, and the records after it still are."""
    d = var_tmp / "granted"
    d.mkdir()
    (d / "l0").symlink_to("/etc/hosts")
    for i in range(1, 1500):
        (d / f"l{i}").symlink_to(f"l{i - 1}")
    c = ctx(var_tmp)
    cl = observed.Classifier(c)
    paths = [str(d / "l1499"), "/usr/lib/z.so"]
    cl.feed(kobs.parse_records(b"".join(rec(kobs.KIND_OPEN, p.encode()) for p in paths))[0])
    assert {a.target for a in cl.aggs.values()} == set(paths)


def test_a_record_that_cannot_be_classified_is_skipped_not_the_rest(tmp_path: Path) -> None:
    """Classification failing on one record (here the policy's answer for one path raises)
    skips that record, counted with its error; the records after it are classified."""
    base = ctx(tmp_path)

    def why(p: str) -> D:
        if p.endswith("/boom"):
            raise ValueError("no decision for this path")
        return base.why(p)  # type: ignore[return-value]

    cl = observed.Classifier(observed.Context(**{**base.__dict__, "why": why}))
    paths = ["/opt/x/boom", "/opt/x/fine", "/usr/lib/y.so"]
    cl.feed(kobs.parse_records(b"".join(rec(kobs.KIND_OPEN, p.encode()) for p in paths))[0])
    assert {a.target for a in cl.aggs.values()} == {"/opt/x/fine", "/usr/lib/y.so"}
    assert cl.failed == 1 and cl.first_error == "ValueError: no decision for this path"
