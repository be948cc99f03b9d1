"""A reviewer's decisions, carried out through the CLI's own engines: ``apply_changes`` (journal,
conflicts, rollback) for what was approved, ``discard_changes`` for what was rejected.

The decisions (the page's POST body)::

    {"fingerprint": "<what the page showed>", "force": false,
     "files": {"PATH": {"decision": "approve" | "reject",
                        "hunks": [0, 2],        # optional: the hunks taken, the others rejected
                        "content": "text"}}}    # optional: the reviewer's edit of the new content

* approve: the path is applied. With ``content`` those bytes are written (UTF-8) instead of
  the session's; with ``hunks`` the old file plus the taken hunks (``hunks.merge``). Either
  way the path leaves the session, as with a plain apply: the hunks not taken are dropped
  with it (rejecting a hunk discards it). ``rollback`` puts back the project's old file and
  the session's whole version.
* reject: the path is discarded from the session (the project is untouched).
* a path with no decision stays in the session, as it was, for later.

Nothing happens unless the change set is still the one the page showed (its
fingerprint, compared again under the session lock by the apply): else
:class:`StaleChangeSet`. The apply runs before the discard, so a refused apply (a stale
page, a conflict, a busy session) discards nothing either."""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from typing import Any

from ..changes import hunks as H
from ..changes.apply import ApplyResult, StaleChangeSet, apply_changes
from ..changes.diff import read_sides
from ..changes.discard import discard_changes
from ..changes.fingerprint import combine, signatures
from ..changes.model import Change, Kind
from ..changes.scan import ChangeSet, scan
from ..errors import StockadeError, UsageError
from ..session.store import Session
from .data import SHOW_LIMIT


@dataclass
class Plan:
    approve: list[Change] = field(default_factory=list)
    reject: list[Change] = field(default_factory=list)
    contents: dict[str, bytes] = field(default_factory=dict)
    partial: dict[str, list[int]] = field(default_factory=dict)  # path -> hunks taken
    edited: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    apply: ApplyResult | None
    discarded: list[str]
    partial: dict[str, list[int]]
    edited: list[str]
    discard_error: str | None = None  # the apply went through, the discard after it did not

    def to_json(self) -> dict[str, Any]:
        return {
            "apply": None if self.apply is None else self.apply.to_json(),
            "applied": [] if self.apply is None else list(self.apply.applied),
            "apply_id": None if self.apply is None else self.apply.apply_id,
            "discarded": self.discarded,
            "partial": self.partial,
            "edited": self.edited,
            "discard_error": self.discard_error,
        }


def _bad(msg: str) -> UsageError:
    return UsageError(msg)


def plan(cs: ChangeSet, files: dict[str, Any]) -> Plan:
    """The decisions checked against the change set and turned into engine calls."""
    if not isinstance(files, dict) or not files:
        raise _bad("nothing decided: approve or reject at least one path")
    p = Plan()
    for path, d in files.items():
        if not isinstance(d, dict):
            raise _bad(f"decision for {path!r}: expected an object")
        c = cs.get(path)
        if c is None:
            raise _bad(f"no change at {path!r} in session {cs.session.id}")
        what = d.get("decision")
        if what == "reject":
            p.reject.append(c)
            continue
        if what != "approve":
            raise _bad(f"decision for {path!r}: expected 'approve' or 'reject', got {what!r}")
        if c.kind is Kind.REFUSED:
            raise _bad(f"{path} cannot be applied ({c.reason or 'a fifo, socket or device'}); reject it")
        content, take = d.get("content"), d.get("hunks")
        if content is not None:
            if not isinstance(content, str):
                raise _bad(f"edited content of {path!r}: expected text")
            if not stat.S_ISREG(c.new_mode or 0):
                raise _bad(f"{path} is {c.new_type} in the session: only a file's content can be edited")
            try:
                p.contents[path] = content.encode("utf-8")
            except UnicodeEncodeError as e:
                raise _bad(f"edited content of {path!r} is not valid text ({e.reason})") from None
            p.edited.append(path)
            p.approve.append(c)
            continue
        if take is not None:
            if not (isinstance(take, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in take)):
                raise _bad(f"hunks of {path!r}: expected a list of hunk numbers")
            if not (stat.S_ISREG(c.old_mode or 0) and stat.S_ISREG(c.new_mode or 0)):
                raise _bad(f"{path} is {c.kind} ({c.old_type} -> {c.new_type}): hunks are chosen only in a "
                           "modified file; approve or reject it whole")
            old, new = read_sides(cs, c, SHOW_LIMIT)  # (hunks are shown, and chosen, up to it)
            if old is None or new is None:
                raise _bad(f"hunks of {path}: it is larger than the page shows ({SHOW_LIMIT >> 20} MiB); "
                           "approve or reject it whole")
            count = len(H.hunks(old, new))
            bad = [t for t in take if not 0 <= t < count]
            if bad:  # the fingerprint matched: the file is the one the page showed
                raise _bad(f"hunks of {path}: no hunk {bad[0]} (it has {count}, numbered from 0)")
            chosen = sorted(set(take))
            if not chosen:
                p.reject.append(c)  # every hunk rejected: the file is
                continue
            if len(chosen) < count:
                p.contents[path] = H.merge(old, new, chosen)
                p.partial[path] = chosen
            p.approve.append(c)
            continue
        p.approve.append(c)
    _roll_up_dirs(cs, p)
    return p


