"""``stockade export``: a standard bundle for CI artifacts.

``DIR/status.json``   session, project, runs (with exit status), change list, counts, risks
``DIR/risks.json``    the risk summary (:mod:`.risks`): counts by severity and each risk
``DIR/events.jsonl``  the session's audit stream
``DIR/stdout.log``    every run's stdout, in order (``runs/N/stdout.log`` per run too)
``DIR/stderr.log``    likewise
``DIR/changes.patch`` the git-style diff (``git apply`` accepts it)
``DIR/files/``        the changed files' new content (symlinks as symlinks)
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..session.idrange import with_sandbox_ids
from ._safefs import Root, copy_to_new
from .model import Kind
from .risks import counts as risk_counts
from .scan import ChangeSet


def _copy_logs(cs: ChangeSet, out: Path) -> None:
    runs_dir = cs.session.runs_dir
    try:
        names = sorted((n for n in os.listdir(runs_dir) if n.isdigit()), key=int)
    except FileNotFoundError:
        names = []
    for stream in ("stdout", "stderr"):
        with open(out / f"{stream}.log", "wb") as agg:
            for n in names:
                src = runs_dir / n / f"{stream}.log"
                if not src.is_file():
                    continue
                (out / "runs" / n).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, out / "runs" / n / f"{stream}.log")
                with open(src, "rb") as f:
                    shutil.copyfileobj(f, agg)


@with_sandbox_ids()
def export(cs: ChangeSet, dest: str | os.PathLike[str]) -> dict[str, Any]:
    out = Path(dest)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"export directory {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    session = cs.session
    status: dict[str, Any] = {
        "schema_version": 1,
        "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "session": session.id,
        "meta": session.meta(),
        "runs": session.runs(),
        **{k: v for k, v in cs.to_json().items() if k in ("counts", "changes")},
    }
    risks = cs.risks()
    status["risks"] = [r.to_json() for r in risks]
    with open(out / "status.json", "w", encoding="utf-8") as f:
        json.dump(status, f, indent=1, sort_keys=True, default=str)
        f.write("\n")
    with open(out / "risks.json", "w", encoding="utf-8") as f:
        json.dump({"schema_version": 1, "session": session.id, "counts": risk_counts(risks),
                   "risks": status["risks"]}, f, indent=1)
        f.write("\n")
    if session.events_path.is_file():
        shutil.copyfile(session.events_path, out / "events.jsonl")
    else:
        (out / "events.jsonl").write_bytes(b"")
    _copy_logs(cs, out)
    (out / "changes.patch").write_bytes(cs.diff_bytes())
    files = out / "files"
    files.mkdir()
    stack = session.lower_stack()
    with Root(files) as dst:
        for c in cs.changes:
            if c.kind in (Kind.DELETED, Kind.REFUSED) or c.new_mode is None:
                continue
            parts = c.path.split("/")
            for i in range(1, len(parts)):
                sub = "/".join(parts[:i])
                if dst.lstat(sub) is None:
                    pfd, name = dst.parent(sub)
                    os.mkdir(name, 0o755, dir_fd=pfd)
            pfd, name = dst.parent(c.path)
            if stat.S_ISDIR(c.new_mode):
                if dst.lstat(c.path) is None:
                    os.mkdir(name, 0o755, dir_fd=pfd)
                continue
            with Root(stack[c.layer]) as src:
                if stat.S_ISLNK(c.new_mode):
                    os.symlink(src.readlink(c.path), name, dir_fd=pfd)
                    continue
                sfd = src.open_read(c.path)
                try:
                    copy_to_new(sfd, name, pfd, stat.S_IMODE(c.new_mode) & 0o777)
                finally:
                    os.close(sfd)
    return status
