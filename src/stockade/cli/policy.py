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
    print(f"network  {eff.network.mode} ({_mode_origin(eff)}); {len(eff.network.rules)} host rule(s)"
          + (f", forwarded ports {', '.join(map(str, eff.network.forward))}" if eff.network.forward else ""))
    print()
    rows = []
    for r in eff.rules():
        status = "" if r.active else "overridden"
        rows.append([r.kind, r.action, r.target, r.origin.layer, _where(r.origin), status or r.note])
    print(_table(rows, ["KIND", "ACTION", "TARGET", "SOURCE", "WHERE", "NOTE"]))
    _warn(eff)
    return 0


def _mode_origin(eff: Effective) -> str:
    from ..policy.effective import _last_mode

    o = _last_mode(eff.layers)
    if o is None:
        return "the default"
    if o.layer == "cli":
        return "command line"
    return str(o)


def split_host_port(raw: str, default_port: int = 443) -> tuple[str, int]:
    """``HOST[:PORT]`` as asked of `policy why --host` (``[v6]:PORT``; a bare IPv6 address
    has no port); UsageError naming the option otherwise."""
    from ..policy import network as netpol

    text = raw.strip()
    port: object = default_port
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise UsageError(f"--host {raw!r}: expected HOST[:PORT], with an IPv6 address as [ADDRESS]:PORT")
        if rest:
            port = rest[1:]
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host = text
    if not host:
        raise UsageError(f"--host {raw!r}: expected HOST[:PORT], e.g. pypi.org or github.com:22")
    try:
        return host, netpol.parse_port(port, f"--host {raw!r}: port")
    except netpol.PatternError as e:
        raise UsageError(str(e)) from None


def _why_host(args: Args) -> int:
    host, port = split_host_port(args.host)
    eff, _ = _load(args)
    net = eff.network
    d = eff.why_host(host, port)
    mode_note = "" if net.mode == "allow" else (
        f"the network mode is {net.mode} ({_mode_origin(eff)}): host rules apply to runs with --net allow")
    if args.json:
        doc = {"host": host, "port": port, "mode": net.mode, **d.to_json()}
        if mode_note:
            doc["note"] = mode_note
        print(json.dumps(doc, indent=1))
    else:
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        verdict = "ALLOWED" if d.allowed else "BLOCKED"
        print(f"{target}: {verdict} (layer: {d.rule.tier if d.rule else 'default'})")
        print(f"  {d.reason}")
        if d.rule is not None:
            pre = f" (preset {d.rule.preset})" if d.rule.preset else ""
            print(f"  rule: host {d.rule.action} {d.rule.pattern}{pre}  [{d.rule.tier} {d.rule.where()}]")
        if d.allowed and d.rule is not None and d.rule.parsed.kind in ("name", "wildcard"):
            print("  its addresses must be public too (loopback, private, link-local and metadata ones are refused "
                  "unless a rule names them)")
        if mode_note:
            print(f"  note: {mode_note}")
    _warn(eff)
    return 0


def cmd_policy_why(args: Args) -> int:
    if (args.path is None) == (getattr(args, "host", None) is None):
        raise UsageError("policy why: give a PATH, or --host HOST[:PORT] (not both)")
    if args.path is None:
        return _why_host(args)
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
    """A session path rule (``access`` ro/rw/deny; None: remove), or with --host a host rule."""
    path_given, host = getattr(args, "path", None), getattr(args, "host", None)
    verb = "deny" if access == "deny" else "allow"
    if path_given is not None and host is not None:
        raise UsageError(f"{verb}: give a PATH or --host HOST, not both")
    if host is not None:
        if getattr(args, "rw", False):
            raise UsageError("allow --host: --rw is for paths; a host rule has no access mode")
        return _edit_hosts(args, None if getattr(args, "remove", False) else verb)
    if path_given is None:
        raise UsageError(f"{verb}: give a PATH, or --host HOST[:PORT]" + (", or --list" if verb == "allow" else ""))
    if access == "deny" and getattr(args, "remove", False):
        access = None
    return _edit_path(args, access)


def _host_key(raw: str) -> str:
    """A host pattern as the session file keeps it: presets lower-cased, patterns canonical."""
    from ..policy import network as netpol

    text = raw.strip()
    if text.startswith("@"):
        return text.lower()
    try:
        return netpol.parse_pattern(text).text()
    except netpol.PatternError:
        return text


