"""Revalidation of cached path resolutions, shared by the policy cache and the CLI's
warm-run cache (a module of its own: the warm path must not import the policy package)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Mapping
from typing import Any

# A file or directory changed within this long of being read may change again with the
# same timestamps (their granularity, and clocks a little apart): caches compare such
# a one by content, or do not keep it, until it is older. The one value every cache uses.
RACY_NS = 2_000_000_000


FileSig = tuple[int, int, int, int, int]  # (dev, ino, size, mtime, ctime)
DirSig = tuple[int, int, int]  # (dev, ino, mtime)


def file_sig(path: str) -> FileSig | None:
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


def read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


class Consulted:
    """What loading a result consulted on disk (the policy cache's record): its files,
    with their content while racy, and every path it resolved or tested; ``valid``
    tells whether loading again would consult the same things."""

    def __init__(self, files: list[tuple[str, FileSig | None, bytes | None]], notes: list[tuple[str, str, object]],
                 started_ns: int) -> None:
        # (file, stat signature, content while racy)
        self.files = files
        # A path with no symlink along it keeps resolving to itself while none of its
        # components is a symlink. A directory whose identity and mtime are unchanged
        # has the same entries (none can have been replaced by a symlink); one that
        # changed (or changed within RACY_NS of the recording, so may change again
        # unseen) has the entries on the recorded paths checked one by one.
        # dir -> [(dev, ino, mtime) or None when racy, entries of it on the paths]
        self.dirs: dict[str, tuple[DirSig | None, list[str]]] = {}
        self.resolved: list[tuple[str, str]] = []  # (raw, realpath) resolved again each time
        self.exists: list[tuple[str, bool]] = []
        for kind, raw, result in notes:
            if kind == "lexists":
                self.exists.append((raw, bool(result)))
                continue
            norm = os.path.normpath(raw)
            if result != norm or not raw.startswith("/"):
                self.resolved.append((raw, str(result)))
                continue
            parts = norm.split("/")[1:]
            cur = "/"
            for i, part in enumerate(parts):
                ent = self.dirs.get(cur)
                if ent is None:
                    try:
                        st = os.lstat(cur)
                    except OSError:
                        self.resolved.append((raw, str(result)))
                        break
                    racy = st.st_mtime_ns >= started_ns - RACY_NS
                    ent = self.dirs[cur] = (None if racy else (st.st_dev, st.st_ino, st.st_mtime_ns), [])
                child = os.path.join(cur, part)
                if child not in ent[1]:
                    ent[1].append(child)
                if i == len(parts) - 1:
                    break
                try:
                    st = os.lstat(child)
                except OSError:
                    break  # missing: it cannot appear without its parent changing
                if not stat.S_ISDIR(st.st_mode):
                    break
                cur = child

    def valid(self, sigs: list[FileSig | None]) -> bool:
        """Would loading consult the same now? ``sigs``: the files' signatures now."""
        if [s for _f, s, _c in self.files] != sigs:
            return False
        now = time.time_ns()
        for i, (path, sig, content) in enumerate(self.files):
            if content is not None:
                if read_bytes(path) != content:
                    return False
                if sig is not None and sig[3] < now - RACY_NS:
                    self.files[i] = (path, sig, None)
        if not paths_hold(self.dirs):
            return False
        for raw, real in self.resolved:
            if os.path.realpath(raw) != real:
                return False
        return all(os.path.lexists(p) == e for p, e in self.exists)
