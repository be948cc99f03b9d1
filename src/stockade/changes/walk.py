"""Walk a session's layers (never the project) and compare with the project: the
session's changes as data (``walk``); ``scan.py`` hands them out with their operations.

Cost grows with what changed: we walk the upper layer and the frozen layers and
look up only the touched paths in the project (plus the contents of directories
the session deleted or made opaque, which are themselves changes).

Layer semantics follow overlayfs, topmost layer first:

* a whiteout (char device 0:0, or a file with ``*.overlay.whiteout`` in a
  directory whose ``*.overlay.opaque`` is ``x``) deletes the path below it;
* a non-directory hides everything below it at that path;
* a directory merges with the directories below it unless it is opaque
  (``user.overlay.opaque`` / ``trusted.overlay.opaque`` = ``y``);
* redirect and metacopy entries are refused: we never create them and cannot
  interpret them safely.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import ProjectGone, UsageError
from ..session import idrange
from ..session.store import Session
from ._safefs import Root, files_equal, is_whiteout
from .model import Change, Changes, Kind

BINARY_PROBE = 8000  # what git reads to decide "binary"

_OPAQUE = ("user.overlay.opaque", "trusted.overlay.opaque")
_WHITEOUT_X = ("user.overlay.whiteout", "trusted.overlay.whiteout")
_REFUSE_X = ("overlay.redirect", "overlay.metacopy")


@dataclass
class _Entry:
    layer: int
    st: os.stat_result
    whiteout: bool
    floor: int  # layers below this index (and the project when >= 0) are hidden below this path


def _xattrs(path: str) -> list[str]:
    try:
        return os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOENT):
            return []
        raise


def _check_xattrs(path: str, names: list[str], rel: str) -> None:
    for n in names:
        if n.endswith(_REFUSE_X) and (n.startswith(("user.", "trusted."))):
            raise UsageError(
                f"{rel}: layer entry carries {n}, which stockade does not support "
                "(mount without redirect_dir/metacopy); refusing to read this session"
            )


def _opaque_value(path: str, names: list[str]) -> bytes:
    for n in _OPAQUE:
        if n in names:
            try:
                return os.getxattr(path, n, follow_symlinks=False)
            except OSError:
                return b""
    return b""


def merge_layers(stack: list[Path]) -> dict[str, _Entry]:
    """Merged view of the layers (lowest first in ``stack``): path -> topmost entry."""
    entries: dict[str, _Entry] = {}
    for li in range(len(stack) - 1, -1, -1):
        root = os.fspath(stack[li])
        if not os.path.isdir(root):
            continue
        _walk(root, "", li, entries)
    return entries


def _walk(root: str, rel: str, li: int, entries: dict[str, _Entry]) -> None:
    absdir = os.path.join(root, rel) if rel else root
    xwhiteouts = False
    if rel:
        names = _xattrs(absdir)
        xwhiteouts = _opaque_value(absdir, names) == b"x"
    try:
        it = os.scandir(absdir)
    except (FileNotFoundError, NotADirectoryError):
        return
    with it:
        for de in it:
            p = f"{rel}/{de.name}" if rel else de.name
            st = de.stat(follow_symlinks=False)
            e = entries.get(p)
            isdir = stat.S_ISDIR(st.st_mode)
            if e is not None:
                # already provided by a higher layer: merge only dir over dir, not hidden
                if not stat.S_ISDIR(e.st.st_mode) or e.whiteout or e.floor > li:
                    continue  # hidden
                if isdir:
                    names = _xattrs(de.path)
                    _check_xattrs(de.path, names, p)
                    if _opaque_value(de.path, names) == b"y":
                        e.floor = li
                    _walk(root, p, li, entries)
                else:
                    # a whiteout or non-directory under a directory: lookup stops here,
                    # so what is below (lower layers, the project) is hidden
                    e.floor = li
                continue
            whiteout = is_whiteout(st)
            if not whiteout and xwhiteouts and stat.S_ISREG(st.st_mode) and st.st_size == 0:
                names = _xattrs(de.path)
                whiteout = any(n in names for n in _WHITEOUT_X)
            if isdir:
                names = _xattrs(de.path)
                _check_xattrs(de.path, names, p)
                floor = li if _opaque_value(de.path, names) == b"y" else -1
                entries[p] = _Entry(li, st, False, floor)
                _walk(root, p, li, entries)
            else:
                if stat.S_ISREG(st.st_mode):
                    _check_xattrs(de.path, _xattrs(de.path), p)
                entries[p] = _Entry(li, st, whiteout, li)


def _is_binary(root: Root, rel: str) -> bool:
    try:
        return b"\0" in root.read_bytes(rel, BINARY_PROBE)
    except OSError:
        return False


class Walker:
    def __init__(self, session: Session, *, classify: bool = True, stack: list[Path] | None = None) -> None:
        self.session = session
        self.project = session.project
        # (less a running sandbox's own snapshots); ``stack``: the layers of a restore point
        self.stack = session.view_stack() if stack is None else stack
        self.classify = classify
        self.out: list[Change] = []
        # project paths found absent or not directories: nothing below them needs a lookup
        # (paths are visited parents first)
        self._absent: set[str] = set()

    def _deleted_tree(self, host: Root, rel: str, st: os.stat_result, seen: dict[str, _Entry]) -> None:
        """``rel`` (present on the host) is gone from the merged view: it and all below."""
        binary = False
        if stat.S_ISREG(st.st_mode) and self.classify:
            binary = _is_binary(host, rel)
        self.out.append(Change(rel, Kind.DELETED, st.st_mode, None, 0, binary))
        if stat.S_ISDIR(st.st_mode):
            self._deleted_children(host, rel, seen)

    def _deleted_children(self, host: Root, rel: str, seen: dict[str, _Entry]) -> None:
        try:
            names = host.listdir(rel)
        except OSError:
            return
        for n in names:
            c = f"{rel}/{n}"
            if c in seen:
                continue
            cst = host.lstat(c)
            if cst is not None:
                self._deleted_tree(host, c, cst, seen)

    def run(self) -> Changes:
        entries = merge_layers(self.stack)
        layer_roots: dict[int, Root] = {}
        try:
            with Root(self.project) as host:
                for p in sorted(entries, key=os.fsencode):
                    e = entries[p]
                    lroot = layer_roots.get(e.layer)
                    if lroot is None:
                        lroot = layer_roots[e.layer] = Root(self.stack[e.layer])
                    self._one(host, lroot, p, e, entries)
        except (FileNotFoundError, NotADirectoryError) as ex:
            if ex.filename == os.fspath(self.project):
                raise ProjectGone(
                    f"project {self.project} of session {self.session.id} no longer exists"
                ) from None
            raise
        finally:
            for r in layer_roots.values():
                r.close()
        ids = idrange.read(self.session.dir)
        if ids is not None and ids.uid_map:
            self.out = [_owned(c, entries, ids) for c in self.out]
        masked = mask_paths(self.session)
        if masked:
            self.out = [_masked(c) if _under(c.path, masked) else c for c in self.out]
        self.out.sort(key=lambda c: os.fsencode(c.path))
        return Changes(self.session, self.project, tuple(self.out))

    def _one(self, host: Root, layer: Root, p: str, e: _Entry, entries: dict[str, _Entry]) -> None:
        hst = None if p.rpartition("/")[0] in self._absent else host.lstat(p)
        if hst is None or not stat.S_ISDIR(hst.st_mode):
            self._absent.add(p)
        new = e.st
        src = f"{layer.path}/{p}"  # p is relative; layer.path comes from a Path (no trailing /)
        if e.whiteout:
            if hst is not None:
                self._deleted_tree(host, p, hst, entries)
            return
        nmode = new.st_mode
        if not (stat.S_ISREG(nmode) or stat.S_ISDIR(nmode) or stat.S_ISLNK(nmode)):
            what = "fifo" if stat.S_ISFIFO(nmode) else "socket" if stat.S_ISSOCK(nmode) else "device node"
            self.out.append(
                Change(p, Kind.REFUSED, None if hst is None else hst.st_mode, nmode, 0, False,
                       src, e.layer, f"{what}s are not applied")
            )
            return
        if stat.S_ISDIR(nmode):
            if hst is None:
                self.out.append(Change(p, Kind.ADDED, None, nmode, 0, False, src, e.layer))
            elif not stat.S_ISDIR(hst.st_mode):
                self.out.append(Change(p, Kind.TYPECHANGE, hst.st_mode, nmode, 0, False, src, e.layer))
            else:
                if stat.S_IMODE(hst.st_mode) != stat.S_IMODE(nmode):
                    self.out.append(Change(p, Kind.MODIFIED, hst.st_mode, nmode, 0, False, src, e.layer))
                if e.floor >= 0:  # opaque: the project's contents here are gone
                    self._deleted_children(host, p, entries)
            return
        # regular file or symlink
        if stat.S_ISLNK(nmode):
            target = os.fsencode(layer.readlink(p))
            size, binary = len(target), False
        else:
            size = new.st_size
            binary = self.classify and _is_binary(layer, p)
        if hst is None:
            self.out.append(Change(p, Kind.ADDED, None, nmode, size, binary, src, e.layer))
            return
        hmode = hst.st_mode
        if stat.S_IFMT(hmode) != stat.S_IFMT(nmode):
            if stat.S_ISREG(hmode) and self.classify and not binary:
                binary = _is_binary(host, p)
            self.out.append(Change(p, Kind.TYPECHANGE, hmode, nmode, size, binary, src, e.layer))
            if stat.S_ISDIR(hmode):
                self._deleted_children(host, p, entries)
            return
        if stat.S_ISLNK(nmode):
            if os.fsencode(host.readlink(p)) != target:
                self.out.append(Change(p, Kind.MODIFIED, hmode, nmode, size, False, src, e.layer))
            return
        same = (
            stat.S_IMODE(hmode) == stat.S_IMODE(nmode)
            and hst.st_size == new.st_size
            and files_equal(host, p, layer, p, new.st_size)
        )
        if not same:
            if self.classify and not binary:
                binary = _is_binary(host, p)
            self.out.append(Change(p, Kind.MODIFIED, hmode, nmode, size, binary, src, e.layer))


def mask_paths(session: Session) -> set[str]:
    """Paths the runtime's mask layers (``<session>/masks/*``) hide from the sandbox."""
    out: set[str] = set()
    root = session.dir / "masks"
    try:
        layers = [d for d in os.scandir(root) if d.is_dir(follow_symlinks=False) and not d.name.startswith(".")]
    except FileNotFoundError:
        return out
    for layer in layers:
        for dirpath, dirs, files in os.walk(layer.path):
            for n in files:
                out.add(os.path.relpath(os.path.join(dirpath, n), layer.path))
            for n in dirs:  # masked directories are empty opaque directories
                p = os.path.join(dirpath, n)
                try:
                    if os.getxattr(p, "user.overlay.opaque", follow_symlinks=False) == b"y":
                        out.add(os.path.relpath(p, layer.path))
                except OSError:
                    pass
    return out


def _owned(c: Change, entries: dict[str, _Entry], ids: idrange.Ids) -> Change:
    """``c`` with the inside owner of its new side, when not the sandbox user."""
    e = entries.get(c.path)
    if c.new_mode is None or e is None or e.whiteout:
        return c
    owner = ids.inside_owner(e.st)
    return dataclasses.replace(c, owner=owner) if owner is not None else c


def _under(path: str, roots: set[str]) -> bool:
    parts = path.split("/")
    return any("/".join(parts[:i]) in roots for i in range(1, len(parts) + 1))


def _masked(c: Change) -> Change:
    return Change(c.path, Kind.REFUSED, c.old_mode, c.new_mode, c.size, c.binary, c.source, c.layer,
                  "masked secret path: never diffed or applied")


@idrange.with_sandbox_ids(retry=True)
def walk(session: Session, *, classify: bool = True, stack: list[Path] | None = None) -> Changes:
    """The session's changes. ``classify=False`` skips binary detection (faster);
    ``stack``: of these layers instead (a snapshot's restore point: it and those below)."""
    return Walker(session, classify=classify, stack=stack).run()
