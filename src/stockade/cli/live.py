"""`stockade start`, `exec`, `logs`, `stop`, `ps`, `warm`: living sandboxes.

`start` takes the run options (the same table as `run`) and returns once the
sandbox serves; every other verb names it (its id is its session's).
"""

from __future__ import annotations

import json
import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:

    from ..core.request import RunRequest
    from .table import Args


def _out(s: str) -> None:
    sys.stdout.write(s)
    sys.stdout.flush()


def _duration(flag: str, raw: str | None) -> float | None:
    """A duration option: seconds, or None for 'none'."""
    if raw is None:
        return None
    from ..cgroups.parse import parse_limit
    from ..errors import UsageError

    try:
        v = parse_limit("timeout", raw, source="flag")
    except UsageError:
        raise UsageError(f"{flag} {raw!r}: expected a duration such as 30s, 5m or 2h, or 'none'") from None
    return None if v is None else float(v)


def _request(args: Args) -> RunRequest:
    from ..core.request import RunRequest
    from .run import run_kwargs

    if getattr(args, "command", None):
        from ..errors import UsageError

        raise UsageError(f"{args.verb} takes no command; run commands with `stockade exec NAME -- CMD`")
    vars(args)["command"] = ["--", "true"]  # run_kwargs wants one; a living sandbox never runs it
    kw = run_kwargs(args)
    kw.pop("session", None)
    if kw.get("observe"):
        from ..core.observe import LIVE_REFUSED
        from ..errors import UsageError

        raise UsageError(LIVE_REFUSED)
    kw["observe"] = False  # [audit] observe is for one-shot runs
    return RunRequest(**kw)


def _idle(args: Args) -> float | None:
    raw = getattr(args, "idle_timeout", None)
    if raw is None:
        return None  # the config's [live] idle_timeout, else the default
    v = _duration("--idle-timeout", raw)
    return float("inf") if v is None else v


def cmd_start(args: Args) -> int:
    from .. import live
    from ..errors import UsageError

    name = args.name or args.session
    if args.name and args.session and args.name != args.session:
        raise UsageError("--name and --session name the same thing (the sandbox's session); give one")
    spec = live.StartSpec(_request(args), name=name, detached=True, idle=_idle(args))
    t0 = time.monotonic()
    lv = live.start(spec)
    if args.json:
        _out(json.dumps({**lv.data, "start_seconds": round(time.monotonic() - t0, 4)}) + "\n")
    else:
        _out(lv.id + "\n")
        idle = lv.data.get("idle_timeout")
        sys.stderr.write(f"stockade: sandbox {lv.id} is running (idle timeout "
                         f"{_fmt_secs(idle)}); `stockade exec {lv.id} -- CMD`, `stockade stop {lv.id}`\n")
    return 0


def _fmt_secs(v: object) -> str:
    if v is None:
        return "none"
    if isinstance(v, int | float):
        if v == float("inf"):
            return "none"
        if v >= 3600 and v % 3600 == 0:
            return f"{int(v // 3600)}h"
        if v >= 60 and v % 60 == 0:
            return f"{int(v // 60)}m"
        return f"{v:g}s"
    return str(v)


def cmd_warm(args: Args) -> int:
    from .. import live

    ttl = _duration("--ttl", args.ttl)
    req = _request(args)
    spec = live.StartSpec(req, detached=True, idle=ttl if ttl is not None else float("inf"), warm=True,
                          warm_key=live.warm_key(req))
    lv = live.start(spec)
    if args.json:
        _out(json.dumps(lv.data) + "\n")
    else:
        _out(lv.id + "\n")
        sys.stderr.write(f"stockade: a sandbox is ready for {lv.data.get('project')} for {_fmt_secs(ttl)}; "
                         "the next `stockade start` or `stockade run` with the same options takes it\n")
    return 0


def cmd_exec(args: Args) -> int:
    from ..core.request import DEVNULL, RunIO
    from ..errors import UsageError
    from ..live import Channel, registry

    args = _options_after_name(args)
    cmd = list(args.command)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("no command given; usage: stockade exec NAME [OPTIONS] -- CMD [ARGS...]")
    env: dict[str, str] = {}
    for kv in args.env or []:
        if "=" not in kv:
            raise UsageError(f"--env {kv!r}: expected NAME=VALUE")
        k, v = kv.split("=", 1)
        env[k] = v
    timeout = _duration("--timeout", args.timeout)
    lv = registry.running(args.name)
    chan = Channel(lv)
    pty = bool(args.tty)
    if pty and "TERM" in os.environ:
        env.setdefault("TERM", os.environ["TERM"])  # this terminal's kind, as `stockade shell` has it
    io = RunIO(stdin=None if (args.interactive or pty) else DEVNULL, forward_signals=True, quiet=False, pty=pty)
    try:
        here = os.getcwd()
    except OSError:
        here = None
    saved = None
    if pty and os.isatty(0):
        import termios
        import tty

        saved = termios.tcgetattr(0)
        tty.setraw(0)
    try:
        res = chan.exec(cmd, io=io, env=env, cwd=args.cwd, timeout=timeout, pass_fds=tuple(args.pass_fd), here=here)
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(0, termios.TCSADRAIN, saved)
        chan.close()
    ef = res.exec_failed
    if ef is not None:
        import errno as _e

        from ..redact import printable

        what = printable(ef.path)
        if ef.err in (_e.ENOENT, _e.ENOTDIR):
            sys.stderr.write(f"stockade: {what}: command not found\n")
        else:
            sys.stderr.write(f"stockade: {what}: cannot execute: {os.strerror(ef.err)}\n")
    if res.outcome_kind == "timeout":
        sys.stderr.write(f"stockade: exec {res.run} of sandbox {lv.id} ended: {res.outcome}\n")
        return 124
    if res.outcome_kind == "disk-limit-hit":
        sys.stderr.write(f"stockade: exec {res.run} of sandbox {lv.id} ended: {res.outcome}\n")
        return 122
    return res.exit_status


