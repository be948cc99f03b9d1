"""The tools an agent sees: each one's typed arguments (a pydantic model: its JSON
schema is the tool's input schema, every other key refused), its description and
hints, and the ``Workspace`` method that does it.

What a tool may choose is only what a command is: the command line, its working
directory inside the project, variables the policy lets through, stdin, a timeout
under the sandbox's own. Grants, network modes, mounts and limits have no argument
anywhere here: they are the server's, given on ``stockade mcp``'s command line and in
the config by whoever registered it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .workspace import Call, Reply, Workspace

MAX_COMMAND = 128 * 1024  # characters of one command line
MAX_TIMEOUT = 7 * 24 * 3600.0


class Args(BaseModel):
    """No key beyond those declared (``additionalProperties: false``), no coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)


Command = Annotated[str, Field(
    min_length=1, max_length=MAX_COMMAND,
    description="A shell command line, run with /bin/sh -c inside the sandbox: pipes, &&, redirections, "
                "globs and `cd DIR && ...` work. Example: \"make test 2>&1 | tail -50\".")]
Cwd = Annotated[str | None, Field(
    default=None, max_length=4096,
    description="Working directory: a directory of the project, relative to its root (\"src\") or absolute "
                "inside it. Default: the project root (or the server's --cwd).")]
Env = Annotated[dict[str, str] | None, Field(
    default=None,
    description="Variables to add for this command only, e.g. {\"DEBUG\": \"1\"}. Names the policy blocks "
                "(secrets, tokens) or sets itself are refused.")]
Timeout = Annotated[float | None, Field(
    default=None, gt=0, le=MAX_TIMEOUT,
    description="Seconds before the command is stopped (SIGTERM, SIGKILL 2 s later; exit status 124). "
                "Never longer than the sandbox's own limit. Default: that limit (none unless the server has one).")]
Stdin = Annotated[str | None, Field(
    default=None, max_length=16 * 1024 * 1024,
    description="Text given to the command on its standard input. Default: none (/dev/null).")]
Paths = Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(
    default_factory=list, max_length=10000,
    description="Paths relative to the project root, directory prefixes, or globs (\"*.py\"). Default: all.")]


class CommandArgs(Args):
    command: Command
    cwd: Cwd = None
    env: Env = None
    timeout: Timeout = None
    stdin: Stdin = None


class NoArgs(Args):
    pass


class DiffArgs(Args):
    paths: Paths
    stat: Annotated[bool, Field(
        default=False, description="A diffstat (one line per file, lines added and removed) instead of the patch.")]


class SnapshotArgs(Args):
    name: Annotated[str, Field(
        default="", max_length=128,
        description="The snapshot's name (letters, digits, '.', '_', '-'). Default: one made from the time.")]


class RestoreArgs(Args):
    name: Annotated[str, Field(min_length=1, max_length=128,
                               description="The snapshot to go back to (the status tool lists them).")]


class PathsArgs(Args):
    paths: Paths


@dataclass(frozen=True)
class Tool:
    name: str
    title: str
    description: str
    args: type[Args]
    call: Callable[[Workspace, Any, Call], Reply]
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False


def _cmd(kind: str) -> Callable[[Workspace, Any, Call], Reply]:
    def call(ws: Workspace, a: CommandArgs, c: Call) -> Reply:
        fn = ws.exec if kind == "exec" else ws.run
        return fn(a.command, cwd=a.cwd, env=a.env, timeout=a.timeout, stdin=a.stdin, call=c)

    return call


_COMMON = ("Every write lands in the session's change set, never in the project: a person reviews it "
           "(`stockade diff SESSION`) and applies it. The result gives the exit status, stdout and stderr "
           "(each cut to the server's output cap, with a note) and the session id. The sandbox's network, "
           "visible paths and limits are fixed by the server; a command cannot change them.")