def _roll_up_dirs(cs: ChangeSet, p: Plan) -> None:
    """A directory change with changes below it follows them: approved when all of them
    are (a deleted directory goes once everything in it goes), rejected when all are."""
    decided = {c.path for c in p.approve} | {c.path for c in p.reject}
    approved = {c.path for c in p.approve}
    rejected = {c.path for c in p.reject}
    for d in sorted((c for c in cs.changes if c.new_mode is None or stat.S_ISDIR(c.new_mode)),
                    key=lambda c: -c.path.count("/")):
        if d.path in decided or not d.is_dir:
            continue
        below = [c.path for c in cs.changes if c.path.startswith(d.path + "/")]
        if not below:
            continue
        if all(b in approved for b in below):
            p.approve.append(d)
            approved.add(d.path)
        elif all(b in rejected for b in below):
            p.reject.append(d)
            rejected.add(d.path)


def carry_out(session: Session, decisions: dict[str, Any]) -> Outcome:
    """Apply what was approved, then discard what was rejected (see the module's doc)."""
    expect = decisions.get("fingerprint")
    if not isinstance(expect, str) or not expect:
        raise _bad("the request has no change-set fingerprint: reload the page")
    force = decisions.get("force", False) is True
    cs = scan(session)
    seen = signatures(cs)
    if combine(seen) != expect:
        raise StaleChangeSet(f"session {session.id}'s change set changed since the page showed it; "
                             "nothing was applied or discarded: review it again")
    p = plan(cs, decisions.get("files") or {})
    res = None
    if p.approve:
        res = apply_changes(cs, only=p.approve, contents=p.contents, expect=expect, force=force)
    dropped: list[str] = []
    if p.reject:
        try:
            fresh = scan(session, classify=False)
            still = [c for c in (fresh.get(r.path) for r in p.reject) if c is not None]
            # only what is still what the page showed (a run since the apply's lock may have written)
            now = signatures(type(fresh)(fresh.session, fresh.project, tuple(still)))
            moved = sorted(c.path for c in still if now[c.path] != seen.get(c.path))
            if moved and res is None:
                raise StaleChangeSet(f"{', '.join(moved[:5])} changed since the page showed it; nothing was "
                                     "discarded: review it again")
            # and a directory goes only with everything below it
            still = [c for c in still if c.path not in moved and not any(m.startswith(c.path + "/") for m in moved)]
            if still:
                dropped = discard_changes(fresh, only=still)
            if moved:
                return Outcome(res, dropped, p.partial, p.edited,
                               f"not discarded: {', '.join(moved[:5])} changed since the page showed it")
        except StockadeError as e:
            if res is None:
                raise
            # what was applied stays applied (and is reported): the rejected paths stay in the session
            return Outcome(res, [], p.partial, p.edited, f"not discarded: {e.one_line()}")
    return Outcome(res, dropped, p.partial, p.edited)