def _options_after_name(args: Args) -> Args:
    """`stockade exec NAME --timeout 1 -- CMD` as `stockade exec --timeout 1 NAME -- CMD`:
    argparse gives every word after NAME to the command; the exec options found there
    (up to `--` or the first word that is not one of them) are read again."""
    from .table import BY_NAME, parse

    words = list(args.command)
    if not words or not words[0].startswith("-") or words[0] == "--":
        return args
    opts = {f: a for a in BY_NAME["exec"].all_args() for f in a.flags if f.startswith("-")}
    i = 0
    while i < len(words) and words[i] != "--" and words[i].startswith("-"):
        name = words[i].split("=", 1)[0]
        arg = opts.get(name)
        if arg is None:
            if not name.startswith("--") and len(name) > 2 and all(f"-{c}" in opts for c in name[1:]):
                i += 1  # -it
                continue
            break
        takes = arg.kw.get("action", "store") in ("store", "append")
        i += 2 if takes and "=" not in words[i] else 1
    if i == 0:
        return args
    return parse(["exec", *words[:i], str(args.name), *(words[i:] if words[i:i + 1] == ["--"] else ["--", *words[i:]])])


def cmd_stop(args: Args) -> int:
    from .. import live
    from ..live import registry

    grace = _duration("--timeout", args.timeout)
    lv = registry.find(args.name)
    was = lv.status
    out = live.stop(lv, grace)
    line = _changes_line(lv.id)
    if args.json:
        _out(json.dumps({"id": lv.id, "was": was, **out}) + "\n")
    else:
        reason = f" ({out.get('reason')})" if out.get("reason") and was != "running" else ""
        sys.stderr.write(f"stockade: sandbox {lv.id} {out.get('status', 'stopped')}{reason}"
                         + (f"; {line}" if line else "; no changes") + "\n")
    return 0


def _changes_line(sid: str) -> str | None:
    from ..session import store

    try:
        sess = store.open_session(sid)
        if not sess.has_layer_entries():
            return None
        from .changes import summary_line

        line = summary_line(sess)
        return line.removeprefix("stockade: ") if line else None
    except Exception:  # a summary never fails a stop
        return None


def _age(started: object) -> str:
    if not isinstance(started, str):
        return "?"
    try:
        t = time.mktime(time.strptime(started, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    except ValueError:
        return "?"
    s = max(0, int(time.time() - t))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def cmd_ps(args: Args) -> int:
    from ..live import registry

    rows = [lv for lv in registry.all_living() if args.all or lv.status in ("running", "warm", "stopping", "starting")]
    if args.json:
        _out(json.dumps([{**lv.data, "status": lv.status} for lv in rows], indent=1) + "\n")
        return 0
    if not rows:
        sys.stderr.write("stockade: no living sandboxes" + ("" if args.all else " running (`stockade ps --all` lists stopped ones)") + "\n")
        return 0
    _out(f"{'ID':<16} {'STATUS':<9} {'UP':>7} {'EXECS':>5} {'NET':<5} {'IDLE':>6}  PROJECT\n")
    for lv in rows:
        d = lv.data
        idle = _fmt_secs(d.get("idle_timeout")) if d.get("detached") else "owner"
        _out(f"{lv.id:<16} {lv.status:<9} {_age(d.get('started_at')):>7} {d.get('execs', 0)!s:>5} "
             f"{d.get('network') or '?':<5} {idle:>6}  {d.get('project')}\n")
    return 0


def cmd_logs(args: Args) -> int:
    """Each exec's output in order, with a header line; --follow until the sandbox ends."""
    from ..live import registry
    from ..session import store

    lv = registry.find(args.name)
    sess = store.open_session(lv.id)
    shown: dict[int, dict[str, int]] = {}
    done: set[int] = set()
    while True:
        for r in sess.runs():
            n = r.get("run")
            if not isinstance(n, int) or r.get("kind") != "exec" or n in done:
                continue
            pos = shown.setdefault(n, {"stdout": 0, "stderr": 0})
            if pos.get("head") is None:
                argv = " ".join(r.get("argv") or [])
                sys.stderr.write(f"== exec {n}: {argv}\n")
                pos["head"] = 1
            for name, dest in (("stdout", sys.stdout.buffer), ("stderr", sys.stderr.buffer)):
                path = sess.runs_dir / str(n) / f"{name}.log"
                try:
                    with open(path, "rb") as f:
                        f.seek(pos[name])
                        data = f.read()
                except FileNotFoundError:
                    data = b""
                if data:
                    dest.write(data)
                    dest.flush()
                    pos[name] += len(data)
            if (r.get("status") == "done" and not args.follow) or (r.get("status") == "done" and lv.status not in ("running", "warm")):
                done.add(n)
        if not args.follow:
            return 0
        cur = registry.read(lv.id)
        if cur is None or cur.status not in ("running", "warm", "starting", "stopping"):
            return 0
        time.sleep(0.2)
