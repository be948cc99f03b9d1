"""The change set stockade hands out (``Sandbox.changes()``, the CLI): a session's
changes (:mod:`.walk`) with their operations, each implemented in its own module
(:mod:`.diff`, :mod:`.held`, :mod:`.apply`, :mod:`.discard`). It sits above them all,
so none of them imports it: they take the plain :class:`.model.Changes`."""

from __future__ import annotations

from ..session.store import Session
from .apply import ApplyResult, apply_changes
from .diff import render_diff, render_stat
from .discard import discard_changes
from .held import held_back
from .model import Change, Changes
from .risks import Risk, assess
from .walk import walk


class ChangeSet(Changes):
    """Every change of a session, with diff, stat, apply, discard, held_back and risks."""

    def diff_bytes(self, paths: list[str] | None = None, *, color: bool = False) -> bytes:
        return render_diff(self, self.select(paths), color=color)

    def diff(self, paths: list[str] | None = None) -> str:
        """A git-style unified diff (``git apply`` accepts it)."""
        return self.diff_bytes(paths).decode("utf-8", "surrogateescape")

    def stat(self, paths: list[str] | None = None) -> str:
        return render_stat(self, self.select(paths))

    def apply(
        self,
        paths: list[str] | None = None,
        exclude: list[str] | None = None,
        force: bool = False,
        dry_run: bool = False,
        include_git: bool = False,
        never_held: bool = False,
    ) -> ApplyResult:
        return apply_changes(self, paths=paths, exclude=exclude, force=force, dry_run=dry_run,
                             include_git=include_git, never_held=never_held)

    def discard(self, paths: list[str] | None = None) -> list[str]:
        return discard_changes(self, paths=paths)

    def held_back(self, changes: tuple[Change, ...] | list[Change] | None = None,
                  include_git: bool = False) -> dict[str, str]:
        """path -> why ``apply`` (with ``include_git``) holds it back unless a pathspec names
        it literally (host-code-execution vectors, git metadata and the worktrees that need
        it, stockade policy files, symlinks leading out)."""
        return held_back(self, changes, include_git=include_git)

    def risks(self, paths: list[str] | None = None) -> list[Risk]:
        """What deserves a second look before an apply (:mod:`.risks`): most severe first."""
        return assess(self, paths=paths)

    def changes_json(self, changes: tuple[Change, ...] | list[Change] | None = None) -> list[dict[str, object]]:
        """``changes`` (default: all) as JSON, each held-back one with ``held_back``: why."""
        todo = self.changes if changes is None else changes
        held = self.held_back(todo)
        return [{**c.to_json(), **({"held_back": held[c.path]} if c.path in held else {})} for c in todo]

    def to_json(self) -> dict[str, object]:
        c = self.counts()
        return {
            "session": self.session.id,
            "project": str(self.project),
            "counts": {"added": c.added, "modified": c.modified, "deleted": c.deleted, "refused": c.refused},
            "changes": self.changes_json(),
        }


def scan(session: Session, *, classify: bool = True) -> ChangeSet:
    """The session's change set. ``classify=False`` skips binary detection (faster)."""
    c = walk(session, classify=classify)
    return ChangeSet(c.session, c.project, c.changes)


def layer_has_entries(session: Session) -> bool:
    """Cheap: does any layer hold anything at all?"""
    return session.has_layer_entries()
