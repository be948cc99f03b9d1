"""The command line as one table: every verb, its options and its handler.

argparse's parser is built from it (``build_parser``), and so is the fast path of
`stockade run` (``fast_parse``): it reads the options the table declares plainly
(flags, values, choices, appends, a ``type``) exactly as argparse would, and returns
None for anything else (help, abbreviations, ``-p/tmp``, a value that starts with
``-``, a bad value), which argparse then handles, errors included. Both give the same
``Args``, turned into a run by one function (``cli.run.run_kwargs``).

Importing this module imports nothing (argparse only when a parser is built), so a
`stockade run` in-process does not pay for argparse or for the other verbs' modules.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Iterator
    from typing import Any

VERSION = "stockade 0.1.0"
SUPPRESS = "==SUPPRESS=="  # argparse.SUPPRESS: no default, the name is absent unless given
SUPPRESS_HELP = SUPPRESS  # as help: an argument the help does not list
REMAINDER = "..."  # argparse.REMAINDER


class Args:
    """Parsed arguments: argparse fills one (``parse_args(namespace=Args())``), the
    fast path makes one; equal when they read the command line alike."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)

    def __getattr__(self, name: str) -> Any:  # typed access for the handlers; absent: AttributeError
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Args) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Args({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class Handler:
    """A verb's function, imported from its module of ``stockade.cli`` when it runs."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, args: Args) -> int:
        import importlib

        fn: Callable[[Args], int] = getattr(importlib.import_module(f"stockade.cli.{self.module}"), self.name)
        return int(fn(args))

    def __repr__(self) -> str:
        return f"stockade.cli.{self.module}.{self.name}"


class Arg:
    """One ``add_argument`` call. ``keep``: a `stockade run` given this option may reuse
    and store its prepared run on disk (``stockade.fast.warm``)."""

    __slots__ = ("flags", "keep", "kw")

    def __init__(self, *flags: str, keep: bool = False, **kw: Any) -> None:
        self.flags, self.keep, self.kw = flags, keep, kw

    @property
    def dest(self) -> str:
        if "dest" in self.kw:
            return str(self.kw["dest"])
        long = next((f for f in self.flags if f.startswith("--")), self.flags[0])
        return long.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        action = self.kw.get("action", "store")
        if "default" in self.kw:
            return self.kw["default"]
        return {"store_true": False, "store_false": True}.get(action)


class Group:
    """Options shown under a title in the help."""

    __slots__ = ("args", "title")

    def __init__(self, title: str, *args: Arg) -> None:
        self.title, self.args = title, args


class Verb:
    __slots__ = ("args", "description", "handler", "help", "name", "sub", "sub_dest")

    def __init__(self, name: str, help: str, handler: Handler | None, *args: Arg | Group,
                 description: str | None = None, sub: tuple[Verb, ...] = (), sub_dest: str = "") -> None:
        self.name, self.help, self.handler, self.args = name, help, handler, args
        self.description, self.sub, self.sub_dest = description, sub, sub_dest

    def all_args(self) -> Iterator[Arg]:
        for a in self.args:
            if isinstance(a, Group):
                yield from a.args
            else:
                yield a


def _natural(what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= 0, else "invalid value '-5': expected <what>"."""

    def parse(raw: str) -> int:
        try:
            n = int(raw, 10)
        except ValueError:
            n = -1
        if n < 0 or n > 0x7FFFFFFF:
            import argparse

            raise argparse.ArgumentTypeError(f"invalid value {raw!r}: expected {what}")
        return n

    return parse


# --------------------------------------------------------------------------- the table

# cgroups.base.LIMIT_NAMES and FLAG_FOR, spelled out: importing cgroups costs a run
# ~20 ms (tests/unit/test_cli_fast.py holds the two in step)
LIMITS = Group(
    "resource limits ('none' lifts a limit)",
    Arg("--memory", dest="memory", metavar="MEMORY", default=None,
        help="memory limit, e.g. 512M or 2G (swap is disabled); default: half the RAM"),
    Arg("--cpus", dest="cpus", metavar="CPUS", default=None, help="CPU bandwidth in CPUs, e.g. 0.5 or 1.5; default: no limit"),
    Arg("--pids", dest="pids", metavar="PIDS", default=None, help="maximum number of tasks in the sandbox; default: 1024"),
    Arg("--timeout", dest="timeout", metavar="TIMEOUT", default=None,
        help="wall-clock limit, e.g. 30s, 5m; on expiry SIGTERM, a grace period, SIGKILL (exit 124)"),
    Arg("--cpu-time", dest="cpu_time", metavar="TIME", default=None, help="CPU time limit per process, e.g. 60s (SIGXCPU, then SIGKILL)"),
    Arg("--max-file-size", dest="max_file_size", metavar="SIZE", default=None, help="largest file the command may write, e.g. 1G"),
    Arg("--nofile", dest="nofile", metavar="NOFILE", default=None, help="open files per process; default: 4096"),
    Arg("--disk", dest="disk", metavar="SIZE", default=None,
        help="what the sandbox may write: the session's layers plus each tmpfs (/tmp, $HOME, ...), e.g. 2G; "
             "past it the run ends (exit 122); default: 10G"),
    Arg("--disk-floor", dest="disk_floor", metavar="SIZE", default=None,
        help="free space kept on the state dir's filesystem; a writing run ends before less is left; default: 1G"),
)
LIMIT_NAMES = tuple(a.dest for a in LIMITS.args)

POLICY = Group(
    "policy",
    Arg("--env", action="append", default=[], metavar="K=V", keep=True, help="set a variable inside (always passes the filter)"),
    Arg("--read-only", dest="read_only", action="store_const", const=True, default=None, keep=True,
        help="mount the project read-only: every write fails with EROFS"),
    Arg("--no-read-only", dest="read_only", action="store_const", const=False, keep=True,
        help="override a configured read_only = true"),
    Arg("--allow", dest="allow_paths", action="append", default=[], metavar="PATH[:rw]",
        help="make a host path visible (read-only, or read-write with :rw)"),
    Arg("--deny", dest="deny_paths", action="append", default=[], metavar="PATH",
        help="hide a path (deny wins over allows from earlier layers)"),
    Arg("--mask", dest="mask_patterns", action="append", default=[], metavar="PATTERN",
        help="extra sensitive pattern (gitignore syntax) to mask"),
    Arg("--unmask", dest="unmask_patterns", action="append", default=[], metavar="PATTERN",
        help="exempt paths matching PATTERN from the sensitive patterns"),
    Arg("--mask-mode", choices=("absent", "empty"), default=None, help="masked files read as absent (default) or empty"),
    Arg("--env-allow", action="append", default=[], metavar="NAME", help="pass variables matching NAME (glob) despite the block list"),
    Arg("--env-block", action="append", default=[], metavar="NAME", help="remove variables matching NAME (glob)"),
    Arg("--exec-allow", action="append", default=None, metavar="DIR",
        help="only binaries under DIR may run (Landlock execute right; repeatable)"),
    Arg("--deny-command", action="append", default=[], metavar="'CMD ARGS'",
        help="refuse a top-level command by argv prefix, e.g. 'git push' (advisory)"),
)

NETWORK = Group(
    "network",
    Arg("--net", default=None, choices=("none", "allow", "host"), keep=True,
        help="none (the default: own network namespace, lo only), allow (only the hosts the policy allows, "
             "through a proxy) or host (the host's network); default: [network] mode, else none"),
    Arg("--allow-host", dest="allow_hosts", action="append", default=[], metavar="HOST[:PORT]", keep=True,
        help="with --net allow: also allow HOST (a name, *.domain, an IP address or CIDR, or @pypi, @npm, "
             "@github, @debian); repeatable"),
    Arg("--forward", action="append", default=[], metavar="PORT", keep=True,
        help="let the sandbox reach the host's localhost:PORT (with --net none or allow); repeatable"),
)

RUN_ARGS: tuple[Arg | Group, ...] = (
    Arg("--project", "-p", default=".", metavar="DIR", keep=True, help="project directory (default: .)"),
    Arg("--session", "-s", metavar="NAME", keep=True, help="reuse or create the named session"),
    Arg("--cwd", metavar="DIR", keep=True, help="working directory inside the project"),
    Arg("--root", action="store_true", keep=True, help="appear as uid 0 inside (keeping chown/setuid capabilities in its own namespace where a range of ids is mapped)"),
    Arg("--user", type=_natural("a uid such as 1000"), metavar="UID", help="(real root only) run as this uid instead of the project's owner"),
    Arg("--pass-fd", type=_natural("an open file descriptor number such as 3"), action="append", default=[], metavar="N",
        help="pass file descriptor N through"),
    Arg("--seccomp", default="default", metavar="NAME|PATH", keep=True, help="seccomp profile (default, strict, permissive, a JSON file, or off)"),
    Arg("--observe", dest="observe", action="store_const", const=True, default=None,
        help="log every exec, every open outside the project and every connect/send target the command tries "
             "(seccomp user notification; `stockade log --observed`); default: [audit] observe. "
             "An observed call can fail with EINTR in a program whose signal handlers lack SA_RESTART "
             "(README: Observe mode)"),
    Arg("--no-observe", dest="observe", action="store_const", const=False, help="override a configured [audit] observe = true"),
    Arg("--no-landlock", action="store_true", help="do not apply Landlock (needs --allow-degraded landlock)"),
    Arg("--allow-degraded", action="append", default=[], metavar="WHAT",
        help="run without a layer the kernel or a container refuses: landlock, seccomp, limits, proc, hostname"),
    Arg("--no-wait", action="store_true", keep=True, help="fail instead of waiting when the session is busy"),
    NETWORK,
    LIMITS,
    POLICY,
    Arg("command", nargs=REMAINDER, help="-- CMD [ARGS...]"),
)

# start and warm: the run options but the command (and a name, an idle timeout)
START_ARGS: tuple[Arg | Group, ...] = tuple(a for a in RUN_ARGS if not (isinstance(a, Arg) and a.flags == ("command",)))
_LIVE_NAME = Arg("name", nargs="?", default=None, metavar="NAME", help="the sandbox (default: the only one running)")

_JSON = Arg("--json", action="store_true")
_SESSION = Arg("-s", "--session", help="the session (default: the latest)")
_CHANGES = Arg("args", nargs="*", metavar="[SESSION] [PATHSPEC]")
# SUPPRESS: never clobber a --project the top-level parser may define
_PROJECT = Arg("--project", default=SUPPRESS, metavar="DIR", help="the project directory (default: the current directory)")
_POLICY_SESSION = Arg("--session", "-s", default=None, metavar="S",
                      help="session whose policy.json to use (default: the project's latest, if any)")


def _changes(name: str, help: str, fn: str, *args: Arg | Group) -> Verb:
    return Verb(name, help, Handler("changes", fn), *args, description=help)


VERBS: tuple[Verb, ...] = (
    # run, explain, shell
    Verb("run", "run a command in a sandbox over the project", Handler("run", "cmd_run"), *RUN_ARGS),
    Verb("explain", "print the plan a run would execute", Handler("run", "cmd_explain"), *RUN_ARGS),
    Verb("shell", "an interactive shell in the sandbox (a pty relayed to your terminal)", Handler("run", "cmd_shell"), *RUN_ARGS),
    # living sandboxes
    Verb("start", "start a living sandbox over a session; run commands in it with `stockade exec`",
         Handler("live", "cmd_start"),
         Arg("--name", "-n", default=None, metavar="NAME", help="its name (= its session's; default: a new session)"),
         Arg("--idle-timeout", dest="idle_timeout", default=None, metavar="TIME",
             help="stop it after this long with no command running (default: [live] idle_timeout, else 30m; 'none')"),
         Arg("--json", action="store_true", help="print its record as JSON"),
         Arg("command", nargs=REMAINDER, help=SUPPRESS_HELP),
         *START_ARGS),
    Verb("exec", "run a command in a living sandbox (same namespaces, mounts, confinement, limits)",
         Handler("live", "cmd_exec"),
         Arg("name", metavar="NAME", help="the sandbox (`stockade ps` lists them)"),
         Arg("--cwd", metavar="DIR", help="working directory inside the project"),
         Arg("--env", action="append", default=[], metavar="K=V", help="set a variable for this command"),
         Arg("--timeout", metavar="TIME", default=None, help="SIGTERM, a grace period, SIGKILL after TIME (exit 124); "
             "never longer than the sandbox's own limit"),
         Arg("-i", "--interactive", action="store_true", help="keep stdin connected (default: /dev/null)"),
         Arg("-t", "--tty", action="store_true", help="a pty of the sandbox's own, relayed to this terminal"),
         Arg("--pass-fd", type=_natural("an open file descriptor number such as 3"), action="append", default=[],
             metavar="N", help="pass file descriptor N through"),
         Arg("command", nargs=REMAINDER, help="-- CMD [ARGS...]")),
    Verb("logs", "the output of a living sandbox's commands", Handler("live", "cmd_logs"), _LIVE_NAME,
         Arg("--follow", "-f", action="store_true", help="keep printing until the sandbox ends")),
    Verb("stop", "stop a living sandbox (processes ended, overlay unmounted, changes kept)",
         Handler("live", "cmd_stop"), _LIVE_NAME,
         Arg("--timeout", metavar="TIME", default=None, help="grace between SIGTERM and SIGKILL (default 2s)"),
         Arg("--json", action="store_true")),
    Verb("ps", "the living sandboxes and their state", Handler("live", "cmd_ps"),
         Arg("--all", "-a", action="store_true", help="also stopped and failed ones"), Arg("--json", action="store_true")),
    Verb("warm", "keep a sandbox ready for a project; the next start or run with the same options takes it",
         Handler("live", "cmd_warm"),
         Arg("--ttl", default="300s", metavar="TIME", help="how long it waits to be claimed (default 300s)"),
         Arg("--json", action="store_true"),
         Arg("command", nargs=REMAINDER, help=SUPPRESS_HELP),
         *START_ARGS),
    # agents: an MCP server over stdio (`stockade.mcp`)
    Verb("mcp", "serve an agent over MCP (stdio): its tools run commands in a sandbox with these options",
         Handler("mcp", "cmd_mcp"),
         Arg("--max-output", dest="max_output", default=None, metavar="SIZE",
             help="cut each stream of a tool's result past SIZE, e.g. 64K (default: [mcp] max_output, else 64K)"),
         Arg("command", nargs=REMAINDER, help=SUPPRESS_HELP),
         *START_ARGS,
         description="An MCP server on stdin/stdout for agent clients (Claude Code, Codex...). The run options "
                     "given here (network, grants, limits, --session, --cwd) hold for every command the agent "
                     "runs; its tools choose only commands. Apply through it is off unless [mcp] allow_apply."),
    # change sets
    _changes("list", "sessions with project, age, runs, change counts, disk use", "cmd_list", _JSON),
    _changes("status", "the sessions with age, size and state; with S (or --latest) one session's changes and runs",
             "cmd_status", _SESSION, _CHANGES,
             Arg("--latest", action="store_true", help="the latest session's changes and runs"),
             Arg("--name-status", action="store_true", help="one 'X<TAB>path' line per change"), _JSON),
    _changes("diff", "git-style diff of a session's changes (git apply accepts it)", "cmd_diff", _SESSION, _CHANGES,
             Arg("--stat", action="store_true", help="a diffstat instead of the patch"), _JSON,
             Arg("--color", choices=("auto", "always", "never"), default="auto"),
             Arg("--risks", action="store_true", help="what deserves a second look before applying (with --json: JSON)")),
    _changes("apply", "apply a session's changes (all or part) to the project", "cmd_apply", _SESSION, _CHANGES,
             Arg("--exclude", action="append", metavar="PATHSPEC", default=[]),
             Arg("--dry-run", "-n", action="store_true", help="show what would be done"),
             Arg("--interactive", "-i", action="store_true", help="ask per path (y/n/d/a/q)"),
             Arg("--force", action="store_true", help="overwrite paths changed on the host since the session started"),
             Arg("--include-git", action="store_true",
                 help="also apply git metadata (objects, refs, index, logs, HEAD, worktree admin dirs) as one "
                      "group; hooks and config still only when named"),
             _JSON),
    _changes("rollback", "undo an apply, restoring exactly what it replaced", "cmd_rollback",
             Arg("apply_id", nargs="?", metavar="APPLY-ID", help="default: the latest apply"),
             Arg("--force", action="store_true", help="even if the applied paths changed since")),
    _changes("discard", "drop changes from a session (the project is untouched)", "cmd_discard", _SESSION, _CHANGES),
    _changes("clean", "remove a session, every session (--all) or the old ones (--older-than AGE)", "cmd_clean",
             Arg("session_name", nargs="?", metavar="SESSION",
                 help="default: the latest session of the project here (the current directory or one above it)"),
             Arg("--all", action="store_true"),
             Arg("--older-than", metavar="AGE", default=None,
                 help="sessions unused for AGE (30m, 12h, 7d, 2w; 0s: any age); not those with unapplied changes"),
             Arg("--include-unapplied", action="store_true",
                 help="with --older-than: also sessions whose changes were never applied"),
             Arg("--dry-run", "-n", action="store_true", help="list what would be removed; remove nothing"),
             _JSON),
    _changes("export", "write a CI artifact bundle (status.json, risks.json, logs, changes.patch, files/)", "cmd_export",
             _SESSION, Arg("args", nargs="+", metavar="[SESSION] DIR")),
    _changes("snapshot", "freeze, list, restore or delete snapshots of a session", "cmd_snapshot",
             Arg("action", choices=("create", "list", "restore", "delete")), Arg("name", nargs="?", metavar="NAME"),
             _SESSION, _JSON),
    _changes("fork", "start a new session on the same frozen layers", "cmd_fork", _SESSION,
             Arg("args", nargs="+", metavar="[SESSION] NEW")),
    _changes("recover", "finish or undo applies a crash interrupted", "cmd_recover"),
    Verb("review", "a session's change set as a local web page: approve, reject, edit, apply, roll back",
         Handler("review", "cmd_review"),
         Arg("session_name", nargs="?", default=None, metavar="SESSION", help="the session (default: the latest)"),
         Arg("--open", action="store_true", help="open the page in your browser"),
         Arg("--port", type=_natural("a port number such as 8080"), default=0, metavar="N",
             help="serve on 127.0.0.1:N (default: a free port)")),
    # policy
    Verb("policy", "show the effective policy and why a path is visible", None, sub_dest="policy_cmd", sub=(
        Verb("show", "effective rules with their source layer", Handler("policy", "cmd_policy_show"),
             _JSON, _PROJECT, _POLICY_SESSION, POLICY),
        Verb("why", "which rule decides a path (or --host HOST[:PORT]), from which layer", Handler("policy", "cmd_policy_why"),
             Arg("path", metavar="PATH", nargs="?", default=None),
             Arg("--host", default=None, metavar="HOST[:PORT]", help="which host rule decides HOST (port 443 unless given)"),
             _JSON, _PROJECT, _POLICY_SESSION, POLICY),
        Verb("env", "which of your environment variables would pass", Handler("policy", "cmd_policy_env"),
             _JSON, _PROJECT, _POLICY_SESSION, POLICY),
        Verb("suggest", "the config lines that would allow what observed runs were denied (never applied)",
             Handler("policy", "cmd_policy_suggest"),
             Arg("session_name", nargs="?", default=None, metavar="SESSION", help="the session (default: the latest)"),
             _JSON, _PROJECT),
    )),
    Verb("allow", "session-level: make a path visible, or a host reachable (next run; a running one's proxy too)",
         Handler("policy", "cmd_allow"),
         Arg("path", metavar="PATH", nargs="?", default=None), Arg("--rw", action="store_true", help="read-write (default read-only)"),
         Arg("--host", default=None, metavar="HOST[:PORT]", help="allow a host for --net allow (a name, *.domain, IP, CIDR, @preset)"),
         Arg("--remove", action="store_true", help="remove the session's rule for PATH (or --host)"),
         Arg("--list", dest="list_rules", action="store_true", help="the session's path and host rules"),
         Arg("--json", action="store_true", help="with --list: machine-readable"),
         _PROJECT, _POLICY_SESSION),
    Verb("deny", "session-level: hide a path, or refuse a host (beats allows)", Handler("policy", "cmd_deny"),
         Arg("path", metavar="PATH", nargs="?", default=None),
         Arg("--host", default=None, metavar="HOST[:PORT]", help="refuse a host for --net allow (deny wins)"),
         Arg("--remove", action="store_true", help="remove the session's rule for PATH (or --host)"),
         _PROJECT, _POLICY_SESSION),
    # the audit log
    Verb("log", "a session's audit log", Handler("log", "cmd_log"),
         Arg("session_name", nargs="?", default=None, metavar="S"), Arg("--blocked-only", action="store_true"),
         Arg("--net", action="store_true", help="only network events (connections, DNS names, the network rule)"),
         Arg("--json", action="store_true", help="raw JSON lines"),
         Arg("--follow", "-f", action="store_true", help="keep printing new events"),
         Arg("--observed", action="store_true",
             help="what observe mode saw (`run --observe`), grouped: programs run, paths denied and why, hosts tried"),
         Arg("--summary", action="store_true", help="with --observed: counts and the top entries only"),
         Arg("--run", dest="run_no", type=_natural("a run number such as 2"), default=None, metavar="N",
             help="with --observed: only run N"),
         Arg("--project", default=SUPPRESS, metavar="DIR")),
    # doctor
    Verb("doctor", "probe the kernel features stockade needs", Handler("doctor", "cmd_doctor"), _JSON,
         Arg("--apparmor", action="store_true", help="print the AppArmor profile that allows user namespaces"),
         Arg("--refresh", action="store_true", help="ignore the cached probe results"),
         Arg("--no-self-test", dest="self_test", action="store_false", help="skip the live sandbox self-test")),
    # seccomp profiles
    Verb("profiles", "list the seccomp profiles (--seccomp NAME|PATH)", Handler("profiles", "cmd_profiles"),
         Arg("--check", metavar="NAME|PATH", help="compile and validate a profile, print its digest"),
         Arg("--json", action="store_true", help="machine-readable output"),
         description="List the built-in seccomp profiles with a one-line description, "
                     "or compile and check a profile (a name or a path to an OCI-style JSON file)."),
)
BY_NAME = {v.name: v for v in VERBS}
FAST_VERBS = ("run",)  # the verbs whose speed matters: read without argparse when they can be


# --------------------------------------------------------------------------- argparse


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every verb; with ``only``, every verb is listed but only that one
    gets its options (what parsing its command line needs, in a fifth of the time)."""
    import argparse
    import re
    import sys

    class Parser(argparse.ArgumentParser):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            # "-5M", "-1s": a value (then refused by its option with a clear message), never
            # an unknown option; argparse only takes "-5" and "-1.5" so (no option starts with a digit)
            self._negative_number_matcher = re.compile(r"^-\.?\d")

        def error(self, message: str) -> Any:  # one line, exit 2
            sys.stderr.write(f"stockade: {message} (see `{self.prog} --help`)\n")
            raise SystemExit(2)

    def own(a: Arg) -> dict[str, Any]:
        # argparse tells SUPPRESS and REMAINDER by identity: its own objects, not equal strings
        kw = dict(a.kw)
        if kw.get("default") == SUPPRESS:
            kw["default"] = argparse.SUPPRESS
        if kw.get("help") == SUPPRESS:
            kw["help"] = argparse.SUPPRESS
        if kw.get("nargs") == REMAINDER:
            kw["nargs"] = argparse.REMAINDER
        return kw

    def add(sub: Any, v: Verb, full: bool = True) -> None:
        kw: dict[str, Any] = {"help": v.help}
        if v.description is not None:
            kw["description"] = v.description
        p = sub.add_parser(v.name, **kw)
        if not full:
            return
        for a in v.args:
            if isinstance(a, Group):
                g = p.add_argument_group(a.title)
                for x in a.args:
                    g.add_argument(*x.flags, **own(x))
            else:
                p.add_argument(*a.flags, **own(a))
        if v.sub:
            s = p.add_subparsers(dest=v.sub_dest, metavar="{" + ",".join(x.name for x in v.sub) + "}")
            s.required = True
            for w in v.sub:
                add(s, w)
        if v.handler is not None:
            p.set_defaults(func=v.handler)

    parser = Parser(prog="stockade", description="Run untrusted commands in a Linux sandbox; review their writes as a change set.")
    parser.add_argument("--version", action="version", version=VERSION)
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND", parser_class=Parser)
    for v in VERBS:
        add(sub, v, only is None or only == v.name)
    return parser


def parse(argv: list[str]) -> Args:
    """``argv`` as argparse reads it (it exits with status 2 on a bad one)."""
    verb = next((w for w in argv if not w.startswith("-")), None)  # the top level takes no values
    args: Args = build_parser(verb if verb in BY_NAME else None).parse_args(argv, namespace=Args())
    return args


# --------------------------------------------------------------------------- the fast path


def _options(v: Verb) -> dict[str, Arg]:
    return {f: a for a in v.all_args() for f in a.flags if f.startswith("-")}


def _defaults(v: Verb) -> dict[str, Any]:
    """What argparse puts in the namespace for options not given (the first of a dest)."""
    ns: dict[str, Any] = {"verb": v.name, "func": v.handler}
    for a in v.all_args():
        if a.flags[0].startswith("-") and a.dest not in ns and a.default != SUPPRESS:
            ns[a.dest] = a.default
    return ns


_FAST: dict[str, tuple[dict[str, Arg], dict[str, Any]]] = {}


def fast_parse(argv: list[str]) -> Args | None:
    """``VERB [options] [--] CMD...`` for a verb of ``FAST_VERBS``, read as argparse
    would read it; None for anything else (argparse decides that)."""
    if len(argv) < 2 or argv[0] not in FAST_VERBS:
        return None
    verb = BY_NAME[argv[0]]
    known = _FAST.get(verb.name)
    if known is None:
        known = _FAST[verb.name] = (_options(verb), _defaults(verb))
    opts = known[0]
    ns = {k: list(v) if isinstance(v, list) else v for k, v in known[1].items()}
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "--" or word == "-" or not word.startswith("-"):
            ns["command"] = argv[i:]  # argparse.REMAINDER: "--" included
            break
        name, eq, val = word.partition("=") if word.startswith("--") else (word, "", "")
        arg = opts.get(name)
        if arg is None:
            return None
        action = arg.kw.get("action", "store")
        i += 1
        if action in ("store_true", "store_false", "store_const"):
            if eq:
                return None
            ns[arg.dest] = arg.kw["const"] if action == "store_const" else action == "store_true"
            continue
        if action not in ("store", "append") or "nargs" in arg.kw:
            return None
        if not eq:
            if i >= len(argv) or argv[i].startswith("-"):
                return None
            val = argv[i]
            i += 1
        value: Any = val
        conv = arg.kw.get("type")
        if conv is not None:
            try:
                value = conv(val)
            except Exception:  # argparse says how it is wrong
                return None
        choices = arg.kw.get("choices")
        if choices is not None and value not in choices:
            return None
        if action == "append":
            ns[arg.dest] = [*(ns[arg.dest] or ()), value]
        else:
            ns[arg.dest] = value
    cmd = ns.get("command") or []
    if not (cmd[1:] if cmd[:1] == ["--"] else cmd):
        return None  # no command: argparse's path says so
    return Args(**ns)


def keepable(args: Args, verb: str = "run") -> bool:
    """Whether every option given is one a stored prepared run may stand for (``Arg.keep``)."""
    for a in BY_NAME[verb].all_args():
        if not a.keep and a.flags[0].startswith("-") and getattr(args, a.dest, a.default) != a.default:
            return False
    return True
