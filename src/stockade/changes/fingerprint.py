"""A change set's fingerprint: one string that moves whenever what a reviewer saw moves.

Made of each change's path, kind and modes, and the status (inode, size, mtime, ctime)
of its entry in the session's layers and of the project's entry: a sandbox that writes
again, a snapshot, an apply or discard, and an edit on the host each change it. Cheap
(stat calls, no content read), so a review page can poll it every second or two; an
apply given ``expect=`` compares it under the session lock (``apply.apply_changes``)."""

from __future__ import annotations

import hashlib

from ..session.idrange import with_sandbox_ids
from ._safefs import Root
from .model import Change, Changes


def _st(root: Root | None, rel: str) -> str:
    if root is None:
        return "-"
    try:
        st = root.lstat(rel)
    except OSError as e:
        return f"E{e.errno}"
    if st is None:
        return "-"
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_mode:o}"


def change_sig(c: Change, layer: Root | None, host: Root | None) -> str:
    """One change as the fingerprint sees it (also given per path to the review page)."""
    raw = f"{c.path}\0{c.kind}\0{c.old_mode}\0{c.new_mode}\0{c.size}\0{c.layer}\0" \
          f"{_st(layer, c.path)}\0{_st(host, c.path)}"
    return hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()[:16]


@with_sandbox_ids(retry=True)
def signatures(cs: Changes) -> dict[str, str]:
    """path -> its change's signature, for every change of ``cs``."""
    stack = cs.session.lower_stack()
    layers: dict[int, Root | None] = {}
    out: dict[str, str] = {}
    try:
        host: Root | None = Root(cs.project)
    except OSError:
        host = None
    try:
        for c in cs.changes:
            if c.layer not in layers:
                try:
                    layers[c.layer] = Root(stack[c.layer]) if 0 <= c.layer < len(stack) else None
                except OSError:
                    layers[c.layer] = None
            out[c.path] = change_sig(c, layers[c.layer], host)
    finally:
        for r in layers.values():
            if r is not None:
                r.close()
        if host is not None:
            host.close()
    return out


def combine(sigs: dict[str, str]) -> str:
    h = hashlib.sha256()
    for p in sorted(sigs):
        h.update(p.encode("utf-8", "surrogateescape") + b"\0" + sigs[p].encode() + b"\n")
    return h.hexdigest()[:32]


def fingerprint(cs: Changes) -> str:
    """The change set's fingerprint (see the module's doc)."""
    return combine(signatures(cs))
