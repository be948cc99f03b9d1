"""`stockade list status diff apply rollback discard clean export snapshot fork recover`: change sets."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..changes.scan import ChangeSet
    from ..session.store import Session
    from .table import Args


# ---- the line printed after every run ----------------------------------------------------


def summary_line(session: Session) -> str | None:
    """``stockade: session S — 3 added, 1 modified, 2 deleted; review: stockade diff S``."""
    from ..changes.scan import layer_has_entries, scan

    if not layer_has_entries(session):
        return None
    counts = scan(session, classify=False).counts()
    if counts.total == 0:
        return None
    return f"stockade: session {session.id} — {counts.phrase()}; review: stockade diff {session.id}"


# ---- helpers ----------------------------------------------------------------------------------


def _out(b: bytes | str) -> None:
    if isinstance(b, str):
        b = b.encode("utf-8", "surrogateescape")
    sys.stdout.buffer.write(b)
    sys.stdout.flush()


def _err(s: str) -> None:
    sys.stderr.write(s + "\n")


def _use_color(mode: str) -> bool:
    if mode == "always":
        return True
    if mode == "never":
        return False
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def _session_and_rest(args: Args, positional: list[str]) -> tuple[Session, list[str]]:
    """``[S] [REST...]``: the first word is a session when one has that name."""
    from ..errors import SessionNotFound, UsageError
    from ..session import store

    explicit = getattr(args, "session", None)
    if explicit:
        return store.resolve(explicit), positional
    if positional:
        first = positional[0]
        try:
            store.validate_name(first)
            return store.open_session(first), positional[1:]
        except (UsageError, SessionNotFound):
            pass
    try:
        latest = store.resolve(None)
    except SessionNotFound:
        if positional and store._NAME_RE.fullmatch(positional[0]):
            raise UsageError(f"unknown session {positional[0]!r}: there are no sessions yet; "
                             "start one with `stockade run -- CMD`") from None
        raise
    if positional and store._NAME_RE.fullmatch(positional[0]) and not _names_a_path(latest, positional[0]):
        # a session-like word that is no path either: say so, not "pathspec did not match"
        raise UsageError(f"unknown session {positional[0]!r} (nor a path in session {latest.id}); "
                         "list sessions with `stockade list`")
    return latest, positional


def _names_a_path(session: Session, word: str) -> bool:
    """Is ``word`` a top-level path of the project or of one of the session's layers?"""
    try:
        dirs = [session.project, *session.lower_stack()]
    except Exception:  # a broken meta.json: let the caller report it
        return True
    return any(os.path.lexists(os.path.join(d, word)) for d in dirs)


def _changes(session: Session, classify: bool = True) -> ChangeSet:
    from ..changes.scan import scan

    return scan(session, classify=classify)


def terminal_safe(s: str) -> str:
    """What the sandbox wrote (a symlink's target, a held-back reason), escaped for the
    terminal (``redact.terminal_safe``, imported on use: the CLI starts light)."""
    from ..redact import terminal_safe as safe

    return safe(s)


def _quote(path: str) -> str:
    from ..changes.diff import quote_path

    return quote_path(b"", os.fsencode(path)).decode("utf-8", "backslashreplace")


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


# ---- handlers ----------------------------------------------------------------------------------


def cmd_list(args: Args) -> int:
    from ..changes.retention import disk_usage
    from ..errors import StockadeError
    from ..session import store
    from ..session.idrange import with_sandbox_ids

    du = with_sandbox_ids()(disk_usage)  # a sandbox's other ids' directories count too
    rows: list[dict[str, Any]] = []
    now = time.time()
    for s in store.list_sessions():
        try:
            meta = s.meta()
            counts = _changes(s, classify=False).counts()
            c: dict[str, Any] = {"added": counts.added, "modified": counts.modified,
                                 "deleted": counts.deleted}
        except StockadeError as e:
            try:
                meta, c = s.meta() if s.meta_path.exists() else {}, {"error": e.one_line()}
            except (OSError, ValueError, StockadeError) as e2:
                meta, c = {}, {"error": str(e2)}
        except (OSError, ValueError) as e:  # an unreadable meta.json: one row says so
            meta, c = {}, {"error": str(e)}
        if not isinstance(meta, dict):
            meta, c = {}, {"error": "meta.json is not a session's record"}
        try:
            runs = len(s.runs())
        except OSError:  # a directory of another owner's
            runs = 0
        rows.append({
            "session": s.id,
            "project": meta.get("project"),
            # (None: an unreadable record says no creation time)
            "age_s": round(now - created / 1e9, 1) if isinstance(created := meta.get("created_ns"), int) else None,
            "runs": runs,
            "changes": c,
            "disk_bytes": du(str(s.dir)),
        })
    if args.json:
        _out(json.dumps(rows, indent=1) + "\n")
        return 0
    if not rows:
        _err("stockade: no sessions")
        return 0
    _out(f"{'SESSION':<16} {'AGE':>5} {'RUNS':>4} {'CHANGES':<14} {'DISK':>7}  PROJECT\n")
    for r in rows:
        c = r["changes"]
        ch = "error" if "error" in c else f"+{c['added']} ~{c['modified']} -{c['deleted']}"
        age = _age(r["age_s"]) if r["age_s"] is not None else "?"
        _out(f"{r['session']:<16} {age:>5} {r['runs']:>4} {ch:<14} {_human(r['disk_bytes']):>7}  {r['project']}\n")
    return 0


