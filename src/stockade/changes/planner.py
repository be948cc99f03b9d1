"""The plan of an apply: the chosen changes turned into ordered operations on the
project, each with what it replaces, and the conflicts (a target changed on the host
since the session started).

op: {"op": "unlink"|"rmdir"|"mkdir"|"write"|"symlink"|"chmod", "path": str, ...}
  unlink: "otype": "file"|"symlink"|"other", "omode", ("link" for symlinks)
  rmdir:  "omode"
  mkdir:  (creates 0700; a later chmod op sets the final mode)
  write:  "layer", "mode", "old": None|{"otype","omode","link"?}
  symlink:"target", "old": as write
  chmod:  "omode", "mode"
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import Any

from ..errors import UsageError
from ..session.store import Session
from ._safefs import Root
from .journal import baseline_ns, load_applied
from .model import Change, Changes, Kind


def _old_of(st: os.stat_result | None, host: Root, rel: str) -> dict[str, Any] | None:
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        return {"otype": "symlink", "omode": st.st_mode, "link": host.readlink(rel)}
    if stat.S_ISREG(st.st_mode):
        return {"otype": "file", "omode": st.st_mode}
    if stat.S_ISDIR(st.st_mode):
        return {"otype": "dir", "omode": st.st_mode}
    return {"otype": "other", "omode": st.st_mode}


def _depth_desc(p: str) -> bytes:
    return os.fsencode(p)


class Planner:
    def __init__(self, cs: Changes, selected: Sequence[Change], host: Root) -> None:
        self.cs = cs
        self.host = host
        self.selected = list(selected)
        self.deletes: list[dict[str, Any]] = []
        self.mkdirs: list[dict[str, Any]] = []
        self.writes: list[dict[str, Any]] = []
        self.chmods: list[dict[str, Any]] = []
        self.removed_paths: set[str] = set()  # project paths the plan removes
        self.created_dirs: set[str] = set()
        self.dropped: set[str] = set()  # selected changes that cannot be applied (kept)
        self.ok_dirs: set[str] = set()
        self.absent: set[str] = set()  # project paths found absent (or not directories) now

    def _check_parent(self, rel: str) -> None:
        """Every ancestor must be a real directory now, or one the plan creates."""
        parts = rel.split("/")
        for i in range(1, len(parts)):
            anc = "/".join(parts[:i])
            if anc in self.created_dirs or anc in self.ok_dirs:
                continue
            st = self.host.lstat(anc)
            if st is None:
                raise UsageError(f"cannot apply {rel}: its directory {anc} no longer exists on the host")
            if not stat.S_ISDIR(st.st_mode):
                what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
                raise UsageError(f"cannot apply {rel}: {anc} is {what} on the host")
            self.ok_dirs.add(anc)

    def _lstat(self, rel: str) -> os.stat_result | None:
        """``host.lstat``, without a lookup below a path already found absent or not a directory."""
        parent = rel.rpartition("/")[0]
        st = None if parent in self.absent else self.host.lstat(rel)
        if st is None or not stat.S_ISDIR(st.st_mode):
            self.absent.add(rel)
        return st

    def _host_now(self, c: Change) -> os.stat_result | None:
        st = self._lstat(c.path)
        old_t = None if st is None else stat.S_IFMT(st.st_mode)
        exp_t = None if c.old_mode is None else stat.S_IFMT(c.old_mode)
        if old_t != exp_t:
            raise UsageError(f"cannot apply {c.path}: it changed on the host while planning; retry")
        return st

    def build(self) -> list[dict[str, Any]]:
        sel = sorted(self.selected, key=lambda c: os.fsencode(c.path))
        # removals first (a type change removes the old entry, then creates the new one)
        for c in sel:
            st = self._host_now(c)
            if st is None:
                continue
            new_is_dir = c.new_mode is not None and stat.S_ISDIR(c.new_mode)
            if c.kind is Kind.MODIFIED:
                continue
            if c.kind is Kind.ADDED:
                continue
            if stat.S_ISDIR(st.st_mode):
                if new_is_dir:
                    continue
                self.deletes.append({"op": "rmdir", "path": c.path, "omode": st.st_mode})
            else:
                old = _old_of(st, self.host, c.path)
                assert old is not None
                self.deletes.append({"op": "unlink", "path": c.path, **old})
            self.removed_paths.add(c.path)
        # a directory can only go when everything in it goes
        for d in [op for op in self.deletes if op["op"] == "rmdir"]:
            try:
                names = self.host.listdir(d["path"])
            except OSError as e:
                raise UsageError(f"cannot apply {d['path']}: {os.strerror(e.errno or 0)}") from None
            left = [n for n in names if f"{d['path']}/{n}" not in self.removed_paths]
            if left:
                dc = self.cs.get(d["path"])
                if dc is not None and dc.kind is Kind.TYPECHANGE:
                    raise UsageError(
                        f"cannot replace directory {d['path']}: {len(left)} entries in it are not "
                        f"part of this apply (e.g. {d['path']}/{left[0]})"
                    )
                self.deletes.remove(d)  # keep the directory; its other contents stay
                self.removed_paths.discard(d["path"])
                self.dropped.add(d["path"])
        self.deletes.sort(key=lambda op: _depth_desc(op["path"]), reverse=True)
        for c in sel:
            nm = c.new_mode
            if nm is None:
                continue
            if stat.S_ISDIR(nm):
                hst = self.host.lstat(c.path)
                exists_as_dir = hst is not None and stat.S_ISDIR(hst.st_mode) and c.path not in self.removed_paths
                if not exists_as_dir:
                    self._check_parent(c.path)
                    self.mkdirs.append({"op": "mkdir", "path": c.path})
                    self.created_dirs.add(c.path)
                    self.chmods.append({"op": "chmod", "path": c.path, "omode": stat.S_IFDIR | 0o700, "mode": nm})
                elif stat.S_IMODE(nm) != stat.S_IMODE(hst.st_mode if hst else 0):
                    assert hst is not None
                    self.chmods.append({"op": "chmod", "path": c.path, "omode": hst.st_mode, "mode": nm})
        for c in sel:
            nm = c.new_mode
            if nm is None or stat.S_ISDIR(nm):
                continue
            self._check_parent(c.path)
            parent = c.path.rpartition("/")[0]
            absent = c.path in self.removed_paths or parent in self.created_dirs or parent in self.absent
            hst = None if absent else self.host.lstat(c.path)
            old = _old_of(hst, self.host, c.path)
            if old is not None and old["otype"] == "dir":
                raise UsageError(f"cannot apply {c.path}: it is a directory on the host")
            if stat.S_ISLNK(nm):
                assert c.source is not None
                target = _layer_readlink(self.cs.session, c)
                self.writes.append({"op": "symlink", "path": c.path, "target": target, "old": old,
                                    "layer": c.layer})
            else:
                self.writes.append({"op": "write", "path": c.path, "layer": c.layer,
                                    "mode": nm, "old": old, "size": c.size})
        self.chmods.sort(key=lambda op: _depth_desc(op["path"]), reverse=True)
        return [*self.deletes, *self.mkdirs, *self.writes, *self.chmods]


def _layer_readlink(session: Session, c: Change) -> str:
    with Root(session.lower_stack()[c.layer]) as r:
        return r.readlink(c.path)


def find_conflicts(session: Session, host: Root, ops: list[dict[str, Any]]) -> list[str]:
    created = baseline_ns(session)
    rec = load_applied(session)
    out: list[str] = []
    for op in ops:
        if op["op"] == "mkdir":
            continue
        if op["op"] in ("write", "symlink") and op.get("old") is None:
            continue
        st = host.lstat(op["path"])
        if st is None:
            continue
        if st.st_ctime_ns > created and rec.get(op["path"]) != [st.st_ino, st.st_ctime_ns]:
            out.append(op["path"])
    return out
