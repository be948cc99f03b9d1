"""Snapshots (frozen layers) and forks.

* ``create NAME``: the upper directory is renamed to ``layers/NNN-NAME`` (O(1)) and a
  new empty upper is made; later runs mount every layer.
* ``restore NAME``: the layers above NAME and the current upper are dropped.
* ``delete NAME``: the snapshot stops being a restore point, but its changes stay in
  the session: its layer is merged into the layer above it (or the upper).
* ``fork S NEW``: S's upper is frozen (an automatic snapshot ``fork-NEW``), then NEW
  starts on hard-linked copies of S's layers (inodes are shared, never written in
  place: overlay copies up before writing and apply only unlinks/renames entries).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..linux.idns import acting_root
from ..session import idrange, store
from ..session.store import Session
from . import journal
from ._safefs import is_whiteout
from .layers import opaque_name, set_opaque

_SNAP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_LAYER_RE = re.compile(r"^(\d{3,})-(.+)$")


@dataclass(frozen=True)
class Snapshot:
    name: str
    index: int
    path: Path
    created: float


def _check_name(name: str) -> str:
    if not _SNAP_RE.match(name):
        raise UsageError(f"invalid snapshot name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return name


def list_snapshots(session: Session) -> list[Snapshot]:
    out: list[Snapshot] = []
    for p in session.layers():
        m = _LAYER_RE.match(p.name)
        if not m:
            continue
        try:
            created = p.stat().st_mtime
        except OSError:
            created = 0.0
        out.append(Snapshot(m.group(2), int(m.group(1)), p, created))
    return out


def _find(session: Session, name: str) -> Snapshot:
    for s in list_snapshots(session):
        if s.name == name:
            return s
    raise UsageError(f"session {session.id} has no snapshot named {name!r}; see `stockade snapshot list`")


def _fresh_upper(session: Session) -> None:
    session.upper.mkdir(mode=0o755)
    own = session.meta()
    uid, gid = own.get("sandbox_uid"), own.get("sandbox_gid")
    if isinstance(uid, int) and isinstance(gid, int) and acting_root():
        os.chown(session.upper, uid, gid)


def _new_upper(session: Session, step: str, mode: int) -> Path:
    """The next empty upper, made before anything moves: a full disk changes nothing."""
    fresh = session.dir / f".upper-new-{os.getpid()}"
    with store.disk_space(step, session.dir, f"free space on {store.mount_point(session.dir)} and try again; "
                          f"session {session.id} is as it was"):
        session.layers_dir.mkdir(exist_ok=True, mode=0o700)
        os.mkdir(fresh, mode)
    return fresh


def _freeze_upper(session: Session, name: str) -> Snapshot:
    snaps = list_snapshots(session)
    if any(s.name == name for s in snaps):
        raise UsageError(f"session {session.id} already has a snapshot named {name!r}")
    idx = max((s.index for s in snaps), default=0) + 1
    dest = session.layers_dir / f"{idx:03d}-{name}"
    upper_mode = stat.S_IMODE(session.upper.stat().st_mode)
    fresh = _new_upper(session, f"snapshot session {session.id}", upper_mode)
    os.rename(session.upper, dest)
    os.rename(fresh, session.upper)
    st = dest.stat()
    if acting_root():
        os.chown(session.upper, st.st_uid, st.st_gid)
    return Snapshot(name, idx, dest, time.time())


@idrange.with_sandbox_ids()
def create(session: Session, name: str) -> Snapshot:
    """Freeze the upper layer as read-only snapshot ``name`` (an O(1) rename)."""
    _check_name(name)
    with session.lock(wait=False):
        return _freeze_upper(session, name)


@idrange.with_sandbox_ids()
def restore(session: Session, name: str) -> list[str]:
    """Return the session to snapshot ``name``: drop the layers above it and the upper."""
    _check_name(name)
    with session.lock(wait=False):
        snap = _find(session, name)
        dropped: list[str] = []
        fresh = _new_upper(session, f"restore session {session.id}", 0o755)
        trash = session.dir / f".trash-{os.getpid()}-{time.time_ns()}"
        try:
            with store.disk_space(f"restore session {session.id}", session.dir):
                trash.mkdir()
        except BaseException:
            fresh.rmdir()
            raise
        for s in list_snapshots(session):
            if s.index > snap.index:
                os.rename(s.path, trash / s.path.name)
                dropped.append(s.name)
        os.rename(session.upper, trash / "upper")
        os.rename(fresh, session.upper)
        st = snap.path.stat()
        if acting_root():
            os.chown(session.upper, st.st_uid, st.st_gid)
        shutil.rmtree(trash, ignore_errors=True)
        return dropped


@idrange.with_sandbox_ids()
def delete(session: Session, name: str) -> None:
    """Forget snapshot ``name`` as a restore point; its changes stay (merged upward)."""
    _check_name(name)
    with session.lock(wait=False):
        _delete(session, name)


def _delete(session: Session, name: str) -> None:
    """``delete`` for a caller that holds the session's lock (and the sandbox's ids)."""
    snap = _find(session, name)
    above = [s for s in list_snapshots(session) if s.index > snap.index]
    target = above[0].path if above else session.upper
    merge_into(snap.path, target)
    shutil.rmtree(snap.path, ignore_errors=True)


def merge_into(lower: Path, upper: Path, rel: str = "") -> None:
    """Move the entries of layer ``lower`` into the layer directly above it, keeping the view."""
    ldir = lower / rel if rel else lower
    udir = upper / rel if rel else upper
    for name in os.listdir(ldir):
        lp = ldir / name
        up = udir / name
        lst = os.lstat(lp)
        try:
            ust: os.stat_result | None = os.lstat(up)
        except FileNotFoundError:
            ust = None
        if ust is None:
            os.rename(lp, up)  # nothing above: it shows through unchanged
            continue
        if not stat.S_ISDIR(ust.st_mode) or is_whiteout(ust) or opaque_name(str(up)):
            continue  # hidden by the upper entry
        # upper has a plain directory here
        if stat.S_ISDIR(lst.st_mode) and not opaque_name(str(lp)):
            merge_into(lower, upper, f"{rel}/{name}" if rel else name)
        else:
            # a whiteout/non-dir/opaque dir below a plain dir: the dir must hide what is below
            if stat.S_ISDIR(lst.st_mode):
                merge_into_opaque(lp, up)
            set_opaque(str(up))


def merge_into_opaque(lower_dir: Path, upper_dir: Path) -> None:
    """Upper dir becomes opaque: bring the lower opaque dir's entries it does not hide."""
    for name in os.listdir(lower_dir):
        up = upper_dir / name
        if not os.path.lexists(up):
            os.rename(lower_dir / name, up)
        else:
            ust = os.lstat(up)
            lst = os.lstat(lower_dir / name)
            if stat.S_ISDIR(ust.st_mode) and not is_whiteout(ust) and stat.S_ISDIR(lst.st_mode) \
                    and not opaque_name(str(up)):
                merge_into(lower_dir / name, up)
                if opaque_name(str(lower_dir / name)):
                    set_opaque(str(up))