def cmd_status(args: Args) -> int:
    from ..changes.journal import list_applies

    if not (args.args or args.session or args.latest or args.name_status):
        return _status_list(args)
    if args.latest and (args.args or args.session):
        from ..errors import UsageError

        # a path filter stays allowed: `status --latest src/`
        if args.session or _is_session(args.args[0]):
            raise UsageError("give a session or --latest, not both")
    session, rest = _session_and_rest(args, args.args)
    cs = _changes(session)
    changes = cs.select(rest or None)
    runs = session.runs()
    applies = list_applies(session.id)
    if args.json:
        data = cs.to_json()
        data["changes"] = cs.changes_json(changes)
        data["risks"] = [r.to_json() for r in cs.risks(rest or None)]
        data["runs"] = runs
        data["applies"] = [{"id": a.id, "state": a.state, "paths": len(a.paths)} for a in applies]
        from ..live.status import living_status

        living = living_status(session.id)
        if living is not None:  # its living sandbox (stockade start): the provider status schema on top
            res = living.get("resources") or {"memory_used": "0", "memory_used_bytes": 0, "cpu_percent": 0.0,
                                              "pids": [], "processes": 0}
            data.update({"id": living.get("id"), "provider": "stockade", "status": living.get("status"),
                         "started_at": living.get("started_at"), "resources": res, "pids": res.get("pids", []),
                         "idle_timeout": living.get("idle_timeout"), "change_summary": cs.counts().phrase()})
            data["sandbox"] = living
        _out(json.dumps(data, indent=1, default=str) + "\n")
        return 0
    if args.name_status:
        for c in changes:
            _out(f"{c.letter}\t{_quote(c.path)}\n")
        return 0
    _out(f"session {session.id}  project {cs.project}\n")
    from ..live.status import living_status

    living = living_status(session.id)
    if living is not None:
        res = living.get("resources") or {}
        _out(f"sandbox: {living.get('status')} since {living.get('started_at')}"
             + (f", {res.get('processes')} processes, {res.get('memory_used')} memory" if res else "")
             + (f" ({terminal_safe(str(living.get('reason')))})"
                if living.get("reason") and living.get("status") != "running" else "")
             + "\n")
    if runs:
        _out("runs:\n")
        for r in runs:
            argv = r.get("argv") or r.get("args") or []
            cmd = " ".join(argv) if isinstance(argv, list) else str(argv)
            status = r.get("outcome") or r.get("status") or ""
            code = r.get("exit_status", r.get("returncode", ""))
            _out(f"  {r.get('run', '?'):>3}  exit {code!s:<4} {status:<20} {terminal_safe(cmd)}\n")
    if changes:
        _out(f"changes ({cs.counts().phrase()}):\n")
        held = cs.held_back(changes)
        for c in changes:
            extra = f"  ({c.reason})" if c.reason else ""
            if c.kind.value == "typechange":
                extra = f"  ({c.old_type} -> {c.new_type})"
            elif c.is_dir:
                extra = extra or "  (directory)"
            if c.owner is not None:
                extra += f"  (owner inside {c.owner[0]}:{c.owner[1]})"
            if c.path in held:
                extra += f"  (held back: {held[c.path]})"
            _out(f"  {c.letter} {_quote(c.path)}{terminal_safe(extra)}\n")
        if held:
            _out(f"held back from `stockade apply` unless named: {len(held)} path(s)\n")
    else:
        _out("no changes\n")
    if applies:
        _out("applies:\n")
        for a in applies:
            _out(f"  {a.id}  {a.state:<12} {len(a.paths)} paths\n")
    return 0


