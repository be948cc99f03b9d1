"""`stockade run`, `explain` and `shell`: the parsed options made a run of the core.

Imports stay inside the functions: a `stockade run` loads only what its run needs.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..cgroups.base import Manager
    from ..core.result import RunResult
    from .table import Args

# Housekeeping a CLI server's supervisor runs once its client has the status (None:
# run it in line); set by ``stockade.cli.serve``'s handler.
after_reply: list[Callable[[], None]] | None = None


def policy_fields(args: Args) -> dict[str, Any]:
    """The policy options as ``CliPolicy`` fields (those left at their default omitted:
    the same policy, and the same key for the prepared-run cache)."""
    from ..errors import UsageError

    env: dict[str, str] = {}
    for kv in getattr(args, "env", None) or []:
        if "=" not in kv:
            raise UsageError(f"--env {kv!r}: expected NAME=VALUE")
        k, v = kv.split("=", 1)
        env[k] = v
    exec_allow = getattr(args, "exec_allow", None)
    fields: dict[str, Any] = {
        "read_only": getattr(args, "read_only", None),
        "env": env,
        "allow_paths": tuple(_parse_allow(p) for p in getattr(args, "allow_paths", None) or []),
        "deny_paths": tuple(getattr(args, "deny_paths", None) or []),
        "mask_mode": getattr(args, "mask_mode", None),
        "mask_patterns": tuple(getattr(args, "mask_patterns", None) or []),
        "unmask_patterns": tuple(getattr(args, "unmask_patterns", None) or []),
        "env_allow": tuple(getattr(args, "env_allow", None) or []),
        "env_block": tuple(getattr(args, "env_block", None) or []),
        "exec_allow": None if exec_allow is None else tuple(exec_allow),
        "commands_deny": tuple(getattr(args, "deny_command", None) or []),
    }
    out = {k: v for k, v in fields.items() if v is not None and v != () and v != {}}
    out["cwd"] = os.getcwd()
    return out


def _parse_allow(raw: str) -> tuple[str, bool]:
    for suffix, writable in ((":rw", True), (":ro", False)):
        if raw.endswith(suffix):
            return raw[: -len(suffix)], writable
    return raw, False


def run_kwargs(args: Args, default_cmd: list[str] | None = None) -> dict[str, Any]:
    """A run's options (``core.request.RunRequest``'s fields) from parsed options: the
    one conversion, whichever parser read them."""
    from ..core.request import CliSpec
    from ..errors import UsageError
    from .table import LIMIT_NAMES

    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd and default_cmd:
        cmd = default_cmd
    if not cmd:
        raise UsageError("no command given; usage: stockade run [OPTIONS] -- CMD [ARGS...]")
    kw: dict[str, Any] = {
        "args": cmd,
        "project": args.project,
        "session": args.session,
        "cwd": args.cwd,
        "root": args.root,
        "user": args.user,
        "network": args.net,
        "allow_hosts": tuple(args.allow_hosts),
        "forward": tuple(args.forward),
        "pass_fds": tuple(args.pass_fd),
        "seccomp": args.seccomp,
        "landlock": not args.no_landlock,
        "allow_degraded": tuple(x for a in args.allow_degraded for x in a.split(",") if x),
        "no_wait": args.no_wait,
        "keep_latest_empty": True,  # a CLI run's empty session stays its project's latest (README: How long sessions stay)
        "observe": getattr(args, "observe", None),
    }
    if any(getattr(args, n) is not None for n in LIMIT_NAMES):
        # none given: the run's own defaults (and the config's limits table), as the API's
        from .limits import limits_from_args, requested_limits

        kw["limits"] = limits_from_args(args)
        kw["requested_limits"] = requested_limits(args)
    kw["policy"] = CliSpec(**policy_fields(args))
    return kw


def _execute(args: Args, *, pty: bool = False, default_cmd: list[str] | None = None) -> RunResult:
    """Run through the core as this process's own command: its stdio, its signals."""
    from ..core import prepare
    from ..core.execute import execute
    from ..core.request import RunIO, RunRequest
    from ..launch import launcher
    from .table import keepable

    req = RunRequest(**run_kwargs(args, default_cmd))
    # each command is a new process: share a launcher between them (it idles out)
    launcher.SHARED = os.environ.get("STOCKADE_LAUNCHER", "1") != "private"
    if not launcher.SHARED:
        launcher.shutdown()  # connections a CLI server's supervisor inherited
    # the speed layer's prepared runs on disk, for the next command (STOCKADE_WARM=0: none)
    if not pty and keepable(args) and os.environ.get("STOCKADE_WARM", "1") != "0":
        from ..fast import warm

        prepare.set_cache(warm.CACHE)
    else:
        prepare.set_cache(None)
    io = RunIO(forward_signals=True, quiet=False, pty=pty)
    if not pty and req.session is None and os.environ.get("STOCKADE_PREWARM", "1") != "0":
        from ..live.registry import warm_waiting

        if warm_waiting():  # `stockade warm` (or [prewarm]) left one ready: take it
            from ..live import run_claimed

            res: RunResult | None = run_claimed(req, io)
            if res is not None:
                return res
    return execute(req, io)