def _link_tree(src: Path, dst: Path) -> None:
    """Copy a layer: directories (with their xattrs) recreated, everything else hard-linked."""
    st = os.lstat(src)
    os.mkdir(dst, stat.S_IMODE(st.st_mode))
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    for n in os.listxattr(src, follow_symlinks=False):
        try:
            os.setxattr(dst, n, os.getxattr(src, n, follow_symlinks=False), follow_symlinks=False)
        except OSError:
            pass
    for de in os.scandir(src):
        s = Path(de.path)
        d = dst / de.name
        if de.is_dir(follow_symlinks=False):
            _link_tree(s, d)
        else:
            try:
                os.link(s, d, follow_symlinks=False)
            except OSError:
                if de.is_symlink():
                    os.symlink(os.readlink(s), d)
                elif is_whiteout(de.stat(follow_symlinks=False)):
                    os.mknod(d, stat.S_IFCHR, 0)
                else:
                    shutil.copy2(s, d, follow_symlinks=False)
    if acting_root():
        os.lchown(dst, st.st_uid, st.st_gid)


@idrange.with_sandbox_ids()
def fork(session: Session, new_name: str) -> Session:
    """A new session on the same frozen layers as ``session`` (its upper frozen first)."""
    store.validate_name(new_name)
    try:
        store.open_session(new_name)
    except UsageError:
        pass
    else:
        raise UsageError(f"session {new_name!r} already exists")
    with session.lock(wait=False):
        if any(True for _ in os.scandir(session.upper)):
            name = f"fork-{new_name}"
            base, k = name, 1
            while any(s.name == name for s in list_snapshots(session)):
                k += 1
                name = f"{base}-{k}"
            _freeze_upper(session, name[:64])
        meta = session.meta()
        owner = None
        if isinstance(meta.get("sandbox_uid"), int) and isinstance(meta.get("sandbox_gid"), int):
            owner = (int(meta["sandbox_uid"]), int(meta["sandbox_gid"]))
        new = store.create(Path(meta["project"]), new_name, owner=owner)
        try:
            with store.disk_space(f"fork session {session.id} as {new_name}", new.dir):
                layers = session.layers()
                if layers:
                    new.layers_dir.mkdir(exist_ok=True, mode=0o700)
                for layer in layers:
                    _link_tree(layer, new.layers_dir / layer.name)
                if owner is not None and acting_root():
                    os.chown(new.upper, *owner)
                idrange.copy_mark(session.dir, new.dir)
                # the changes it inherits were made against the project as it was when the
                # parent started: conflicts are judged from then (and what the parent
                # applied since is known as its own), not from the fork's creation
                applied = journal.applied_record_path(session)
                if applied.exists():
                    shutil.copyfile(applied, journal.applied_record_path(new))
                new.update_meta(forked_from=session.id, baseline_ns=journal.baseline_ns(session))
        except BaseException:
            shutil.rmtree(new.dir, ignore_errors=True)  # a half-made fork is no session
            raise
        return new