def _is_session(word: str) -> bool:
    from ..session import store

    return bool(store._NAME_RE.fullmatch(word)) and (store.sessions_dir() / word / "meta.json").is_file()


def _status_list(args: Args) -> int:
    """`stockade status`: every session with its age (since last use), size and state."""
    from ..changes.retention import list_infos

    infos = list_infos()
    if args.json:
        _out(json.dumps([i.to_json() for i in infos], indent=1) + "\n")
        return 0
    if not infos:
        _err("stockade: no sessions; start one with `stockade run -- CMD`")
        return 0
    _out(f"{'SESSION':<16} {'AGE':>5} {'SIZE':>7} {'STATE':<12} {'RUNS':>4} {'CHANGES':<14} PROJECT\n")
    for i in infos:
        c = i.changes
        ch = f"+{c['added']} ~{c['modified']} -{c['deleted']}" if c else "-"
        _out(f"{i.id:<16} {_age(i.age_s):>5} {_human(i.size or 0):>7} {i.state:<12} {i.runs:>4} {ch:<14} "
             f"{i.project}\n")
    for i in infos:
        if i.reason:
            _err(f"stockade: {i.id}: {i.reason}")
    _err("stockade: one session's changes and runs: stockade status S (or --latest)")
    return 0


def cmd_diff(args: Args) -> int:
    session, rest = _session_and_rest(args, args.args)
    if args.risks:
        return _diff_risks(args, session, rest)
    cs = _changes(session)
    sel = cs.select(rest or None)
    if args.json:
        _out(json.dumps({"session": session.id, "changes": cs.changes_json(sel)}, indent=1) + "\n")
        return 0
    if args.stat:
        from ..changes.diff import render_stat

        _out(render_stat(cs, sel))
    else:
        from ..changes.diff import render_diff

        _out(render_diff(cs, sel, color=_use_color(args.color)))
    # on stderr: the patch on stdout stays one `git apply` accepts
    _say_owners(sel)
    _say_held(session.id, cs.held_back(sel), "`stockade apply` holds back")
    return 0


def _diff_risks(args: Args, session: Session, rest: list[str]) -> int:
    """`diff --risks`: the risk summary (changes/risks.py) instead of the patch."""
    from ..changes.model import count
    from ..changes.risks import counts, format_risks, summary
    from ..errors import UsageError

    if args.stat:
        raise UsageError("--risks and --stat are two different reports: give one of them")
    cs = _changes(session)
    risks = cs.risks(rest or None)
    n = count(cs.select(rest or None)).total
    if args.json:
        _out(json.dumps({"session": session.id, "changes": n, "counts": counts(risks),
                         "risks": [r.to_json() for r in risks]}, indent=1) + "\n")
        return 0
    if not n:
        _err(f"stockade: no changes in session {session.id}: nothing to assess")
        return 0
    _out(format_risks(risks))
    _err(f"stockade: session {session.id}: {summary(risks)} in {n} change(s)"
         + (f"; review: stockade diff {session.id} PATH" if risks else ""))
    return 0


def _say_owners(changes: tuple[Any, ...]) -> None:
    """Paths the sandbox gave to another id than its user's (a patch has no owners)."""
    owned = [c for c in changes if c.owner is not None]
    if not owned:
        return
    _err(f"stockade: {len(owned)} path(s) owned inside by another id than the sandbox user "
         "(uid:gid inside; apply does not carry it over):")
    for c in owned:
        _err(f"  {_quote(c.path)}: {c.owner[0]}:{c.owner[1]}")


def _say_held(sid: str, held: dict[str, str], lead: str) -> None:
    """Each held-back path and why, on stderr (review output; the patch or JSON stays clean)."""
    if not held:
        return
    _err(f"stockade: {lead} {len(held)} path(s) unless named explicitly "
         f"(stockade apply {sid} PATH):")
    for p, why in held.items():
        _err(f"  {_quote(p)}: {terminal_safe(why)}")