def cmd_run(args: Args) -> int:
    res = _execute(args)
    ef = res.exec_failed
    if ef is not None:
        import errno as _e

        from ..redact import printable

        name = printable(ef.path)  # bytes that are not UTF-8 as \xNN, as the run's record has them
        if ef.err in (_e.ENOENT, _e.ENOTDIR):
            sys.stderr.write(f"stockade: {name}: command not found\n")
        else:
            sys.stderr.write(f"stockade: {name}: cannot execute: {os.strerror(ef.err)}\n")
    after_run(res)
    manager = res.cg_manager
    if after_reply is not None:  # a server's supervisor: once the client has its status
        after_reply.append(lambda: _sweep_stale_cgroups(manager))
    else:
        _sweep_stale_cgroups(manager)
    status: int = res.exit_status
    if res.outcome_kind == "timeout":
        status = 124
    elif res.outcome_kind == "oom-killed":
        status = 137
    elif res.outcome_kind == "disk-limit-hit":
        status = 122
    return status


def after_run(res: RunResult) -> None:
    """The one-line summaries on stderr: outcome when notable, degraded layers, changes."""
    from ..session import store

    lines: list[str] = []
    if res.outcome and (not res.outcome.startswith("exited") or "disk-limit-hit" in res.outcome):
        lines.append(f"stockade: run {res.run} of session {res.session} ended: {res.outcome}")
    if res.degraded:
        lines.append("stockade: DEGRADED sandbox: " + ", ".join(res.degraded))
    if res.network:
        lines.append("stockade: " + res.network)
    sess = store.open_session(res.session)
    line = None
    if sess.has_layer_entries():
        from .changes import summary_line

        line = summary_line(sess)
    if line:
        lines.append(line)
    elif res.run == 1 or getattr(res, "new_session", False):
        lines.append(f"stockade: session {res.session}")
    for ln in lines:
        sys.stderr.write(ln + "\n")


def _sweep_stale_cgroups(manager: Manager | None = None) -> None:
    """Run cgroups of supervisors that were SIGKILLed cannot remove themselves: the next run does."""
    try:
        from ..cgroups.sweep import sweep_stale

        if manager is None:
            from ..cgroups import detect

            manager = detect.detect()
        sweep_stale(manager)
    except OSError:
        pass


def cmd_explain(args: Args) -> int:
    from .. import explain

    sys.stdout.write(explain.explain(**run_kwargs(args)) + "\n")
    return 0


def cmd_shell(args: Args) -> int:
    """An interactive shell in the sandbox. The sandbox opens the pty in its own devpts
    and hands it over (``pty=True``); this terminal is put in raw mode and relayed, so
    the sandbox never holds it and cannot inject keystrokes into it."""
    import termios
    import tty

    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    saved = None
    if os.isatty(0):
        saved = termios.tcgetattr(0)
        tty.setraw(0)
    try:
        res = _execute(args, pty=True, default_cmd=[shell, "-i"])
    finally:
        if saved is not None:
            termios.tcsetattr(0, termios.TCSADRAIN, saved)
    sys.stdout.flush()
    after_run(res)
    return int(res.exit_status)
