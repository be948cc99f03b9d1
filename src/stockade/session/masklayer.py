"""A per-session overlay lower layer that masks secrets: no mount inside the project.

The layer sits between the snapshot layers and the project. For mask mode
"absent" it holds whiteouts (char 0:0), so the sandbox sees no ``.env`` at all;
for "empty" it holds empty read-only files and empty opaque directories. Either
way the real secret is below the mask and never reachable; whatever the sandbox
writes at that path lands in upper/, and apply refuses it.

Masking with overlay content instead of bind mounts matters: a bind target
inside the project would be resolved through the upper layer, which earlier runs
of the sandbox wrote, so a planted symlink could aim the mount (and the creation
of its mount point) at the host.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from .store import Session

OPAQUE_XATTR = "user.overlay.opaque"  # overlayfs in a user namespace uses the user.* namespace


def _mirror_dir(src: Path, dst: Path) -> None:
    """Intermediate directories of the layer take the project's attributes: overlayfs
    shows the upper-most layer's directory metadata."""
    try:
        st = os.lstat(src)
    except OSError:
        return
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    if os.geteuid() == 0:
        os.lchown(dst, st.st_uid, st.st_gid)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def ensure_mask_layer(
    sess: Session,
    masked: Sequence[tuple[str | os.PathLike[str], bool, bool]],
    project: Path,
    mode: str,
) -> Path:
    """The layer for ``masked`` = [(host path, is_dir, is_symlink)] under ``project``."""
    items = sorted(
        (os.path.relpath(os.fspath(p), project), is_dir, is_link)
        for p, is_dir, is_link in masked
    )
    key = "\0".join(f"{r}\1{int(d)}{int(link)}" for r, d, link in items) + f"\0{mode}"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    root = sess.dir / "masks"
    layer = root / digest
    if layer.is_dir():
        return layer
    tmp = root / f".{digest}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    made: list[Path] = []
    try:
        for rel, is_dir, is_link in items:
            if rel.startswith("..") or rel == ".":
                continue
            target = tmp / rel
            cur = tmp
            for part in Path(rel).parts[:-1]:
                cur = cur / part
                if not cur.is_dir():
                    cur.mkdir()
                    made.append(cur)
            if mode == "absent" or is_link:
                os.mknod(target, stat.S_IFCHR | 0o000, 0)  # whiteout (unprivileged since Linux 5.8)
            elif is_dir:
                target.mkdir(mode=0o755)
                os.setxattr(target, OPAQUE_XATTR, b"y")  # needs write access: chmod after
                os.chmod(target, 0o555)
            else:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
                os.close(fd)
        # parents mirror the project's directories, deepest first, once their entries exist
        for d in sorted(made, key=lambda p: len(p.parts), reverse=True):
            _mirror_dir(project / d.relative_to(tmp), d)
        _mirror_dir(project, tmp)
        try:
            os.rename(tmp, layer)
        except OSError:  # another run made it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return layer