TOOLS: tuple[Tool, ...] = (
    Tool("exec", "Run a command in the living sandbox",
         "Run a shell command in this session's living sandbox (started on the first exec): files, processes "
         "left in the background and installed packages persist between execs, as in one shell. Use this "
         "for most work (build, test, edit with sed or scripts). " + _COMMON,
         CommandArgs, _cmd("exec")),
    Tool("run", "Run a command in a fresh one-shot sandbox",
         "Run a shell command in a fresh sandbox that ends with it (nothing it started stays running), in the "
         "same session, so its writes join the same change set. Use exec for a sequence of commands; run is "
         "refused while the living sandbox runs (call stop first). " + _COMMON,
         CommandArgs, _cmd("run")),
    Tool("start", "Start the living sandbox",
         "Start this session's living sandbox now (exec starts it on first use anyway). Says so if it already "
         "runs. Takes no arguments: its options are the server's.",
         NoArgs, lambda ws, a, c: ws.start(), idempotent=True),
    Tool("stop", "Stop the living sandbox",
         "Stop the living sandbox: every process in it ends (SIGTERM, then SIGKILL); the files it wrote stay "
         "in the session's change set for review. The next exec starts a new one over the same files.",
         NoArgs, lambda ws, a, c: ws.stop(), idempotent=True),
    Tool("status", "Session status",
         "The session id, whether the living sandbox runs (its network, processes, memory), the changed "
         "paths (A added, M modified, D deleted), the runs with their exit status, the snapshots, and how "
         "the changes get applied.",
         NoArgs, lambda ws, a, c: ws.status(), read_only=True, idempotent=True),
    Tool("diff", "Diff of the change set",
         "The session's changes as a git-style unified diff (or a diffstat with stat=true), for all paths or "
         "the given ones, with the paths held back from the apply tool and why, and the risks worth a second look.",
         DiffArgs, lambda ws, a, c: ws.diff(a.paths, a.stat), read_only=True, idempotent=True),
    Tool("snapshot", "Take a snapshot",
         "Save the session's files as they are now as a named snapshot (a restore point), also while the "
         "living sandbox runs.",
         SnapshotArgs, lambda ws, a, c: ws.snapshot(a.name)),
    Tool("restore", "Restore a snapshot",
         "Go back to a snapshot: the change set becomes what it was then (later snapshots are dropped). The "
         "living sandbox is stopped first (its processes end); the next exec starts a new one.",
         RestoreArgs, lambda ws, a, c: ws.restore(a.name), destructive=True),
    Tool("discard", "Discard changes",
         "Drop changes from the session (all, or the given paths); the project itself is never touched. The "
         "living sandbox is stopped first (its processes end).",
         PathsArgs, lambda ws, a, c: ws.discard(a.paths), destructive=True),
    Tool("apply", "Ask to apply the change set",
         "Apply the session's changes (all, or the given paths) to the real project. Off unless the person "
         "running the server turned it on ([mcp] allow_apply = true); otherwise it changes nothing and "
         "answers with the command a person runs after reviewing (`stockade apply -s SESSION`) and the review "
         "page's command: tell the user. paths only select: held-back paths (git hooks and metadata, CI "
         "config, .envrc, stockade policy files...) are never applied by this tool, named or not; the answer "
         "lists them with the command a person runs for them after review.",
         PathsArgs, lambda ws, a, c: ws.apply(a.paths), destructive=True),
)
BY_NAME = {t.name: t for t in TOOLS}


def schema(t: Tool) -> dict[str, Any]:
    """The tool's input schema: the model's JSON schema (``additionalProperties: false``)."""
    s = t.args.model_json_schema()
    s.pop("title", None)
    s.pop("description", None)
    s.setdefault("properties", {})
    return s


def parse(t: Tool, arguments: dict[str, Any] | None) -> Args:
    """The arguments checked against the tool's schema; a UsageError of one line naming
    each wrong argument and how to fix it."""
    try:
        return t.args.model_validate(arguments or {})
    except ValidationError as e:
        from ..errors import UsageError

        raise UsageError(explain(t, e)) from None


def explain(t: Tool, e: ValidationError) -> str:
    known = list(t.args.model_fields)
    takes = f"{t.name} takes {', '.join(known)}" if known else f"{t.name} takes no arguments"
    msgs: list[str] = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(arguments)"
        kind = err["type"]
        if kind == "extra_forbidden":
            msgs.append(f"unknown argument {loc!r}: {takes}. The sandbox's network, visible paths, mounts and "
                        "limits are set by whoever started `stockade mcp` (its options and config), never by a "
                        "tool call")
        elif kind == "missing":
            msgs.append(f"argument {loc!r} is required ({takes})")
        else:
            msgs.append(f"argument {loc!r}: {err['msg'].lower()}")
    return f"{t.name}: " + "; ".join(msgs)
