"""Observe mode's kernel side: the notifying filter, the listener's thread, the records.

The filter (``observe_bpf``) returns ``SECCOMP_RET_USER_NOTIF`` for the observed calls
(execve, execveat, open, creat, openat, openat2, connect, sendto with an address,
sendmsg) and ALLOW for everything else; the sandbox's init installs it after the
policy filter (csrc/observe.c), so a call the policy denies is never notified (the
kernel takes the most restrictive answer of all filters). ``Observer`` takes the
listener init sends and runs the C loop in a thread of the supervisor: every
notification is answered ``SECCOMP_USER_NOTIF_FLAG_CONTINUE``, so the command behaves
exactly as unobserved, and one binary record per observed call waits in memory for
``Observer.take``; ``parse_records`` decodes them.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple

from ..native import ffi, lib
from .bpf import (
    AUDIT_ARCH_X86_64,
    BPF_ABS,
    BPF_JEQ,
    BPF_JGE,
    BPF_JMP,
    BPF_K,
    BPF_LD,
    BPF_RET,
    BPF_W,
    SECCOMP_RET_ALLOW,
    X32_SYSCALL_BIT,
    insn,
)

SECCOMP_RET_USER_NOTIF = 0x7FC00000
AUDIT_ARCH_AARCH64 = 0xC00000B7

# (arch token, {name: number}) of the machines observe mode knows
_TABLES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (AUDIT_ARCH_X86_64, {"execve": 59, "execveat": 322, "open": 2, "creat": 85, "openat": 257,
                                   "openat2": 437, "connect": 42, "sendto": 44, "sendmsg": 46}),
    "aarch64": (AUDIT_ARCH_AARCH64, {"execve": 221, "execveat": 281, "openat": 56, "openat2": 437,
                                     "connect": 203, "sendto": 206, "sendmsg": 211}),
}
OBSERVED = ("execve", "execveat", "open", "creat", "openat", "openat2", "connect", "sendto", "sendmsg")

KIND_EXEC = lib.SK_OBS_EXEC
KIND_OPEN = lib.SK_OBS_OPEN
KIND_CONNECT = lib.SK_OBS_CONNECT
KIND_SENDTO = lib.SK_OBS_SENDTO
KIND_SENDMSG = lib.SK_OBS_SENDMSG
F_UNREADABLE = lib.SK_OBS_F_UNREADABLE
F_TRUNCATED = lib.SK_OBS_F_TRUNCATED
F_RELATIVE = lib.SK_OBS_F_RELATIVE
SAME_CPU = lib.SK_OBS_SAME_CPU
IN_RECEIVE = lib.SK_OBS_IN_RECEIVE

REC = struct.Struct("=IHHiiiIQ")
assert REC.size == ffi.sizeof("struct sk_obs_rec")


def supported() -> str | None:
    """None when observe mode knows this machine's syscall numbers, else why not."""
    m = os.uname().machine
    return None if m in _TABLES else f"observe mode knows the syscall numbers of x86_64 and aarch64, not {m}"


def observe_bpf(machine: str | None = None) -> bytes:
    """``_observe_bpf``, made once per machine (every observed run installs it)."""
    m = machine or os.uname().machine
    prog = _PROGS.get(m)
    if prog is None:
        prog = _PROGS[m] = _observe_bpf(m)
    return prog


_PROGS: dict[str, bytes] = {}