def _interactive(cs: ChangeSet, paths: list[str] | None, exclude: list[str] | None) -> list[Any] | None:
    from ..changes.diff import render_diff

    chosen = []
    todo = [c for c in cs.select(paths, exclude) if c.kind.value != "refused"]
    all_rest = False
    held = cs.held_back(todo)
    for i, c in enumerate(todo):
        if all_rest and c.path not in held:  # "all the rest" never takes a held-back path
            chosen.append(c)
            continue
        while True:
            note = f" (held back: {terminal_safe(held[c.path])})" if c.path in held else ""
            sys.stderr.write(f"({i + 1}/{len(todo)}) apply {c.kind.value} {_quote(c.path)}{note} [y,n,d,a,q,?]? ")
            sys.stderr.flush()
            ans = sys.stdin.readline()
            if not ans:
                ans = "q"
            ans = ans.strip().lower()[:1]
            if ans == "y":
                chosen.append(c)
                break
            if ans == "n":
                break
            if ans == "a":
                chosen.append(c)
                all_rest = True
                break
            if ans == "q":
                return chosen
            if ans == "d":
                _out(render_diff(cs, [c], color=_use_color("auto")) or b"(no textual diff: directory)\n")
                continue
            sys.stderr.write("y - apply this path\nn - skip it\nd - show its diff\na - apply this and all the rest\nq - stop; apply what was chosen\n")
    return chosen


def cmd_apply(args: Args) -> int:
    from ..changes.apply import apply_changes
    from ..errors import UsageError

    session, rest = _session_and_rest(args, args.args)
    cs = _changes(session)
    only = None
    if args.interactive:
        only = _interactive(cs, rest or None, args.exclude or None)
        if not only:
            raise UsageError("nothing chosen to apply")
    res = apply_changes(cs, paths=rest or None, exclude=args.exclude or None, force=args.force,
                        dry_run=args.dry_run, only=only, include_git=args.include_git)
    if args.json:
        _out(json.dumps(res.to_json(), indent=1) + "\n")
    elif res.dry_run:
        for op in res.operations:
            _out(f"would {op}\n")
        _err(f"stockade: dry run: {len(res.applied)} path(s) would be applied; nothing changed")
    else:
        _err(f"stockade: applied {len(res.applied)} path(s) from session {session.id} "
             f"(apply {res.apply_id}); undo with: stockade rollback {res.apply_id}")
    _say_held(session.id, res.why_held, "would hold back" if res.dry_run else "held back")
    if res.owner_not_kept and not args.json:
        _err(f"stockade: ownership inside was not carried over for {res.owner_not_kept} path(s): "
             f"{'they would be' if res.dry_run else 'they are'} owned in the project like every applied "
             "path (see `stockade status` for their owners inside)")
    if res.refused:
        _err(f"stockade: refused {len(res.refused)} path(s) (fifos, sockets, devices, masked secrets): "
             f"{', '.join(_quote(p) for p in res.refused)}")
    return 0


def cmd_rollback(args: Args) -> int:
    from ..changes.rollback import rollback
    from ..session import store

    rec = rollback(args.apply_id, force=args.force)
    if rec.back_in_session:
        where = f"the changes are back in session {rec.session}"
    else:  # collected since (README: How long sessions stay): the project is restored all the same
        other = " (the session of that name now is a later one)" if (store.sessions_dir() / rec.session).is_dir() else ""
        where = f"session {rec.session} was removed since{other}, so the changes are not kept anywhere"
    _err(f"stockade: rolled back apply {rec.id} ({len(rec.paths)} path(s)); {where}")
    return 0


def cmd_discard(args: Args) -> int:
    session, rest = _session_and_rest(args, args.args)
    cs = _changes(session, classify=False)
    if not cs.changes:
        from ..errors import UsageError

        raise UsageError(f"nothing to discard in session {session.id}")
    dropped = cs.discard(rest or None)
    _err(f"stockade: discarded {len(dropped)} change(s) from session {session.id}")
    return 0