def _edit_hosts(args: Args, action: str | None) -> int:
    from ..policy import config, load
    from ..policy import network as netpol
    from ..session.store import write_json_atomic

    raw = str(args.host)
    flag = f"{'deny' if action == 'deny' else 'allow'} --host"
    try:  # its form first: a bad pattern names itself before any session is looked up
        netpol.check_raw(raw)
    except netpol.PatternError as e:
        raise UsageError(f"{flag}: {e}; expected HOST[:PORT], *.DOMAIN, an IP address or CIDR, or @preset") from None
    key = _host_key(raw)
    project = _project(args)
    sdir, sid = _session_dir(args, project, create=True)
    assert sdir is not None and sid is not None
    if action is not None and key.startswith("@"):
        presets = load(project, sdir, None, strict=False).network.preset_table()
        try:
            netpol.expand(key, presets)
        except netpol.PatternError as e:
            raise UsageError(f"{flag}: {e}") from None
    ppath = config.session_policy_path(sdir)
    src = config.read_json("session", ppath)  # validates: a broken file is reported, not overwritten
    data: dict[str, Any] = dict(src.data) if src else {}
    data["schema_version"] = config.SESSION_SCHEMA_VERSION
    old = list(data.get("hosts", []))
    hosts = [h for h in old if _host_key(h["host"]) != key]  # one rule per host: the new one replaces it
    if action is None:
        if len(hosts) == len(old):
            raise UsageError(f"session {sid} has no host rule for {key}; see `stockade allow --list --session {sid}`")
        done = "removed the session's host rule for"
    else:
        hosts.append({"host": key, "action": action, "added_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        done = "allowed host" if action == "allow" else "denied host"
    data["hosts"] = hosts
    write_json_atomic(ppath, data)
    print(f"session {sid}: {done} {key} (effective for the next connection of a running --net allow run, and the next run)")
    return 0


def cmd_allow_list(args: Args) -> int:
    from ..policy import config

    if getattr(args, "path", None) is not None or getattr(args, "host", None) is not None or args.rw or args.remove:
        raise UsageError("allow --list takes no PATH, --host, --rw or --remove")
    project = _project(args)
    sdir, sid = _session_dir(args, project, create=True)
    assert sdir is not None
    ppath = config.session_policy_path(sdir)
    src = config.read_json("session", ppath)
    data: dict[str, Any] = dict(src.data) if src else {}
    paths = [{"path": p["path"], "access": p.get("access", "ro"), "added_at": p.get("added_at")} for p in data.get("paths", [])]
    hosts = [{"host": h["host"], "action": h["action"], "added_at": h.get("added_at")} for h in data.get("hosts", [])]
    if args.json:
        print(json.dumps({"session": sid, "file": str(ppath), "paths": paths, "hosts": hosts}, indent=1))
        return 0
    print(f"session {sid}  ({ppath})")
    if not paths and not hosts:
        print("no session rules (add them with `stockade allow PATH`, `stockade allow --host HOST`, `stockade deny ...`)")
        return 0
    if paths:
        print(_table([[p["access"], p["path"], p["added_at"] or ""] for p in paths], ["ACCESS", "PATH", "ADDED"]))
    if hosts:
        if paths:
            print()
        print(_table([[h["action"], h["host"], h["added_at"] or ""] for h in hosts], ["ACTION", "HOST", "ADDED"]))
    return 0


def _edit_path(args: Args, access: str | None) -> int:
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
    if getattr(args, "list_rules", False):
        return cmd_allow_list(args)
    if getattr(args, "json", False):
        raise UsageError("allow: --json is for --list")
    return _edit_session(args, None if args.remove else ("rw" if args.rw else "ro"))


def cmd_deny(args: Args) -> int:
    return _edit_session(args, "deny")


def cmd_policy_suggest(args: Args) -> int:
    """What observed runs of a session were denied, as the config lines that would allow
    it, each with the risk it opens. Printed only: nothing is written."""
    from .. import audit, observed
    from ..session import store

    project = getattr(args, "project", None)
    sess = store.resolve(args.session_name, Path(os.path.realpath(project)) if project else None)
    events = [r for r in audit.read_events(sess.events_path) if observed.is_observed(r)]
    proj = str(sess.project)
    sugg = observed.suggest(events, project=proj)
    if args.json:
        print(json.dumps([{"section": s.section, "line": s.line, "risk": s.risk, "because": s.because} for s in sugg],
                         ensure_ascii=False, indent=1))
        return 0
    if not events:
        print(f"session {sess.id} has no observed runs: run with `stockade run --observe` first", file=sys.stderr)
        return 0
    if not sugg:
        print(f"session {sess.id}: nothing observed was denied; no change suggested")
        return 0
    print(f"# suggestions for session {sess.id} (not applied: copy what you accept into .stockade.toml)")
    for line in observed.render(sugg):
        print(line)
    return 0
