"""Sessions whose layers may hold inodes of a sandbox's other ids, and the one seam
through which every change-set operation reaches them.

A run whose plan mapped a range of ids records the maps in the session (``mark``:
``<session>/idmap.json``, before the sandbox starts). For an unprivileged caller, whose
range newuidmap wrote, files the sandbox gave to another id are on the host owned by
a subordinate id, with any mode: the caller cannot read them, enter those
directories or delete entries in them. Every public operation of the change-set layer
(scan, diff, held-back checks, apply, discard, rollback, recovery, snapshots, fork,
export, removing a session) is wrapped by ``with_sandbox_ids``: for such a session it
runs in linux/idns's child, which has the sandbox's ids, and in this process otherwise.
CLI, API, the run's summary line and a failed run's clean-up all call those
functions, so they behave alike; nothing above this layer knows about the child.

The maps also say who owned a changed path inside (``Ids.inside_owner``), which
status, diff and apply report.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from ..linux import idns

MARKER = "idmap.json"
OVERFLOW = 65534  # what the kernel shows inside for an id its namespace does not map

Entry = tuple[int, int, int]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Ids:
    """A session's recorded maps and the sandbox user's host ids."""

    uid_map: tuple[Entry, ...]
    gid_map: tuple[Entry, ...]
    user: tuple[int, int]  # the sandbox user's host uid and gid
    # no range: the layers hold the caller's own inodes it cannot read (``mark_own``)
    own: bool = False

    @staticmethod
    def _inside(entries: tuple[Entry, ...], host: int) -> int:
        for inside, outside, count in entries:
            if outside <= host < outside + count:
                return inside + (host - outside)
        return OVERFLOW

    def inside(self, host_uid: int, host_gid: int) -> tuple[int, int]:
        return self._inside(self.uid_map, host_uid), self._inside(self.gid_map, host_gid)

    def inside_owner(self, st: os.stat_result) -> tuple[int, int] | None:
        """The inside owner of a layer entry when it is not the sandbox user (None then)."""
        uid, gid = idns.host_ids(st.st_uid, st.st_gid)
        if (uid, gid) == self.user:
            return None
        own = self.inside(uid, gid)
        return None if own == self.inside(*self.user) else own


def _entries(v: Any) -> tuple[Entry, ...]:
    return tuple((int(i), int(o), int(c)) for i, o, c in v)


def mark(session_dir: str | os.PathLike[str], uid_map: Iterable[Entry], gid_map: Iterable[Entry],
         user: tuple[int, int] | None = None) -> None:
    """Record that a sandbox of this session maps these ids (``user``: the sandbox user's
    host ids, default the caller's). Called by a run before its sandbox starts, and
    only when the map holds a range; an unchanged record is not rewritten."""
    from .store import write_json_atomic

    data = {"uid_map": [list(e) for e in uid_map], "gid_map": [list(e) for e in gid_map],
            "user": list(user or (os.geteuid(), os.getegid()))}
    path = Path(session_dir) / MARKER
    try:
        with open(path, encoding="utf-8") as f:
            if json.load(f) == data:
                return
    except (OSError, ValueError):
        pass
    write_json_atomic(path, data)


def record_plan(session_dir: str | os.PathLike[str], plan: Any) -> None:
    """``mark`` for a run's plan when it maps a range (``plan.uid_map.ranged()``); the
    first single of each map is the sandbox user's. Nothing for a single-id map."""
    um, gm = plan.uid_map, plan.gid_map
    if not (um.ranged() and gm.ranged()):
        return
    mark(session_dir, um.entries, gm.entries, (um.entries[0][1], gm.entries[0][1]))


def read(session_dir: str | os.PathLike[str]) -> Ids | None:
    try:
        with open(Path(session_dir) / MARKER, encoding="utf-8") as f:
            d = json.load(f)
        return Ids(_entries(d["uid_map"]), _entries(d["gid_map"]), (int(d["user"][0]), int(d["user"][1])),
                   bool(d.get("own")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        # unreadable: the session still needs the child, without ownership details
        return Ids((), (), (os.geteuid(), os.getegid()))


def mark_own(session_dir: str | os.PathLike[str]) -> None:
    """Record that the session's layers hold inodes of the caller's own it cannot read or
    empty (a sandbox's ``chmod 000 d``), when nothing is recorded yet: from then on its
    operations run in the child too, mapped with the caller's own ids where it has no range."""
    from .store import write_json_atomic

    if not os.path.lexists(Path(session_dir) / MARKER):
        write_json_atomic(Path(session_dir) / MARKER, {"uid_map": [], "gid_map": [], "own": True,
                                                       "user": [os.geteuid(), os.getegid()]})


def copy_mark(src_dir: str | os.PathLike[str], dst_dir: str | os.PathLike[str]) -> None:
    """A fork shares the frozen layers, and so their owners."""
    try:
        shutil.copyfile(Path(src_dir) / MARKER, Path(dst_dir) / MARKER)
    except FileNotFoundError:
        pass


def needs_child(session_dir: str | os.PathLike[str]) -> bool:
    """Cheap (one stat): must this process reach the session's layers through the child?
    Real root reaches every inode; the child itself already has the ids."""
    if idns.INSIDE or os.geteuid() == 0:
        return False
    return os.path.lexists(os.path.join(session_dir, MARKER))


def session_dir_of(arg: Any) -> str | None:
    """The session directory an operation acts on: a ChangeSet's, a Session's, or a path."""
    sess = getattr(arg, "session", None)
    d = getattr(sess if sess is not None else arg, "dir", None)
    if isinstance(d, (str, os.PathLike)):
        return os.fspath(d)
    if isinstance(arg, (str, os.PathLike)):
        return os.fspath(arg)
    return None


def _within(filename: Any, session_dir: str) -> bool:
    """Could the path an error names be in the session (layers are read through directory
    fds: relative names count)? A project file of another user's is not the child's to read."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return True
    f = os.fsdecode(filename)
    return not os.path.isabs(f) or f.startswith(session_dir.rstrip("/") + "/")


def with_sandbox_ids(where: Callable[..., Iterable[str | os.PathLike[str] | None]] | None = None, *,
                     retry: bool = False) -> Callable[[F], F]:
    """Run the decorated operation with the sandbox's ids when a session it acts on needs
    them. ``where(*args, **kwargs)`` names those sessions' directories; default: the
    first argument's (see ``session_dir_of``). ``retry`` (operations that only read):
    a PermissionError here on an unrecorded session records it (``mark_own``) and runs
    the operation again in the child."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if idns.INSIDE or os.geteuid() == 0:
                return fn(*args, **kwargs)
            dirs = [os.fspath(d) for d in (where(*args, **kwargs) if where else
                                           [session_dir_of(args[0]) if args else None]) if d is not None]
            marked = [ids for d in dirs if needs_child(d) and (ids := read(d)) is not None]
            if marked:
                ranged = any(not ids.own for ids in marked)
                return (idns.call if ranged else idns.call_own)(fn, *args, **kwargs)
            try:
                return fn(*args, **kwargs)
            except PermissionError as e:
                if not (retry and dirs and os.path.isdir(dirs[0]) and _within(e.filename, dirs[0])):
                    raise
            mark_own(dirs[0])
            return idns.call_own(fn, *args, **kwargs)

        return cast(F, wrapper)

    return deco


@with_sandbox_ids()
def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a session directory (or one renamed aside to be removed): its layers may
    hold directories a sandbox made unwritable (0500), or owned by its other ids."""
    def onerror(func: Callable[..., Any], p: str, exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
                if func in (os.open, os.scandir, os.listdir):
                    # a directory it could not enter (overlayfs's work/work is mode 0): now it can
                    shutil.rmtree(p, onerror=onerror)
                    return
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)
