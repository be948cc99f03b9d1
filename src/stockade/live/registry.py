"""Where living sandboxes are found: ``<state>/live/<id>/`` with the holder's socket
(``sock``) and its record (``holder.json``). A sandbox's id is its session's.

The directory is 0700 and lies in the state dir, which no sandbox sees; the holder
also checks each peer (``proto.same_userns_peer``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import UsageError
from ..session import store

SOCK = "sock"
RECORD = "holder.json"
WARM = "warm"  # present while a pre-warmed sandbox waits to be claimed


def live_root() -> Path:
    return Path(paths.state_dir()) / "live"


def live_dir(sid: str) -> Path:
    return live_root() / store.validate_name(sid)


def make_dir(sid: str) -> Path:
    root = live_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    d = root / store.validate_name(sid)
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def warm_waiting() -> bool:
    """Whether any pre-warmed sandbox waits (a listing; no record read): what a run
    checks before it looks for one to claim."""
    root = os.path.join(paths.state_dir(), "live")
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return any(os.path.exists(os.path.join(root, n, WARM)) for n in names)


def pid_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): a pid with another start time is another process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        fields = data.rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return None  # exited, not yet reaped by its parent: no longer that process
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass
class Living:
    """One sandbox's record as its holder last wrote it."""

    id: str
    dir: Path
    data: dict[str, Any]

    @property
    def sock_path(self) -> Path:
        return self.dir / SOCK

    @property
    def holder_pid(self) -> int:
        return int(self.data.get("holder_pid") or 0)

    def holder_alive(self) -> bool:
        pid = self.holder_pid
        return pid > 0 and pid_start(pid) == self.data.get("holder_start")

    @property
    def status(self) -> str:
        """running | starting | stopping | stopped | failed, from the record and whether its holder lives."""
        st = str(self.data.get("status", "failed"))
        if st in ("running", "starting", "stopping", "warm") and not self.holder_alive():
            return "failed"
        return st


def read(sid: str) -> Living | None:
    d = live_dir(sid)
    try:
        with open(d / RECORD, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return Living(sid, d, data)


def write(d: Path, data: dict[str, Any]) -> None:
    store.write_json_atomic(d / RECORD, data)


def all_living() -> list[Living]:
    root = live_root()
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        try:
            lv = read(n)
        except UsageError:
            continue
        if lv is not None:
            out.append(lv)
    return out


def find(name: str | None) -> Living:
    """The living sandbox ``name`` (its id or session name), or with None the only running one."""
    if name is None:
        running = [lv for lv in all_living() if lv.status in ("running",)]
        if len(running) == 1:
            return running[0]
        if not running:
            raise UsageError("no living sandbox is running; start one with `stockade start`")
        raise UsageError("several living sandboxes are running (" + ", ".join(lv.id for lv in running)
                         + "); name one")
    store.validate_name(name)
    lv = read(name)
    if lv is None:
        raise UsageError(f"no living sandbox {name!r}; `stockade ps` lists them, `stockade start --name {name}` starts one")
    return lv


def running(name: str | None) -> Living:
    lv = find(name)
    st = lv.status
    if st != "running":
        why = lv.data.get("reason")
        raise UsageError(f"sandbox {lv.id!r} is {st}" + (f" ({why})" if why else "")
                         + f"; its changes stay for review (`stockade diff {lv.id}`); `stockade start --name {lv.id}` starts it again")
    return lv


def sock_address(path: Path) -> tuple[str, int]:
    """A socket path short enough for sockaddr_un: itself, or through /proc/self/fd
    of its directory (an fd the caller closes)."""
    s = os.fspath(path)
    if len(os.fsencode(s)) < 100:
        return s, -1
    dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{dfd}/{path.name}", dfd


def connect(lv: Living, timeout: float = 5.0) -> socket.socket:
    """A connection to the sandbox's holder, checked to be this user's in this user namespace."""
    from .proto import same_userns_peer

    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    addr, dfd = sock_address(lv.sock_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                s.connect(addr)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                if not lv.holder_alive() or time.monotonic() > deadline:
                    s.close()
                    raise UsageError(f"sandbox {lv.id!r} is not running (its holder is gone); "
                                     f"`stockade start --name {lv.id}` starts it again") from None
                time.sleep(0.02)
    finally:
        if dfd >= 0:
            os.close(dfd)
    if same_userns_peer(s) is None:
        s.close()
        raise UsageError(f"the socket of sandbox {lv.id!r} is not held by a stockade of this user and namespace; "
                         f"remove {lv.dir} and start it again")
    return s
