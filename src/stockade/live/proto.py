"""The two channels of a living sandbox, as bytes.

* holder -> init (``struct sk_exec_hdr`` in csrc/stockade_native.h): one
  SOCK_SEQPACKET message per request, fds by SCM_RIGHTS; init answers each exec on
  the exec's own socket (``struct sk_report`` records) and notes starts and ends to
  the holder (``struct sk_note``).
* client -> holder: one SOCK_SEQPACKET message per request, a JSON object and its
  fds. The holder's answer to an exec is the first message on the exec socket (a
  JSON object: accepted, or the error); every other request is answered on the
  connection.

Who may connect: the holder's socket is in a 0700 directory of the state dir, and
the holder accepts only a peer of its own uid in its own user namespace, so neither
another user nor any sandbox (each has a user namespace of its own) reaches it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..linux.native import ffi, lib, pidfd_pid

MAGIC = lib.SK_SERVE_MAGIC
MAX_FDS = lib.SK_EXEC_MAX_FDS
MAX_STRINGS = lib.SK_EXEC_MAX_STRINGS
INLINE_MAX = 32 << 10  # strings above this go in a memfd (a SEQPACKET message must fit the socket buffer)
F_PTY = lib.SK_EXEC_F_PTY
F_MEMFD = lib.SK_EXEC_F_MEMFD

_HDR = struct.Struct("IIIIiIIII64i")
assert _HDR.size == ffi.sizeof("struct sk_exec_hdr")
NOTE = struct.Struct("iIii")
assert NOTE.size == ffi.sizeof("struct sk_note")
SIGNAL = struct.Struct("i")

NOTE_STARTED = lib.SK_NOTE_STARTED
NOTE_EXIT = lib.SK_NOTE_EXIT
NOTE_FAILED = lib.SK_NOTE_FAILED
NOTE_READY = lib.SK_NOTE_READY

MSG_MAX = 1 << 20  # a client's request (JSON)


class ProtocolError(Exception):
    """A message that is not what the channel carries."""


def _strings(argv: Sequence[str], env: Sequence[tuple[str, str]], cwd: str, path: str) -> bytes:
    enc = [os.fsencode(a) for a in argv] + [os.fsencode(f"{k}={v}") for k, v in env] + [os.fsencode(cwd), os.fsencode(path)]
    for s in enc:
        if b"\0" in s:
            raise ValueError("an argument, variable or path holds a NUL byte")
    return b"\0".join(enc) + b"\0"


def send_exec(sock: socket.socket, exec_id: int, argv: Sequence[str], env: Sequence[tuple[str, str]], cwd: str,
              path: str, exec_sock: int, stdio: Sequence[int], targets: Sequence[int], pass_fds: Sequence[int],
              pty: bool) -> None:
    """Ask init to run a command. ``stdio``: three fds, or with ``pty`` one console socket."""
    data = _strings(argv, env, cwd, path)
    if len(data) > MAX_STRINGS:
        raise ValueError(f"the command's arguments and environment are {len(data)} bytes; at most {MAX_STRINGS}")
    flags = F_PTY if pty else 0
    fds = [exec_sock, *stdio, *pass_fds]
    memfd = -1
    if len(data) > INLINE_MAX:
        flags |= F_MEMFD
        memfd = os.memfd_create("stockade-exec", os.MFD_CLOEXEC)
        os.write(memfd, data)
        fds.append(memfd)
    hdr = _HDR.pack(MAGIC, lib.SK_SERVE_EXEC, exec_id & 0xFFFFFFFF, flags, 0, len(argv), len(env), len(targets),
                    len(data), *targets, *([0] * (64 - len(targets))))
    try:
        socket.send_fds(sock, [hdr] if memfd >= 0 else [hdr, data], fds)
    finally:
        if memfd >= 0:
            os.close(memfd)


def send_signal_all(sock: socket.socket, sig: int) -> None:
    hdr = _HDR.pack(MAGIC, lib.SK_SERVE_SIGNAL_ALL, 0, 0, sig, 0, 0, 0, 0, *([0] * 64))
    sock.send(hdr)


def send_signal_exec(sock: socket.socket, exec_id: int, sig: int) -> None:
    hdr = _HDR.pack(MAGIC, lib.SK_SERVE_SIGNAL, exec_id & 0xFFFFFFFF, 0, sig, 0, 0, 0, 0, *([0] * 64))
    sock.send(hdr)


def parse_note(data: bytes) -> tuple[int, int, int, int]:
    """(kind, exec id, value, err) of one note from init."""
    if len(data) != NOTE.size:
        raise ProtocolError(f"a note of {len(data)} bytes")
    kind, eid, value, err = NOTE.unpack(data)
    return kind, eid, value, err


# --------------------------------------------------------------------------- client <-> holder


@dataclass
class Message:
    body: dict[str, object]
    fds: list[int]

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def send_msg(sock: socket.socket, body: Mapping[str, object], fds: Sequence[int] = ()) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MSG_MAX:
        raise ValueError(f"a request of {len(data)} bytes; at most {MSG_MAX}")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_msg(sock: socket.socket, max_fds: int = 0) -> Message | None:
    """One message (None: the peer closed). fds arrive close-on-exec."""
    size = socket.CMSG_SPACE(4 * max_fds) if max_fds else 0
    data, anc, flags, _ = sock.recvmsg(MSG_MAX, size, socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += [int.from_bytes(raw[i:i + 4], sys.byteorder) for i in range(0, len(raw) - len(raw) % 4, 4)]
    if not data and not fds:
        return None
    msg = Message({}, fds)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        msg.close_fds()
        raise ProtocolError("a message larger than the channel takes")
    try:
        body = json.loads(data)
    except ValueError:
        msg.close_fds()
        raise ProtocolError("a message that is not JSON") from None
    if not isinstance(body, dict):
        msg.close_fds()
        raise ProtocolError("a message that is not a JSON object")
    msg.body = body
    return msg


def same_userns_peer(conn: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of a peer that is our uid (or we are root and it is too) in our own
    user namespace; None for any other (another user, any sandbox)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid() or pid <= 0:
        return None
    try:  # the peer as a process, not a number: its pid could be reused before we look
        pidfd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:
        pidfd = -1  # before Linux 6.5: the pid alone
    try:
        try:
            theirs = os.stat(f"/proc/{pid}/ns/user")
            ours = os.stat("/proc/self/ns/user")
        except OSError:
            return None
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            return None
        if pidfd >= 0 and pidfd_pid(pidfd) != pid:
            return None  # the peer ended (and its number may be another process's now)
    finally:
        if pidfd >= 0:
            os.close(pidfd)
    return pid, uid


_SO_PEERPIDFD = 77  # Linux 6.5

