"""CLI verbs of the policy package: policy show/why/env, allow, deny, log, doctor.

``register(subparsers)`` adds the verbs; ``add_policy_arguments(parser)`` and
``cli_policy_from_args(args)`` give ``run``/``explain`` their policy flags.
Imports stay inside handlers so `stockade run` does not pay for them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    from . import CliPolicy, Effective


# --------------------------------------------------------------------------- run flags


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("policy")
    g.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="set a variable inside (always passes the filter)")
    g.add_argument("--read-only", dest="read_only", action="store_const", const=True, default=None,
                   help="mount the project read-only: every write fails with EROFS")
    g.add_argument("--no-read-only", dest="read_only", action="store_const", const=False,
                   help="override a configured read_only = true")
    g.add_argument("--allow", dest="allow_paths", action="append", default=[], metavar="PATH[:rw]",
                   help="make a host path visible (read-only, or read-write with :rw)")
    g.add_argument("--deny", dest="deny_paths", action="append", default=[], metavar="PATH",
                   help="hide a path (deny wins over allows from earlier layers)")
    g.add_argument("--mask", dest="mask_patterns", action="append", default=[], metavar="PATTERN",
                   help="extra sensitive pattern (gitignore syntax) to mask")
    g.add_argument("--unmask", dest="unmask_patterns", action="append", default=[], metavar="PATTERN",
                   help="exempt paths matching PATTERN from the sensitive patterns")
    g.add_argument("--mask-mode", choices=("absent", "empty"), default=None,
                   help="masked files read as absent (default) or empty")
    g.add_argument("--env-allow", action="append", default=[], metavar="NAME",
                   help="pass variables matching NAME (glob) despite the block list")
    g.add_argument("--env-block", action="append", default=[], metavar="NAME",
                   help="remove variables matching NAME (glob)")
    g.add_argument("--exec-allow", action="append", default=None, metavar="DIR",
                   help="only binaries under DIR may run (Landlock execute right; repeatable)")
    g.add_argument("--deny-command", action="append", default=[], metavar="'CMD ARGS'",
                   help="refuse a top-level command by argv prefix, e.g. 'git push' (advisory)")


def _parse_allow(raw: str) -> tuple[str, bool]:
    for suffix, writable in ((":rw", True), (":ro", False)):
        if raw.endswith(suffix):
            return raw[: -len(suffix)], writable
    return raw, False


def cli_policy_from_args(args: argparse.Namespace) -> CliPolicy:
    from . import CliPolicy

    env: dict[str, str] = {}
    for kv in getattr(args, "env", None) or []:
        if "=" not in kv:
            raise UsageError(f"--env {kv!r}: expected NAME=VALUE")
        k, v = kv.split("=", 1)
        env[k] = v
    exec_allow = getattr(args, "exec_allow", None)
    return CliPolicy(
        read_only=getattr(args, "read_only", None),
        env=env,
        allow_paths=tuple(_parse_allow(p) for p in getattr(args, "allow_paths", None) or []),
        deny_paths=tuple(getattr(args, "deny_paths", None) or []),
        mask_mode=getattr(args, "mask_mode", None),
        mask_patterns=tuple(getattr(args, "mask_patterns", None) or []),
        unmask_patterns=tuple(getattr(args, "unmask_patterns", None) or []),
        env_allow=tuple(getattr(args, "env_allow", None) or []),
        env_block=tuple(getattr(args, "env_block", None) or []),
        exec_allow=None if exec_allow is None else tuple(exec_allow),
        commands_deny=tuple(getattr(args, "deny_command", None) or []),
        cwd=os.getcwd(),
    )


# --------------------------------------------------------------------------- register


def _project_args(p: argparse.ArgumentParser, *, session: bool = True) -> None:
    # SUPPRESS: never clobber a --project the top-level parser may define
    p.add_argument("--project", default=argparse.SUPPRESS, metavar="DIR",
                   help="the project directory (default: the current directory)")
    if session:
        p.add_argument("--session", "-s", default=None, metavar="S",
                       help="session whose policy.json to use (default: the project's latest, if any)")


def register(subparsers: Any) -> None:
    pol = subparsers.add_parser("policy", help="show the effective policy and why a path is visible")
    psub = pol.add_subparsers(dest="policy_cmd", metavar="{show,why,env}")
    psub.required = True

    show = psub.add_parser("show", help="effective rules with their source layer")
    show.add_argument("--json", action="store_true")
    _project_args(show)
    add_policy_arguments(show)
    show.set_defaults(func=cmd_policy_show)

    why = psub.add_parser("why", help="which rule decides a path, from which layer")
    why.add_argument("path", metavar="PATH")
    why.add_argument("--json", action="store_true")
    _project_args(why)
    add_policy_arguments(why)
    why.set_defaults(func=cmd_policy_why)

    env = psub.add_parser("env", help="which of your environment variables would pass")
    env.add_argument("--json", action="store_true")
    _project_args(env)
    add_policy_arguments(env)
    env.set_defaults(func=cmd_policy_env)

    allow = subparsers.add_parser("allow", help="session-level: make a path visible (next run)")
    allow.add_argument("path", metavar="PATH")
    allow.add_argument("--rw", action="store_true", help="read-write (default read-only)")
    allow.add_argument("--remove", action="store_true", help="remove the session's rule for PATH")
    _project_args(allow)
    allow.set_defaults(func=cmd_allow)

    deny = subparsers.add_parser("deny", help="session-level: hide a path (beats earlier allows)")
    deny.add_argument("path", metavar="PATH")
    _project_args(deny)
    deny.set_defaults(func=cmd_deny)

    log = subparsers.add_parser("log", help="a session's audit log")
    log.add_argument("session_name", nargs="?", default=None, metavar="S")
    log.add_argument("--blocked-only", action="store_true")
    log.add_argument("--json", action="store_true", help="raw JSON lines")
    log.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    log.add_argument("--project", default=argparse.SUPPRESS, metavar="DIR")
    log.set_defaults(func=cmd_log)

    doc = subparsers.add_parser("doctor", help="probe the kernel features stockade needs")
    doc.add_argument("--json", action="store_true")
    doc.add_argument("--apparmor", action="store_true", help="print the AppArmor profile that allows user namespaces")
    doc.add_argument("--refresh", action="store_true", help="ignore the cached probe results")
    doc.add_argument("--no-self-test", dest="self_test", action="store_false",
                     help="skip the live sandbox self-test")
    doc.set_defaults(func=cmd_doctor)


# --------------------------------------------------------------------------- helpers


def _project(args: argparse.Namespace) -> Path:
    raw = getattr(args, "project", None) or os.getcwd()
    p = Path(os.path.realpath(raw))
    if not p.is_dir():
        raise UsageError(f"project {raw!r} is not a directory; pass --project DIR")
    if p == Path("/"):
        raise UsageError("the project cannot be / ; pass --project DIR")
    return p


def _session_dir(args: argparse.Namespace, project: Path, *, create: bool = False) -> tuple[Path | None, str | None]:
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


def _load(args: argparse.Namespace) -> tuple[Effective, str | None]:
    from . import load

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


def cmd_policy_show(args: argparse.Namespace) -> int:
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


def cmd_policy_why(args: argparse.Namespace) -> int:
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


def cmd_policy_env(args: argparse.Namespace) -> int:
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
    from . import sandbox_sees
    from .env import hidden_refs
    from .rules import is_under

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


def _edit_session(args: argparse.Namespace, access: str | None) -> int:
    from . import config, deny_refusal
    from .rules import is_under

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
        from . import load

        eff = load(project, sdir, None, strict=False)
        _warn(eff)
    except UsageError as e:
        print(f"stockade: warning: {e}", file=sys.stderr)
    print(f"session {sid}: {verb} {path} (effective at the next run)")
    return 0


def _norm(raw: str, project: Path) -> str:
    p = os.path.expanduser(raw)
    return os.path.realpath(p if os.path.isabs(p) else os.path.join(project, p))


def cmd_allow(args: argparse.Namespace) -> int:
    return _edit_session(args, None if args.remove else ("rw" if args.rw else "ro"))


def cmd_deny(args: argparse.Namespace) -> int:
    return _edit_session(args, "deny")


def cmd_log(args: argparse.Namespace) -> int:
    from .. import audit
    from ..session import store

    project = getattr(args, "project", None)
    sess = store.resolve(args.session_name, Path(os.path.realpath(project)) if project else None)

    def out(rec: dict[str, Any]) -> None:
        if args.blocked_only and not audit.is_blocked(rec):
            return
        line = json.dumps(rec, ensure_ascii=False) if args.json else audit.format_event(rec)
        print(line, flush=True)

    if args.follow:
        try:
            for rec in audit.follow(sess.events_path):
                out(rec)
        except KeyboardInterrupt:
            return 0
        except BrokenPipeError:
            return 0
        return 0
    try:
        for rec in audit.read_events(sess.events_path):
            out(rec)
    except BrokenPipeError:
        return 0
    if args.blocked_only and not args.json:
        print(audit.BLOCKED_NOTE, file=sys.stderr)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .. import doctor

    if args.apparmor:
        print(doctor.apparmor_profile(), end="")
        return 0
    report = doctor.run(refresh=args.refresh, self_test=args.self_test)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(report.format())
    return report.exit_status