def _observe_bpf(machine: str) -> bytes:
    """The observe filter for this machine (``struct sock_filter[]``). sendto without an
    address (a connected socket's send) is not notified; init's own sendmsg of the
    listener (its socket's fd, ``SK_OBSERVE_SOCK_K``, filled in by csrc/observe.c, with
    ``SK_OBSERVE_HANDOFF_FLAGS``) is the one sendmsg let through unnotified."""
    arch, nrs = _TABLES[machine]
    simple = [nrs[n] for n in ("execve", "execveat", "open", "creat", "openat", "openat2", "connect") if n in nrs]
    ld = BPF_LD | BPF_W | BPF_ABS
    jeq = BPF_JMP | BPF_JEQ | BPF_K
    ret = BPF_RET | BPF_K
    # layout (jumps only go forward): [head 4][simple n][jeq sendto][jeq sendmsg][ret allow]
    # [sendto block 4][sendmsg block 4][ret allow][ret notif]
    n = len(simple)
    sendto_blk = 4 + n + 3
    sendmsg_blk = sendto_blk + 4
    allow = sendmsg_blk + 4
    notif = allow + 1

    def to(at: int, target: int) -> int:
        return target - at - 1

    prog: list[bytes] = [
        insn(ld, 0, 0, 4),  # arch
        insn(jeq, 0, to(1, allow), arch),  # another ABI: the policy filter's business
        insn(ld, 0, 0, 0),  # nr
        insn(BPF_JMP | BPF_JGE | BPF_K, to(3, allow), 0, X32_SYSCALL_BIT),
    ]
    for nr in simple:
        prog.append(insn(jeq, to(len(prog), notif), 0, nr))
    prog.append(insn(jeq, to(len(prog), sendto_blk), 0, nrs["sendto"]))
    prog.append(insn(jeq, to(len(prog), sendmsg_blk), 0, nrs["sendmsg"]))
    prog.append(insn(ret, 0, 0, SECCOMP_RET_ALLOW))
    # sendto: dest_addr (args[4]) NULL -> allow
    a4 = 16 + 8 * 4
    assert len(prog) == sendto_blk
    prog.append(insn(ld, 0, 0, a4))
    prog.append(insn(jeq, 0, to(len(prog), notif), 0))
    prog.append(insn(ld, 0, 0, a4 + 4))
    prog.append(insn(jeq, to(len(prog), allow), to(len(prog), notif), 0))
    # sendmsg: init's handoff of the listener (fd = its socket, and flags no program
    # passes: the number alone may be a later socket of the command's) -> allow
    assert len(prog) == sendmsg_blk
    prog.append(insn(ld, 0, 0, 16))
    prog.append(insn(jeq, 0, to(len(prog), notif), lib.SK_OBSERVE_SOCK_K))
    prog.append(insn(ld, 0, 0, 16 + 8 * 2))  # flags (an int: the low word)
    prog.append(insn(jeq, to(len(prog), allow), to(len(prog), notif), lib.SK_OBSERVE_HANDOFF_FLAGS))
    assert len(prog) == allow
    prog.append(insn(ret, 0, 0, SECCOMP_RET_ALLOW))
    prog.append(insn(ret, 0, 0, SECCOMP_RET_USER_NOTIF))
    for i, b in enumerate(prog):  # every jump goes forward and fits (checked: the kernel would refuse it)
        code, jt, jf, _k = struct.unpack("=HBBI", b)
        if code & 0x07 == BPF_JMP:
            assert i + 1 + jt < len(prog) and i + 1 + jf < len(prog), i
    return b"".join(prog)


_NAMES: dict[int, str] = {}


class Record(NamedTuple):
    """One observed call, as read from the target (for the log only: see csrc/observe.c).
    A tuple: tens of thousands are made per run."""

    kind: int
    flags: int
    pid: int
    nr: int
    err: int
    arg: int  # open: its flags; execveat: its flags
    data: bytes  # a path (opens, execs) or a sockaddr (connect, sendto, sendmsg)

    @property
    def syscall(self) -> str:
        return syscall_name(self.nr)

    @property
    def path(self) -> str:
        return os.fsdecode(self.data)


def parse_records(buf: bytes) -> tuple[list[Record], int]:
    """The whole records at the start of ``buf``, and how many bytes they take."""
    out: list[Record] = []
    off, size = 0, REC.size
    while off + size <= len(buf):
        ln, kind, flags, pid, nr, err, dlen, arg = REC.unpack_from(buf, off)
        if ln != size + dlen or off + ln > len(buf):
            break
        out.append(Record(kind, flags, pid, nr, err, arg, bytes(buf[off + size:off + ln])))
        off += ln
    return out, off


def syscall_name(nr: int) -> str:
    """A syscall number's name on this machine (its number when observe mode has none)."""
    if not _NAMES:
        _NAMES.update({nr: name for name, nr in _TABLES.get(os.uname().machine, (0, {}))[1].items()})
    return _NAMES.get(nr) or str(nr)


def sockaddr(data: bytes) -> tuple[str, str, int | None]:
    """(family, address, port) of a raw sockaddr: ("inet", "10.0.0.1", 443),
    ("inet6", "::1", 80), ("unix", "/run/x.sock" or "@abstract", None), or
    ("family N", "", None)."""
    if len(data) < 2:
        return ("unknown", "", None)
    fam = struct.unpack_from("=H", data)[0]
    if fam == socket.AF_INET and len(data) >= 8:
        return ("inet", str(ipaddress.IPv4Address(data[4:8])), struct.unpack_from("!H", data, 2)[0])
    if fam == socket.AF_INET6 and len(data) >= 24:
        return ("inet6", str(ipaddress.IPv6Address(data[8:24])), struct.unpack_from("!H", data, 2)[0])
    if fam == socket.AF_UNIX:
        p = data[2:]
        if p[:1] == b"\0":
            return ("unix", "@" + os.fsdecode(p[1:].rstrip(b"\0")), None)
        return ("unix", os.fsdecode(p.split(b"\0", 1)[0]), None)
    if fam == socket.AF_UNSPEC:
        return ("unspec", "", None)
    return (f"family {fam}", "", None)