def cmd_clean(args: Args) -> int:
    """`clean [S]`, `clean --all`, `clean --older-than AGE [--include-unapplied]`; `--dry-run`.
    A session in use is never removed: `S` is an error then, the others report it skipped."""
    from ..changes import retention
    from ..errors import SessionBusy, StockadeError, UsageError
    from ..session import store

    older = args.older_than
    given = [m for m, on in (("SESSION", args.session_name), ("--all", args.all),
                             ("--older-than", older is not None)) if on]
    if len(given) > 1:
        raise UsageError(f"give one of SESSION, --all or --older-than AGE, not {' and '.join(given)}")
    if args.include_unapplied and older is None:
        raise UsageError("--include-unapplied goes with --older-than AGE (SESSION and --all remove "
                         "unapplied changes anyway)")
    if older is not None:
        outs = retention.clean(retention.parse_age(older), include_unapplied=args.include_unapplied,
                               dry_run=args.dry_run)
    elif args.all:
        outs = retention.clean(None, include_unapplied=True, dry_run=args.dry_run)
    else:
        # with no name, the latest session of the project here: never another project's
        # (its unapplied changes go with it), however recently that one was used
        s = (store.resolve(args.session_name) if args.session_name
             else store.latest_session(around=Path(os.path.realpath(os.getcwd()))))
        o = retention.remove(s, include_unapplied=True, dry_run=args.dry_run)
        if o.action == "skipped" and o.state in ("running", "idle", "locked"):
            then = "" if o.state == "idle" else f"; retry when it has ended (`stockade status {s.id}` lists its runs)"
            raise SessionBusy(f"session {s.id!r} was not removed: {o.reason}{then}")
        if o.action == "skipped":
            raise StockadeError(f"session {s.id!r} was not removed: {o.reason}")
        outs = [o]
    done = [o.id for o in outs if o.action in ("removed", "would-remove")]
    skipped = [o for o in outs if o.action == "skipped"]
    if args.json:
        _out(json.dumps({"dry_run": args.dry_run, "removed": [] if args.dry_run else done,
                         "would_remove": done if args.dry_run else [],
                         "skipped": [o.to_json() for o in skipped]}, indent=1) + "\n")
    else:
        for o in skipped:
            _err(f"stockade: kept {o.id} ({o.state}): {o.reason}")
        verb = "would remove" if args.dry_run else "removed"
        _err(f"stockade: {verb} {len(done)} session(s)" + (f": {', '.join(done)}" if done else "")
             + ("; nothing removed (dry run)" if args.dry_run else ""))
    return 1 if args.all and skipped else 0


def _session_and_one(args: Args, usage: str) -> tuple[Any, str]:
    """`[SESSION] ARG`: the session (named, or the latest) and the one argument."""
    from ..errors import UsageError

    if len(args.args) == 2:
        session, rest = _session_and_rest(args, args.args[:1])
        if rest:
            raise UsageError(f"no session named {args.args[0]!r}")
        return session, str(args.args[1])
    if len(args.args) == 1:
        session, _ = _session_and_rest(args, [])
        return session, str(args.args[0])
    raise UsageError(f"usage: {usage}")


def cmd_export(args: Args) -> int:
    from ..changes.export import export
    from ..session import store

    session, dest = _session_and_one(args, "stockade export [SESSION] DIR")
    with store.disk_space(f"export session {session.id}", dest,
                          f"free space on {store.mount_point(dest)}, remove {dest} and export again"):
        status = export(_changes(session), dest)
    _err(f"stockade: exported session {session.id} ({len(status['changes'])} change(s)) to {dest}")
    return 0


def cmd_snapshot(args: Args) -> int:
    from ..changes import snapshot
    from ..errors import UsageError
    from ..session import store

    session = store.resolve(args.session)
    if args.action == "list":
        snaps = snapshot.list_snapshots(session)
        if args.json:
            _out(json.dumps([{"name": s.name, "index": s.index, "created": s.created} for s in snaps],
                            indent=1) + "\n")
            return 0
        for s in snaps:
            _out(f"{s.index:>3}  {s.name:<24} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.created))}\n")
        if not snaps:
            _err(f"stockade: session {session.id} has no snapshots")
        return 0
    if not args.name:
        raise UsageError(f"snapshot {args.action} needs a NAME")
    if args.action == "create":
        t0 = time.perf_counter()
        snap = snapshot.create(session, args.name)
        ms = (time.perf_counter() - t0) * 1000
        _err(f"stockade: snapshot {snap.name} of session {session.id} created ({ms:.1f} ms)")
    elif args.action == "restore":
        dropped = snapshot.restore(session, args.name)
        _err(f"stockade: session {session.id} restored to snapshot {args.name}"
             + (f" (dropped {', '.join(dropped)})" if dropped else ""))
    elif args.action == "delete":
        snapshot.delete(session, args.name)
        _err(f"stockade: snapshot {args.name} deleted (its changes stay in session {session.id})")
    return 0


def cmd_fork(args: Args) -> int:
    from ..changes import snapshot

    session, new = _session_and_one(args, "stockade fork [SESSION] NEW")
    s = snapshot.fork(session, new)
    _err(f"stockade: session {s.id} forked from {session.id}")
    return 0


def cmd_recover(args: Args) -> int:
    from ..changes.recovery import recover_pending

    msgs = recover_pending()
    for m in msgs:
        _err(f"stockade: {m}")
    if not msgs:
        _err("stockade: nothing to recover")
    return 0
