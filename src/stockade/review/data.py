"""What the review page shows, as JSON: the change set (with held-back reasons, marks and
per-path signatures), the runs that made it, the applies, the risk summary, one file's
hunks. No HTTP here (``app`` serves it), so it is tested on its own."""

from __future__ import annotations

import stat
from typing import Any

from ..changes import hunks as H
from ..changes.diff import is_binary, read_sides
from ..changes.fingerprint import combine, signatures
from ..changes.journal import list_applies
from ..changes.model import Change, Kind
from ..changes.risks import assess
from ..changes.scan import ChangeSet, scan
from ..errors import UsageError
from ..session.store import Session, living_holder

# a file larger than this is shown and decided whole (no hunks, no editor)
SHOW_LIMIT = 2 << 20


def _mode(m: int | None) -> str | None:
    return None if m is None else f"{stat.S_IMODE(m):o}"


def _marks(c: Change) -> list[str]:
    out = [str(c.kind)]
    if c.old_mode is not None and c.new_mode is not None and stat.S_IFMT(c.old_mode) == stat.S_IFMT(c.new_mode) \
            and stat.S_IMODE(c.old_mode) != stat.S_IMODE(c.new_mode):
        out.append("mode")
    if stat.S_ISLNK(c.old_mode or 0) or stat.S_ISLNK(c.new_mode or 0):
        out.append("symlink")
    if c.binary:
        out.append("binary")
    if c.is_dir:
        out.append("dir")
    return out


def risks_of(cs: ChangeSet) -> list[dict[str, Any]]:
    """The risk summary of the change set (``stockade diff --risks``'s), most severe first."""
    return [r.to_json() for r in assess(cs)]


def _run(r: dict[str, Any]) -> dict[str, Any]:
    argv = r.get("argv") or r.get("args") or []
    return {
        "run": r.get("run"),
        "kind": r.get("kind") or "run",
        "command": " ".join(map(str, argv)) if isinstance(argv, list) else str(argv),
        "exit": r.get("exit_status", r.get("exit_code")),
        "outcome": r.get("outcome") or r.get("status") or "",
        "started": r.get("started"),
        "ended": r.get("ended"),
        "duration": r.get("duration"),
        "status": r.get("status"),
    }


def state(session: Session) -> dict[str, Any]:
    """The whole page's data (the change set, runs, applies, risks) and its fingerprint."""
    cs = scan(session)
    sigs = signatures(cs)
    held = cs.held_back()
    parents = {"/".join(c.path.split("/")[:i]) for c in cs.changes for i in range(1, c.path.count("/") + 1)}
    changes = []
    for c in cs.changes:
        changes.append({
            "path": c.path, "kind": str(c.kind), "status": c.letter, "marks": _marks(c),
            "old_type": c.old_type, "new_type": c.new_type,
            "old_mode": _mode(c.old_mode), "new_mode": _mode(c.new_mode),
            "size": c.size, "binary": c.binary, "is_dir": c.is_dir, "has_children": c.path in parents,
            "reason": c.reason or None, "held_back": held.get(c.path), "sig": sigs[c.path],
        })
    counts = cs.counts()
    return {
        "session": session.id,
        "project": str(cs.project),
        "fingerprint": combine(sigs),
        "counts": {"added": counts.added, "modified": counts.modified, "deleted": counts.deleted,
                   "refused": counts.refused, "phrase": counts.phrase()},
        "living": living_holder(session.id) is not None,
        "changes": changes,
        "runs": [_run(r) for r in session.runs()],
        "applies": [{"id": a.id, "state": a.state, "paths": list(a.paths)} for a in list_applies(session.id)],
        "risks": risks_of(cs),
    }


def fingerprint_of(session: Session) -> str:
    return combine(signatures(scan(session, classify=False)))


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _utf8(b: bytes | None) -> str | None:
    if b is None:
        return None
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None


def file_view(session: Session, path: str) -> dict[str, Any]:
    """One change: its sides, hunks (numbered as ``hunks.merge`` takes them), whether its
    new content may be edited."""
    cs = scan(session)
    c = cs.get(path)
    if c is None:
        raise UsageError(f"no change at {path!r} in session {session.id} (applied, discarded or never made)")
    sig = signatures(type(cs)(cs.session, cs.project, (c,)))[c.path]
    out: dict[str, Any] = {"path": c.path, "kind": str(c.kind), "marks": _marks(c), "sig": sig,
                           "old_type": c.old_type, "new_type": c.new_type,
                           "old_mode": _mode(c.old_mode), "new_mode": _mode(c.new_mode),
                           "hunks": [], "too_large": False, "binary": False, "editable": False,
                           "new_text": None, "old_link": None, "new_link": None}
    if c.kind is Kind.REFUSED:
        return out
    old, new = read_sides(cs, c, SHOW_LIMIT)
    if stat.S_ISLNK(c.old_mode or 0) and old is not None:
        out["old_link"] = _text(old)
    if stat.S_ISLNK(c.new_mode or 0) and new is not None:
        out["new_link"] = _text(new)
    old_file = stat.S_ISREG(c.old_mode or 0)
    new_file = stat.S_ISREG(c.new_mode or 0)
    if (old_file and old is None) or (new_file and new is None):
        out["too_large"] = True
        return out
    if not (old_file or new_file):
        return out
    a = old if old_file and old is not None else b""
    b = new if new_file and new is not None else b""
    if is_binary(a) or is_binary(b):
        out["binary"] = True
        return out
    out["hunks"] = [{"index": h.index, "header": h.header, "old_start": h.old_start + 1,
                     "new_start": h.new_start + 1,
                     "lines": [[t, _text(line)] for t, line in h.lines]} for h in H.hunks(a, b)]
    # hunks are chosen one by one only where both sides are files; edits where the new one is
    out["hunk_choice"] = old_file and new_file and bool(out["hunks"])
    if new_file:
        text = _utf8(b)
        out["editable"] = text is not None
        out["new_text"] = text
    return out
