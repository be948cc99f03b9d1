"""Change-set data model: frozen, cheap to build, everything else hangs off it."""

from __future__ import annotations

import enum
import fnmatch
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    from ..session.store import Session


class Kind(enum.StrEnum):
    ADDED = "added"
    MODIFIED = "modified"  # content and/or mode
    DELETED = "deleted"
    TYPECHANGE = "typechange"  # file <-> dir <-> symlink
    REFUSED = "refused"  # fifo, socket, device: reported, never applied


_LETTER = {
    Kind.ADDED: "A",
    Kind.MODIFIED: "M",
    Kind.DELETED: "D",
    Kind.TYPECHANGE: "T",
    Kind.REFUSED: "X",
}


def mode_type(mode: int | None) -> str:
    if mode is None:
        return "absent"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "char device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "unknown"


@dataclass(frozen=True)
class Change:
    """One path that differs between the session's merged view and the project.

    ``old_mode``/``new_mode`` are full ``st_mode`` values (type + permissions), None
    when absent on that side. ``size`` is the new content's size (bytes of the file,
    length of the symlink target), 0 for deletions and directories. ``source`` is the
    absolute path of the layer entry holding the new content; ``layer`` its index in
    ``session.lower_stack()``.
    """

    path: str
    kind: Kind
    old_mode: int | None
    new_mode: int | None
    size: int
    binary: bool
    source: str | None = None
    layer: int = -1
    reason: str = ""
    # (uid, gid) inside the sandbox when a sandbox with a range of ids gave the path to
    # another owner than its user (session/idrange.py); None: the sandbox user's
    owner: tuple[int, int] | None = None

    @property
    def letter(self) -> str:
        return _LETTER[self.kind]

    @property
    def old_type(self) -> str:
        return mode_type(self.old_mode)

    @property
    def new_type(self) -> str:
        return mode_type(self.new_mode)

    @property
    def is_dir(self) -> bool:
        """A pure directory change (added/deleted directory, directory mode change)."""
        old_dir = self.old_mode is None or stat.S_ISDIR(self.old_mode)
        new_dir = self.new_mode is None or stat.S_ISDIR(self.new_mode)
        return old_dir and new_dir

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "kind": str(self.kind),
            "status": self.letter,
            "old_type": self.old_type,
            "new_type": self.new_type,
            "old_mode": None if self.old_mode is None else f"{self.old_mode:o}",
            "new_mode": None if self.new_mode is None else f"{self.new_mode:o}",
            "size": self.size,
            "binary": self.binary,
            **({"reason": self.reason} if self.reason else {}),
            **({"owner_inside": {"uid": self.owner[0], "gid": self.owner[1]}} if self.owner else {}),
        }


GLOB_CHARS = frozenset("*?[")


def normalize_pathspec(spec: str, project: Path) -> str:
    """A pathspec relative to the project: absolute paths inside the project are accepted."""
    s = spec
    if s.startswith("/"):
        try:
            s = str(Path(s).relative_to(project))
        except ValueError:
            raise UsageError(f"path {spec!r} is outside the project {project}") from None
    parts = [p for p in s.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UsageError(f"pathspec {spec!r} must not contain '..'")
    return "/".join(parts)


def spec_matches(spec: str, path: str) -> bool:
    """git-like: exact path, a directory prefix, or an fnmatch glob on the full path."""
    if spec == "":
        return True
    if path == spec or path.startswith(spec + "/"):
        return True
    if GLOB_CHARS & set(spec):
        if fnmatch.fnmatchcase(path, spec):
            return True
        # a glob naming a directory selects what is below it
        parts = path.split("/")
        return any(fnmatch.fnmatchcase("/".join(parts[:i]), spec) for i in range(1, len(parts)))
    return False


def is_explicit(spec: str, path: str) -> bool:
    """A pathspec that names ``path`` (or a directory holding it) literally, without globs."""
    if spec == "" or GLOB_CHARS & set(spec):
        return False
    return path == spec or path.startswith(spec + "/")


@dataclass(frozen=True)
class Counts:
    added: int = 0
    modified: int = 0
    deleted: int = 0
    refused: int = 0

    @property
    def total(self) -> int:
        return self.added + self.modified + self.deleted + self.refused

    def phrase(self) -> str:
        parts = [f"{self.added} added", f"{self.modified} modified", f"{self.deleted} deleted"]
        if self.refused:
            parts.append(f"{self.refused} refused")
        return ", ".join(parts)


def count(changes: tuple[Change, ...] | list[Change]) -> Counts:
    """git-like counts: directories count only where nothing below them changed."""
    paths_with_children: set[str] = set()
    for c in changes:
        parts = c.path.split("/")
        for i in range(1, len(parts)):
            paths_with_children.add("/".join(parts[:i]))
    a = m = d = r = 0
    for c in changes:
        if c.is_dir and c.path in paths_with_children:
            continue
        if c.kind is Kind.ADDED:
            a += 1
        elif c.kind is Kind.DELETED:
            d += 1
        elif c.kind is Kind.REFUSED:
            r += 1
        else:
            m += 1
    return Counts(a, m, d, r)


@dataclass(frozen=True)
class Changes:
    """Every change of a session: all its layers merged, compared with the project.
    Plain data; :class:`stockade.changes.scan.ChangeSet` adds the operations."""

    session: Session
    project: Path
    changes: tuple[Change, ...] = field(default_factory=tuple)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.changes)

    def __len__(self) -> int:
        return len(self.changes)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def paths(self) -> list[str]:
        return [c.path for c in self.changes]

    def get(self, path: str) -> Change | None:
        for c in self.changes:
            if c.path == path:
                return c
        return None

    def counts(self) -> Counts:
        return count(self.changes)

    def select(
        self,
        paths: list[str] | tuple[str, ...] | None = None,
        exclude: list[str] | tuple[str, ...] | None = None,
        *,
        must_match: bool = True,
    ) -> tuple[Change, ...]:
        """Changes matching ``paths`` (all when None) minus ``exclude``.

        A pathspec that matches nothing is a UsageError (when ``must_match``).
        """
        specs = [normalize_pathspec(p, self.project) for p in paths] if paths else None
        excl = [normalize_pathspec(p, self.project) for p in exclude] if exclude else []
        out: list[Change] = []
        if specs is not None and must_match:
            for raw, s in zip(paths or [], specs, strict=True):
                if not any(spec_matches(s, c.path) for c in self.changes):
                    raise UsageError(f"pathspec {raw!r} did not match any change")
        for c in self.changes:
            if specs is not None and not any(spec_matches(s, c.path) for s in specs):
                continue
            if any(spec_matches(x, c.path) for x in excl):
                continue
            out.append(c)
        return tuple(out)