@dataclass
class Stats:
    notified: int = 0
    logged: int = 0
    skipped: int = 0
    stale: int = 0
    unreadable: int = 0
    lost: int = 0
    error: int = 0  # the loop's -errno, or 0
    handover: int = 0  # SAME_CPU | IN_RECEIVE: how the loop ran

    def wakeup(self) -> str:
        """How each call reached the loop and back: "same-cpu" (the kernel's synchronous
        hand-over, Linux 6.6+) or "usual" (a wake-up on another CPU each way: several
        times the cost per call)."""
        return "same-cpu" if self.handover & SAME_CPU else "usual"

    def loop(self) -> str:
        """"receive" (waits in the receive, Linux 6.11+) or "poll" (polls before each)."""
        return "receive" if self.handover & IN_RECEIVE else "poll"


MAX_WATCH = 256  # masked paths inside the project whose opens are still recorded


class Observer:
    """The supervisor's side of one run's observe mode: a thread (C's, no GIL:
    ``sk_observe_spawn``) that takes the listener init sends over ``sock`` and answers
    every notification until no task of the sandbox is left (the listener hangs up).
    Its records wait in memory for ``take`` (handed over in batches of 10 ms at least:
    csrc/observe.c's OBS_FLUSH_MS, and at the end); opens beneath ``skip_prefix`` (the
    project) are answered but not recorded, unless beneath one of ``watch`` (the
    project's masked secrets: a command reading .env is what a user wants to see)."""

    def __init__(self, sock: socket.socket, skip_prefix: str, watch: tuple[str, ...] = ()) -> None:
        self.sock = sock
        self.watch = watch[:MAX_WATCH]
        self.skip_prefix = skip_prefix
        self.stats = Stats()
        self.got_listener = False
        self._handle: object | None = None
        self._joined = False
        self._stopped = False
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)

    def start(self) -> None:
        keep = [os.fsencode(w) for w in self.watch]
        cw = [ffi.new("char[]", w) for w in keep]
        # STOCKADE_OBSERVE_POLL=1: the loop polls before each receive, as before Linux 6.11
        poll_first = int(os.environ.get("STOCKADE_OBSERVE_POLL", "") == "1")
        h = lib.sk_observe_spawn(self.sock.fileno(), self._stop_r, poll_first, os.fsencode(self.skip_prefix),
                                 ffi.new("char *[]", [*cw, ffi.NULL]), len(cw))
        if h == ffi.NULL:
            e = ffi.errno
            raise OSError(e, f"observe mode: its thread: {os.strerror(e)}")
        self._handle = h

    def take(self) -> bytes:
        """The records handed over since the last call (whole records: ``parse_records``)."""
        if self._handle is None:
            return b""
        p = ffi.new("unsigned char **")
        n = lib.sk_observe_take(self._handle, p)
        if p[0] == ffi.NULL:
            return b""
        try:
            return bytes(ffi.buffer(p[0], n))
        finally:
            lib.sk_observe_free(p[0])

    def _join(self, timeout: float) -> bool:
        if self._handle is None or self._joined:
            return True
        st = ffi.new("struct sk_observe_stats *")
        res = ffi.new("int *")
        if lib.sk_observe_join(self._handle, int(timeout * 1000), st, res) != 0:
            return False
        self._joined = True
        r = res[0]
        self.got_listener = r != -errno.ENOMSG
        if self.got_listener:
            self.stats = Stats(st.notified, st.logged, st.skipped, st.stale, st.unreadable, st.lost,
                               -r if r < 0 else 0, st.handover)
        return True

    def stop(self, timeout: float = 5.0) -> Stats:
        """Wait for the loop (it ends by itself once the sandbox is gone), then end it.
        The records not taken yet stay for ``take`` until ``close``."""
        if self._stopped:
            return self.stats
        self._stopped = True
        if not self._join(timeout):
            try:
                os.write(self._stop_w, b"x")
            except OSError:
                pass
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # a recv still waiting for the listener
            except OSError:
                pass
            if not self._join(timeout):
                # (never seen: a loop waiting in the receive ends only with the filter's
                # last task; the thread keeps the fds it borrowed, and its handle)
                return self.stats
        self.sock.close()
        for fd in (self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass
        return self.stats

    def close(self) -> None:
        """The reader is done (after ``stop``): the records not taken are freed."""
        if self._handle is not None and self._joined:
            lib.sk_observe_release(self._handle)
            self._handle = None
