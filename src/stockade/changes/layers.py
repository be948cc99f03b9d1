"""Editing a session's layers after changes were applied or discarded.

When a change leaves the session (applied to the project, or discarded), the
session's merged view at that path must show the project again. That means
removing the path's entry from *every* layer (upper and frozen snapshot layers;
see notes/README-changes.md for why frozen layers are edited too) and making sure
nothing above still hides the project there: an opaque ancestor directory in a
layer is "pushed down" (its opacity is replaced by whiteouts for the names below
it that it was hiding, and its subdirectories become opaque), and a whiteout
ancestor becomes an opaque directory which is then pushed down in turn.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ._safefs import Root, is_whiteout

OPAQUE_NAMES = ("user.overlay.opaque", "trusted.overlay.opaque")


def opaque_name(path: str) -> str | None:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return None
    for n in OPAQUE_NAMES:
        if n in names:
            try:
                if os.getxattr(path, n, follow_symlinks=False) == b"y":
                    return n
            except OSError:
                return None
    return None


def set_opaque(path: str, name: str = "user.overlay.opaque") -> None:
    os.setxattr(path, name, b"y", follow_symlinks=False)
    if name != "trusted.overlay.opaque":
        # also mark it for overlay mounted without userxattr (real root); best effort
        try:
            os.setxattr(path, "trusted.overlay.opaque", b"y", follow_symlinks=False)
        except OSError:
            pass


def clear_opaque(path: str) -> None:
    for n in OPAQUE_NAMES:
        try:
            os.removexattr(path, n, follow_symlinks=False)
        except OSError as e:
            if e.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                raise


def make_whiteout(dirfd: int, name: str) -> None:
    os.mknod(name, stat.S_IFCHR | 0o000, 0, dir_fd=dirfd)


def _names_below(stack: list[Path], li: int, project: Root, rel: str) -> set[str]:
    """Names a directory ``rel`` has in everything below layer ``li`` (over-approximation)."""
    names: set[str] = set()
    for j in range(li):
        d = os.path.join(stack[j], rel)
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                names.update(os.listdir(d))
            except OSError:
                pass
    try:
        names.update(project.listdir(rel))
    except OSError:
        pass
    return names


def _push_down(stack: list[Path], li: int, project: Root, rel: str, xname: str) -> None:
    """Make opaque directory ``rel`` of layer ``li`` non-opaque without changing the view."""
    layer = os.fspath(stack[li])
    d = os.path.join(layer, rel)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        present = set(os.listdir(dfd))
        for n in sorted(_names_below(stack, li, project, rel) - present):
            make_whiteout(dfd, n)
        for n in present:
            st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) and opaque_name(os.path.join(d, n)) is None:
                set_opaque(os.path.join(d, n), xname)
    finally:
        os.close(dfd)
    clear_opaque(d)


def expose(stack: list[Path], li: int, project: Root, rel: str) -> bool:
    """Make sure no ancestor of ``rel`` in layer ``li`` hides what is below it at ``rel``.

    Returns True when the layer was changed."""
    changed = False
    layer = os.fspath(stack[li])
    parts = rel.split("/")
    for i in range(1, len(parts)):
        anc = "/".join(parts[:i])
        a = os.path.join(layer, anc)
        try:
            st = os.lstat(a)
        except (FileNotFoundError, NotADirectoryError):
            return changed  # the layer has nothing here; nothing below can be hidden by it
        if is_whiteout(st):
            pst = project.lstat(anc)
            mode = stat.S_IMODE(pst.st_mode) if pst is not None and stat.S_ISDIR(pst.st_mode) else 0o755
            os.unlink(a)
            os.mkdir(a, mode)
            os.chmod(a, mode)
            set_opaque(a)
            _push_down(stack, li, project, anc, "user.overlay.opaque")
            changed = True
        elif stat.S_ISDIR(st.st_mode):
            xn = opaque_name(a)
            if xn is not None:
                _push_down(stack, li, project, anc, xn)
                changed = True
        else:
            return changed  # a non-directory ancestor: nothing below exists in this layer
    return changed


def entry_in_layer(layer: Path, rel: str) -> os.stat_result | None:
    try:
        with Root(layer) as r:
            return r.lstat(rel)
    except OSError:
        return None
