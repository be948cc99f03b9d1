"""The apply journal on disk: ``<state>/applies/<id>/{plan.json, progress, backups/N,
removed/N-L}`` and ``<state>/applies/pending/<id>`` while an apply or rollback is in
flight; the progress log, the global apply lock, the session's applied-state record
(``<session>/changes-applied.json``: inode and ctime of every target this session's
applies and rollbacks wrote, so they are no conflict), the audit events, the list of
applies, and the crash hook the tests use."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..linux import libc
from ..paths import state_dir
from ..session import store
from ..session.store import Session
from ._safefs import Root

_ticks = 0
_crash_after: int | None = -1  # -1: not read from the environment yet


def tick() -> None:
    """``STOCKADE_TEST_CRASH_AFTER=N``: die by SIGKILL after N journaled operations."""
    global _ticks, _crash_after
    if _crash_after == -1:
        limit = os.environ.get("STOCKADE_TEST_CRASH_AFTER")
        _crash_after = int(limit) if limit else None
    if _crash_after is None:
        return
    _ticks += 1
    if _ticks >= _crash_after:
        os.kill(os.getpid(), signal.SIGKILL)


class NotDone(UsageError):
    """An operation failed before it changed anything (so undoing it must not touch its target)."""


def applies_dir() -> Path:
    return Path(state_dir()) / "applies"


def pending_dir() -> Path:
    return applies_dir() / "pending"


@contextlib.contextmanager
def global_lock() -> Iterator[None]:
    d = applies_dir()
    with store.disk_space("take the apply lock", d / "lock", space_remedy(d, "nothing was applied")):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, separators=(",", ":")))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def syncfs(fd: int) -> None:
    try:
        libc.syncfs(fd)
    except (OSError, AttributeError):  # pragma: no cover
        os.sync()


def flush_early(project: Path) -> threading.Thread | None:
    """Start writing back what is already dirty on the project's filesystem (typically the
    layer the sandbox just wrote) while apply scans and plans, so the ``syncfs`` at the
    commit point has only the apply's own writes left. A flush has no other effect."""
    try:
        fd = os.open(project, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None

    def run() -> None:
        try:
            syncfs(fd)
        finally:
            os.close(fd)

    t = threading.Thread(target=run, name="stockade-apply-flush", daemon=True)
    t.start()
    return t


class Progress:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def note(self, line: str, sync: bool = False) -> None:
        os.write(self.fd, (line + "\n").encode())
        if sync:
            os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def read_progress(adir: Path) -> tuple[str, int, set[int]]:
    """(last state, highest begun op index, layer moves done)."""
    state = "preparing"
    begun = -1
    moved: set[int] = set()
    try:
        text = (adir / "progress").read_text()
    except FileNotFoundError:
        return state, begun, moved
    for line in text.splitlines():
        if line.startswith("b "):
            begun = max(begun, int(line[2:]))
        elif line.startswith("m "):
            moved.add(int(line[2:]))
        elif line.startswith("s "):
            state = line[2:]
    return state, begun, moved


def applied_record_path(session: Session) -> Path:
    return session.dir / "changes-applied.json"


def baseline_ns(session: Session) -> int:
    """Since when a change of the project's own counts as a conflict with the session's:
    its start, or for a fork its parent's (whose changes it carries)."""
    meta = session.meta()
    return int(meta.get("baseline_ns", meta.get("created_ns", 0)))


def load_applied(session: Session) -> dict[str, list[int]]:
    try:
        with open(applied_record_path(session), encoding="utf-8") as f:
            data: dict[str, list[int]] = json.load(f)
            return data
    except (FileNotFoundError, ValueError):
        return {}


def record_applied(session: Session, host: Root, paths: list[str]) -> dict[str, list[int] | None]:
    """Remember the state we left ``paths`` (and their directories, whose ctime we changed) in.

    Returns the states of ``paths`` themselves."""
    rec = load_applied(session)
    every = set(paths)
    for p in paths:
        if "/" in p:
            every.add(p.rsplit("/", 1)[0])
    states = target_states(host, sorted(every))
    for p, v in states.items():
        if v is None:
            rec.pop(p, None)
        else:
            rec[p] = v
    write_json(applied_record_path(session), rec)
    return {p: states[p] for p in paths}


def new_apply_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def space_remedy(path: Path, then: str) -> str:
    return f"free space on {store.mount_point(path)} and try again; {then}"


def log_event(session: Session, ev: dict[str, Any]) -> None:
    ev = {"ts": time.time(), **ev}
    try:
        with open(session.events_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(ev, separators=(",", ":")) + "\n")
    except OSError:
        pass


def load_plan(adir: Path) -> dict[str, Any] | None:
    try:
        with open(adir / "plan.json", encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
            return data
    except (FileNotFoundError, ValueError):
        return None


@dataclass(frozen=True)
class ApplyRecord:
    id: str
    session: str
    project: str
    created_ns: int
    state: str
    paths: tuple[str, ...]
    # a rollback's: whether the entries went back into their session (False: it was
    # collected since, or its name now belongs to a session made later)
    back_in_session: bool = False


def list_applies(session_id: str | None = None) -> list[ApplyRecord]:
    out: list[ApplyRecord] = []
    try:
        names = sorted(os.listdir(applies_dir()))
    except FileNotFoundError:
        return out
    for n in names:
        if n in ("pending", "lock") or n.startswith("."):
            continue
        adir = applies_dir() / n
        plan = load_plan(adir)
        if plan is None:
            continue
        if session_id is not None and plan["session"] != session_id:
            continue
        state, _, _ = read_progress(adir)
        out.append(ApplyRecord(n, plan["session"], plan["project"], int(plan["created"]), state,
                               tuple(plan["paths"])))
    return out


def target_states(host: Root, paths: list[str]) -> dict[str, list[int] | None]:
    out: dict[str, list[int] | None] = {}
    for p in paths:
        st = host.lstat(p)
        out[p] = None if st is None else [st.st_ino, st.st_ctime_ns]
    return out
