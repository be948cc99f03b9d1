"""A per-session overlay lower layer of whiteouts: masked secrets read as absent.

Sits between the snapshot layers and the project, so the sandbox sees no
``.env`` at all; a file it creates at that path lands in upper/ (the real
secret is never reachable) and apply holds such paths back.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from .store import Session


def ensure_mask_layer(sess: Session, masked: Sequence[tuple[str | os.PathLike[str], bool]], project: Path) -> Path:
    rels = sorted(os.path.relpath(os.fspath(p), project) for p, _ in masked)
    digest = hashlib.sha256("\0".join(rels).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    root = sess.dir / "masks"
    layer = root / digest
    if layer.is_dir():
        return layer
    tmp = root / f".{digest}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    for rel in rels:
        if rel.startswith(".."):
            continue
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        # char device 0:0 is overlayfs's whiteout; unprivileged mknod of it works since Linux 5.8
        os.mknod(target, stat.S_IFCHR | 0o000, 0)
    try:
        os.rename(tmp, layer)
    except OSError:  # another run made it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return layer
