"""`stockade policy show/why/env`, `allow`, `deny`: the effective policy and session rules."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    from ..policy import CliPolicy, Effective
    from .table import Args


# --------------------------------------------------------------------------- helpers


def cli_policy_from_args(args: Args) -> CliPolicy:
    from ..policy import CliPolicy
    from .run import policy_fields

    return CliPolicy(**policy_fields(args))


def _project(args: Args) -> Path:
    raw = getattr(args, "project", None) or os.getcwd()
    p = Path(os.path.realpath(raw))
    if not p.is_dir():
        raise UsageError(f"project {raw!r} is not a directory; pass --project DIR")
    if p == Path("/"):
        raise UsageError("the project cannot be / ; pass --project DIR")
    return p


def _session_dir(args: Args, project: Path, *, create: bool = False) -> tuple[Path | None, str | None]:
    from ..errors import SessionNotFound
    from ..session import store

    name = getattr(args, "session", None)
    if name:
        try:
            s = store.open_session(name)
        except SessionNotFound:
            if not create:
                raise
            # a typo must not make a session: rules go to one that exists
            raise UsageError(
                f"no session named {name!r}; list them with `stockade list`, or start it with "
                f"`stockade run --session {name} -- CMD`"
            ) from None
        if create and s.project != project:
            raise UsageError(f"session {name!r} belongs to project {s.project}, not {project}; pass --project {s.project}")
        return s.dir, s.id
    try:
        s = store.latest_session(project)
    except SessionNotFound:
        if create:
            raise UsageError(
                f"no session for {project} yet; name one with --session S (it is created and used by "
                "`stockade run --session S`)"
            ) from None
        return None, None
    return s.dir, s.id


def _load(args: Args) -> tuple[Effective, str | None]:
    from ..policy import load

    project = _project(args)
    sdir, sid = _session_dir(args, project)
    eff = load(project, sdir, cli_policy_from_args(args), strict=False)
    return eff, sid


def _warn(eff: Effective) -> None:
    for w in eff.warnings:
        print(f"stockade: warning: {w}", file=sys.stderr)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _where(o: Any) -> str:
    if o.file is None:
        return ""
    return o.file if o.line is None else f"{o.file}:{o.line}"


# --------------------------------------------------------------------------- handlers


def cmd_policy_show(args: Args) -> int:
    eff, sid = _load(args)
    if args.json:
        doc = eff.to_json()
        doc["session"] = sid
        print(json.dumps(doc, indent=1))
        _warn(eff)
        return 0
    print(f"project  {eff.project}")
    print(f"session  {sid or '(none: global, workspace and CLI layers only)'}")
    print(f"digest   {eff.digest[:16]}")
    for name, f in eff.files:
        print(f"layer    {name:<9} {f}")
    print(f"read-only {'yes' if eff.read_only else 'no'}   masked files read as {eff.mask_mode}")
    print()
    rows = []
    for r in eff.rules():
        status = "" if r.active else "overridden"
        rows.append([r.kind, r.action, r.target, r.origin.layer, _where(r.origin), status or r.note])
    print(_table(rows, ["KIND", "ACTION", "TARGET", "SOURCE", "WHERE", "NOTE"]))
    _warn(eff)
    return 0


def cmd_policy_why(args: Args) -> int:
    eff, _ = _load(args)
    d = eff.why(Path(args.path))
    if args.json:
        print(json.dumps(d.to_json(), indent=1))
    else:
        print(f"{d.path}: {d.access.upper()} (layer: {d.source})")
        print(f"  {d.reason}")
        if d.rule is not None:
            where = _where(d.rule.origin)
            print(f"  rule: {d.rule.kind} {d.rule.action} {d.rule.target}  [{d.rule.origin.layer}{' ' + where if where else ''}]")
        for r in d.overridden:
            where = _where(r.origin)
            print(f"  overridden: {r.kind} {r.action} {r.target}  [{r.origin.layer}{' ' + where if where else ''}]")
    _warn(eff)
    return 0


def cmd_policy_env(args: Args) -> int:
    eff, _ = _load(args)
    flt = eff.env_filter()
    cli_env = dict(eff.cli.env)
    rows: list[dict[str, Any]] = []
    for name in sorted(os.environ):
        if name in cli_env:
            rows.append({"name": name, "passed": True, "reason": "--env on the command line"})
            continue
        dec = flt.decide(name, os.environ[name])
        rows.append({"name": name, "passed": dec.passed, "reason": dec.reason})
    for name in sorted(set(cli_env) - set(os.environ)):
        rows.append({"name": name, "passed": True, "reason": "--env on the command line"})
    # a passed variable naming a host path the sandbox hides (the run summary warns too)
    from ..policy import sandbox_sees
    from ..policy.env import hidden_refs
    from ..policy.rules import is_under

    values = {**os.environ, **cli_env}
    hidden = dict(hidden_refs({r["name"]: values[r["name"]] for r in rows if r["passed"]},
                              lambda p: any(is_under(p, str(t)) for t in eff.visible_trees()) or sandbox_sees(p, eff.etc_extra)))
    for r in rows:
        if r["name"] in hidden:
            r["hidden_path"] = hidden[r["name"]]
            r["reason"] += f"; points at {hidden[r['name']]}, hidden inside the sandbox"
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(_table([[r["name"], "pass" if r["passed"] else "REMOVED", r["reason"]] for r in rows],
                     ["NAME", "RESULT", "WHY"]))
    _warn(eff)
    return 0


def _edit_session(args: Args, access: str | None) -> int:
    from ..policy import config, deny_refusal
    from ..policy.rules import is_under

    project = _project(args)
    raw = os.path.expanduser(args.path)
    path = os.path.realpath(raw if os.path.isabs(raw) else os.path.join(os.getcwd(), raw))
    # one outcome, decided before anything is written: a rule that cannot take effect is refused
    if access in ("ro", "rw") and not is_under(path, str(project)) and not os.path.lexists(path):
        raise UsageError(f"allow {path}: no such file or directory; nothing was allowed (create it first, or fix the path)")
    why_not = deny_refusal(path) if access == "deny" else None
    if why_not is not None:
        raise UsageError(f"deny {why_not}")
    sdir, sid = _session_dir(args, project, create=True)
    assert sdir is not None and sid is not None
    ppath = config.session_policy_path(sdir)
    src = config.read_json("session", ppath)  # validates: a broken file is reported, not overwritten
    data: dict[str, Any] = dict(src.data) if src else {}
    data["schema_version"] = config.SESSION_SCHEMA_VERSION
    paths = [p for p in data.get("paths", []) if _norm(p["path"], project) != path]
    removed = len(data.get("paths", [])) - len(paths)
    if access is None:
        if not removed:
            raise UsageError(f"session {sid} has no rule for {path}; see `stockade policy show --session {sid}`")
        verb = "removed the session rule for"
    else:
        paths.append({"path": path, "access": access,
                      "added_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        verb = {"ro": "allowed (read-only)", "rw": "allowed (read-write)", "deny": "denied"}[access]
    data["paths"] = paths
    from ..session.store import write_json_atomic

    write_json_atomic(ppath, data)
    try:
        from ..policy import load

        eff = load(project, sdir, None, strict=False)
        _warn(eff)
    except UsageError as e:
        print(f"stockade: warning: {e}", file=sys.stderr)
    print(f"session {sid}: {verb} {path} (effective at the next run)")
    return 0


def _norm(raw: str, project: Path) -> str:
    p = os.path.expanduser(raw)
    return os.path.realpath(p if os.path.isabs(p) else os.path.join(project, p))


def cmd_allow(args: Args) -> int:
    return _edit_session(args, None if args.remove else ("rw" if args.rw else "ro"))


def cmd_deny(args: Args) -> int:
    return _edit_session(args, "deny")
