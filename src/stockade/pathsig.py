"""Revalidation of cached path resolutions, shared by the policy cache and the CLI's
warm-run cache (a module of its own: the warm path must not import the policy package)."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any


def file_sig(path: str) -> tuple[int, int, int, int, int] | None:
    """(dev, ino, size, mtime, ctime) of ``path``, None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def paths_hold(dirs: Mapping[str, Any]) -> bool:
    """Each directory's recorded (dev, ino, mtime) still holds, or else none of the
    entries recorded beneath it became a symlink."""
    for d, (sig, entries) in dirs.items():
        try:
            st = os.lstat(d)
        except OSError:
            return False
        if sig is not None and (st.st_dev, st.st_ino, st.st_mtime_ns) == tuple(sig):
            continue
        for p in entries:
            try:
                if stat.S_ISLNK(os.lstat(p).st_mode):
                    return False
            except OSError:
                continue
    return True
