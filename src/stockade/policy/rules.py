"""Path rules across layers: deny wins, provenance kept.

A host path rule is ``allow`` (ro or rw) or ``deny``.  Across layers:

* a deny stays in force unless the same path is allowed *exactly* by a later layer
  (a file of one layer may not both allow and deny a path: that is a PolicyError);
* an allow is void when a deny of the same path comes from the same or a later layer;
* an allow under a denied directory has no effect (deny wins) and draws a warning;
* for several allows of one path the latest layer sets the access (ro/rw).

Allows outside the project become grants (bound at the same path); allows inside
the project are exact-path exceptions to the secret patterns.  Denies inside a
visible tree become masks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .config import Origin, PathEntry


@dataclass(frozen=True)
class Rule:
    """One effective (or overridden) rule, for `policy show` and `policy why`."""

    kind: str  # path | secret | env | command | exec | etc | setting
    action: str  # allow-ro | allow-rw | deny | mask | allow | block | set
    target: str
    origin: Origin
    active: bool = True
    note: str = ""

    @property
    def source(self) -> str:
        return self.origin.layer

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "action": self.action,
            "target": self.target,
            "source": self.origin.layer,
            "file": self.origin.file,
            "line": self.origin.line,
            "active": self.active,
            "note": self.note,
        }


@dataclass(frozen=True)
class Decision:
    """The answer of `policy why PATH`."""

    path: str
    visible: bool
    access: str  # rw | ro | masked | denied | absent
    rule: Rule | None
    reason: str
    overridden: tuple[Rule, ...] = ()

    @property
    def source(self) -> str:
        return self.rule.origin.layer if self.rule else "default"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "visible": self.visible,
            "access": self.access,
            "source": self.source,
            "rule": self.rule.to_json() if self.rule else None,
            "reason": self.reason,
            "overridden": [r.to_json() for r in self.overridden],
        }


def is_under(path: str, root: str) -> bool:
    """``path`` equals ``root`` or lies beneath it (both normalized absolute)."""
    if root == "/":
        return True
    return path == root or path.startswith(root + "/")


def path_rule(e: PathEntry, *, active: bool = True, note: str = "") -> Rule:
    action = "deny" if e.access == "deny" else f"allow-{e.access}"
    return Rule("path", action, e.path, e.origin, active, note)


@dataclass
class PathResolution:
    denies: list[PathEntry] = field(default_factory=list)  # in force
    allows: dict[str, PathEntry] = field(default_factory=dict)  # in force, by path
    void: list[tuple[PathEntry, PathEntry]] = field(default_factory=list)  # (loser, winner)
    warnings: list[str] = field(default_factory=list)

    def deny_covering(self, path: str) -> PathEntry | None:
        """The deepest deny in force covering ``path``."""
        best: PathEntry | None = None
        for d in self.denies:
            if is_under(path, d.path) and (best is None or len(d.path) > len(best.path)):
                best = d
        return best

    def beaten(self, path: str) -> list[PathEntry]:
        """Void rules about ``path`` or one of its ancestors (for `why`)."""
        return [loser for loser, _ in self.void if is_under(path, loser.path)]


def resolve_paths(entries: Iterable[PathEntry]) -> PathResolution:
    entries = list(entries)
    res = PathResolution()
    by_path: dict[str, list[PathEntry]] = {}
    for e in entries:
        by_path.setdefault(e.path, []).append(e)
    for path, group in by_path.items():
        denies = [e for e in group if e.access == "deny"]
        allows = [e for e in group if e.access != "deny"]
        last_deny = max((d.origin.index for d in denies), default=-1)
        last_allow = max((a.origin.index for a in allows), default=-1)
        if denies and last_allow > last_deny:
            winner = max(allows, key=lambda a: a.origin.index)
            res.void.extend((d, winner) for d in denies)
            denies = []
        elif denies:
            winner = max(denies, key=lambda d: d.origin.index)
            res.void.extend((a, winner) for a in allows)
            allows = []
        res.denies.extend(denies)
        if allows:
            top = max(allows, key=lambda a: a.origin.index)
            # later layers set the access; the others stay listed as overridden
            res.void.extend((a, top) for a in allows if a is not top and a.access != top.access)
            res.allows[path] = top
    for path, a in list(res.allows.items()):
        d = res.deny_covering(path)
        if d is not None and d.path != path:
            res.warnings.append(
                f"allow {path} ({a.origin}) has no effect: it is inside {d.path}, denied by {d.origin} "
                f"(deny wins; allow {d.path} itself in the same or a later layer to lift it)"
            )
            voided = {id(x) for x, _ in res.void}
            res.void.extend((e, d) for e in by_path[path] if e.access != "deny" and id(e) not in voided)
            del res.allows[path]
    return res


def sensitive_home_dirs(home: str) -> list[str]:
    return [os.path.join(home, n) for n in (".ssh", ".aws", ".gnupg")]


def exposure_warnings(res: PathResolution, home: str, project: str) -> list[str]:
    out: list[str] = []
    for path, a in res.allows.items():
        for s in sensitive_home_dirs(home):
            if is_under(path, s):
                out.append(f"allow {path} ({a.origin}) exposes {s} to the sandbox")
            elif is_under(s, path):
                out.append(
                    f"allow {path} ({a.origin}) contains {s}; it stays masked unless you allow it explicitly"
                )
        if path != project and is_under(project, path):
            out.append(
                f"allow {path} ({a.origin}) contains the project; sibling directories "
                "(other projects) become visible too"
            )
    return out
