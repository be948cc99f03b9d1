"""Command-line front end: argparse only, no logic. Imports stay lazy so the
`run` path loads nothing it does not need: a `stockade run` with the common options
is even parsed without argparse (``_fast_run``)."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any


# Housekeeping a CLI server's supervisor runs after replying (None: run it in line).
after_reply: list[Any] | None = None


def _parser_class() -> type[argparse.ArgumentParser]:
    import argparse

    class _Parser(argparse.ArgumentParser):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            # "-5M", "-1s": a value (then refused by its option with a clear message), never
            # an unknown option; argparse only takes "-5" and "-1.5" so (no option starts with a digit)
            import re

            self._negative_number_matcher = re.compile(r"^-\.?\d")

        def error(self, message: str) -> Any:  # one line, exit 2
            sys.stderr.write(f"stockade: {message} (see `{self.prog} --help`)\n")
            raise SystemExit(2)

    return _Parser


# `stockade run` options the fast parser knows: option -> (key, takes a value)
_FAST_OPTS: dict[str, tuple[str, bool]] = {
    "--project": ("project", True), "-p": ("project", True),
    "--session": ("session", True), "-s": ("session", True),
    "--cwd": ("cwd", True), "--net": ("net", True), "--seccomp": ("seccomp", True), "--env": ("env", True),
    "--root": ("root", False), "--no-wait": ("no_wait", False),
    "--read-only": ("read_only", False), "--no-read-only": ("no_read_only", False),
}


def _fast_run(argv: list[str]) -> dict[str, Any] | None:
    """``run [common options] [--] CMD...`` parsed as argparse would, without it (nor
    the modules its parser needs); None for anything else, which argparse handles
    (help, errors, the other options)."""
    if len(argv) < 2 or argv[0] != "run":
        return None
    v: dict[str, Any] = {"project": ".", "session": None, "cwd": None, "net": "none", "seccomp": "default",
                         "root": False, "no_wait": False, "read_only": None}
    env: dict[str, str] = {}
    cmd: list[str] | None = None
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--":
            cmd = argv[i + 1:]
            break
        if not a.startswith("-") or a == "-":
            cmd = argv[i:]
            break
        name, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        spec = _FAST_OPTS.get(name)
        if spec is None:
            return None
        key, takes = spec
        if not takes:
            if eq:
                return None
            if key == "read_only":
                v["read_only"] = True
            elif key == "no_read_only":
                v["read_only"] = False
            else:
                v[key] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                return None
            val = argv[i + 1]
            i += 1
        i += 1
        if key == "env":
            if "=" not in val:
                return None
            k, ev = val.split("=", 1)
            env[k] = ev
        elif key == "net" and val not in ("none", "host"):
            return None
        else:
            v[key] = val
    if not cmd:
        return None
    from .prepare import CliSpec

    return {
        "args": cmd,
        "project": v["project"],
        "session": v["session"],
        "cwd": v["cwd"],
        "root": v["root"],
        "user": None,
        "network": v["net"],
        "pass_fds": (),
        "seccomp": v["seccomp"],
        "landlock": True,
        "allow_degraded": (),
        "no_wait": v["no_wait"],
        # what cli_policy_from_args makes of these flags
        "policy": CliSpec(read_only=v["read_only"], env=env, cwd=os.getcwd()),
    }


def _natural(what: str) -> Any:
    """An argparse type: an integer >= 0, else "invalid value '-5': expected <what>"."""
    import argparse

    def parse(raw: str) -> int:
        try:
            n = int(raw, 10)
        except ValueError:
            n = -1
        if n < 0 or n > 0x7FFFFFFF:
            raise argparse.ArgumentTypeError(f"invalid value {raw!r}: expected {what}")
        return n

    return parse


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--project", "-p", default=".", metavar="DIR", help="project directory (default: .)")
    p.add_argument("--session", "-s", metavar="NAME", help="reuse or create the named session")
    p.add_argument("--cwd", metavar="DIR", help="working directory inside the project")
    p.add_argument("--root", action="store_true", help="appear as uid 0 inside (no capabilities)")
    p.add_argument("--user", type=_natural("a uid such as 1000"), metavar="UID", help="(real root only) run as this uid instead of the project's owner")
    p.add_argument("--net", default="none", choices=("none", "host"), help="network: none (own netns, lo only) or host")
    p.add_argument("--pass-fd", type=_natural("an open file descriptor number such as 3"), action="append", default=[], metavar="N", help="pass file descriptor N through")
    p.add_argument("--seccomp", default="default", metavar="NAME|PATH", help="seccomp profile (default, strict, permissive, a JSON file, or off)")
    p.add_argument("--no-landlock", action="store_true", help="do not apply Landlock (needs --allow-degraded landlock)")
    p.add_argument("--allow-degraded", action="append", default=[], metavar="WHAT", help="run without a layer the kernel or a container refuses: landlock, seccomp, limits, proc, hostname")
    p.add_argument("--no-wait", action="store_true", help="fail instead of waiting when the session is busy")
    try:
        from .cgroups.cli import add_limit_arguments
    except ImportError:  # pragma: no cover
        pass
    else:
        add_limit_arguments(p)
    try:
        from .policy.cli import add_policy_arguments
    except ImportError:  # pragma: no cover
        p.add_argument("--env", "-e", action="append", default=[], metavar="K=V", help="set a variable inside (always passes)")
        p.add_argument("--read-only", action="store_true", help="mount the project read-only")
    else:
        add_policy_arguments(p)
    import argparse

    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


def _run_kwargs(args: argparse.Namespace, default_cmd: list[str] | None = None) -> dict[str, Any]:
    from .errors import UsageError

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
        "pass_fds": tuple(args.pass_fd),
        "seccomp": args.seccomp,
        "landlock": not args.no_landlock,
        "allow_degraded": tuple(x for a in args.allow_degraded for x in a.split(",") if x),
        "no_wait": args.no_wait,
    }
    if hasattr(args, "memory"):
        from .cgroups.cli import limits_from_args, requested_limits

        kw["limits"] = limits_from_args(args)
        kw["requested_limits"] = requested_limits(args)
    if "stockade.policy.cli" in sys.modules:
        from .policy.cli import cli_policy_from_args

        kw["policy"] = cli_policy_from_args(args)
    else:
        env = {}
        for item in getattr(args, "env", []) or []:
            if "=" not in item:
                raise UsageError(f"--env {item!r}: expected K=V")
            k, v = item.split("=", 1)
            env[k] = v
        kw["env"] = env
        kw["read_only"] = bool(getattr(args, "read_only", False))
    return kw


def cmd_run(args: argparse.Namespace) -> int:
    return _run(_run_kwargs(args))


def _run(kw: dict[str, Any]) -> int:
    from . import api
    from .errors import SandboxError
    from .linux import launcher

    # each command is a new process: share a launcher between them (it idles out)
    launcher.SHARED = os.environ.get("STOCKADE_LAUNCHER", "1") != "private"
    if not launcher.SHARED:
        launcher.shutdown()  # connections a CLI server's supervisor inherited
    argv = kw.pop("args")
    project = kw.pop("project")
    session = kw.pop("session")
    # persist: what this run was prepared from and into is kept for the next command
    res = api.run(argv, project=project, session=session, forward_signals=True, quiet=False, persist=True,
                  plain_result=True, **kw)
    ef = getattr(res, "exec_failed", None)
    if ef is not None:
        import errno as _e

        from .audit import printable

        name = printable(ef.path)  # bytes that are not UTF-8 as \xNN, as the run's record has them
        if ef.err in (_e.ENOENT, _e.ENOTDIR):
            sys.stderr.write(f"stockade: {name}: command not found\n")
        else:
            sys.stderr.write(f"stockade: {name}: cannot execute: {os.strerror(ef.err)}\n")
    _after_run(res)
    if after_reply is not None:  # a server's supervisor: once the client has its status
        after_reply.append(lambda: _sweep_stale_cgroups(getattr(res, "cg_manager", None)))
    else:
        _sweep_stale_cgroups(getattr(res, "cg_manager", None))
    del SandboxError
    status: int = res.exit_status
    kind = getattr(res, "outcome_kind", "")
    if kind == "timeout":
        status = 124
    elif kind == "oom-killed":
        status = 137
    return status


def _after_run(res: Any) -> None:
    """The one-line summaries on stderr: outcome when notable, degraded layers, changes."""
    lines: list[str] = []
    if res.outcome and not res.outcome.startswith("exited"):
        lines.append(f"stockade: run {res.run} of session {res.session} ended: {res.outcome}")
    if res.degraded:
        lines.append("stockade: DEGRADED sandbox: " + ", ".join(res.degraded))
    line = None
    from .session import store

    sess = store.open_session(res.session)
    if sess.has_layer_entries():
        try:
            from .changes.cli import summary_line

            line = summary_line(sess)
        except ImportError:
            line = None
    if line:
        lines.append(line)
    elif res.run == 1:
        lines.append(f"stockade: session {res.session}")
    for ln in lines:
        sys.stderr.write(ln + "\n")




def _sweep_stale_cgroups(manager: Any = None) -> None:
    """Run cgroups of supervisors that were SIGKILLed cannot remove themselves: the next run does."""
    try:
        from .cgroups.sweep import sweep_stale

        if manager is None:
            from .cgroups import detect

            manager = detect.detect()
        sweep_stale(manager)
    except OSError:
        pass


def cmd_explain(args: argparse.Namespace) -> int:
    from . import explain

    kw = _run_kwargs(args)
    sys.stdout.write(explain.explain(**kw) + "\n")
    return 0


_LEAN_VERBS = ("run", "explain", "shell")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    _Parser = _parser_class()
    parser = _Parser(prog="stockade", description="Run untrusted commands in a Linux sandbox; review their writes as a change set.")
    parser.add_argument("--version", action="version", version="stockade 0.1.0")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("run", help="run a command in a sandbox over the project")
    _add_run_options(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("explain", help="print the plan a run would execute")
    _add_run_options(p)
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("shell", help="an interactive shell in the sandbox (a pty relayed to your terminal)")
    _add_run_options(p)
    p.set_defaults(func=_lazy("stockade.shell", "cmd_shell"))
    verb = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    if verb in _LEAN_VERBS:
        return parser  # the run path registers (and imports) nothing else
    for mod in ("stockade.changes.cli", "stockade.cgroups.cli", "stockade.policy.cli", "stockade.linux.seccomp_cli"):
        try:
            m = __import__(mod, fromlist=["register"])
        except ImportError:
            continue
        reg = getattr(m, "register", None)
        if reg is not None:
            reg(sub)
    return parser


def _lazy(module: str, name: str) -> Any:
    def f(args: argparse.Namespace) -> int:
        m = __import__(module, fromlist=[name])
        rc: int = getattr(m, name)(args)
        return rc

    return f


def main(argv: list[str] | None = None, *, serve: bool = True) -> int:
    words = sys.argv[1:] if argv is None else argv
    # arguments and paths may hold bytes that are not UTF-8 (os.fsdecode's surrogate
    # escapes): what we print of them goes out as those bytes, as ls and cat do, never
    # a UnicodeEncodeError (stderr already escapes them: backslashreplace)
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None and getattr(sys.stdout, "errors", "") == "strict":
        reconfigure(errors="surrogateescape")
    if serve and argv is None and words[:1] == ["run"]:
        # the user's warm server runs it (same code, same context), else in-process
        from ._client import serve_and_exit

        serve_and_exit(words)
    if argv is None:  # the process's own command line: --pass-fd means the fds it was started with
        from .callerfds import snapshot

        snapshot()
    fast = _fast_run(words)
    if fast is not None:
        return _guarded(lambda: _run(fast))
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        print("stockade: no command given; try `stockade run -- CMD`, or `stockade --help` for every verb",
              file=sys.stderr)
        return 2

    def verb() -> int:
        if args.verb not in ("run", "explain", "shell", "recover"):
            _recover_quietly()
        rc: int = args.func(args)
        return rc

    return _guarded(verb)


def _guarded(fn: Any) -> int:
    """Run a verb: our errors as one line and their exit status, Ctrl-C as 130, EPIPE as 141."""
    from .errors import StockadeError

    try:
        rc: int = fn()
        return rc
    except StockadeError as e:
        sys.stderr.write(f"stockade: {e.one_line()}\n")
        return e.exit_status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 141


def _recover_quietly() -> None:
    try:
        from .changes.apply import recover_pending
    except ImportError:
        return
    for line in recover_pending():
        sys.stderr.write(f"stockade: {line}\n")


if __name__ == "__main__":
    sys.exit(main())
