"""One MCP session's state and what each tool does with it, without MCP.

A ``Workspace`` has one stockade session (made by the first command, or the one
``stockade mcp --session`` names) and at most one living sandbox over it (started by
``start`` or the first ``exec``, stopped by ``stop``, by what needs the session free —
``restore``, ``discard``, ``apply`` — and when the client goes). ``run`` is a one-shot
run of the core in the same session. The sandbox's options are the server's
(``Options.request``: its command line and the config tiers); a tool chooses only the
command, its working directory inside the project, variables the policy lets through,
stdin and a timeout under the sandbox's own. Every method returns a ``Reply`` whose
text names the session, or raises a ``StockadeError`` (one line: what was wrong and
how to fix it).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import plan as planmod
from ..core.request import DEVNULL, RunIO, RunRequest
from ..errors import SessionBusy, SessionNotFound, StockadeError, UsageError
from ..live.client import LiveError
from ..session import store
from . import output

if TYPE_CHECKING:
    from ..api import Sandbox
    from ..changes.scan import ChangeSet
    from ..core.result import RunResult
    from ..core.supervise import Supervisor
    from ..live import Channel
    from ..policy import Effective

# RunRequest fields that are the sandbox's options (what the server was started with);
# the rest belong to each command or to the server itself
_NOT_OPTIONS = frozenset({"args", "project", "session", "shell", "pass_fds", "no_wait", "session_ahead", "env",
                          "timeout"})


@dataclass(frozen=True)
class Options:
    """The server's command line: the sandbox's options (``request``: a RunRequest whose
    command is a placeholder), the session to use, the output cap (None: the config's)."""

    request: RunRequest
    session: str | None = None
    max_output: int | None = None


@dataclass
class Reply:
    """A tool's answer: ``text`` for the agent, ``data`` the same as JSON."""

    text: str
    data: dict[str, Any] = field(default_factory=dict)


class Call:
    """One tool call's commands: ``cancel`` ends them (the client cancelled the request,
    or went), now or as soon as they start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sups: list[Supervisor] = []
        self.cancelled = False

    def add(self, sup: Supervisor) -> None:
        with self._lock:
            self._sups.append(sup)
            if self.cancelled:
                sup.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            for sup in self._sups:
                sup.cancel()


class Workspace:
    """The session and living sandbox of one MCP client. Thread-safe: the server runs
    each tool call in a worker thread; starting, stopping and what needs the session
    free are serialised, execs run side by side."""

    def __init__(self, opts: Options) -> None:
        req = opts.request
        if req.pass_fds:
            raise UsageError("stockade mcp: --pass-fd has no meaning for a server (its tools take no descriptors)")
        self.opts = opts
        self.project = planmod.resolve_project(req.project)
        self.cwd = planmod.resolve_cwd(self.project, req.cwd) if req.cwd is not None else self.project
        self.options: dict[str, Any] = {f.name: getattr(req, f.name) for f in fields(req)
                                        if f.name not in _NOT_OPTIONS}
        self.options["cwd"] = str(self.cwd)
        self.session_id: str | None = None
        if opts.session is not None:
            store.validate_name(opts.session)
            self.session_id = opts.session
            sess = self._session_or_none()
            if sess is not None and sess.project != self.project:
                raise UsageError(f"--session {opts.session!r} belongs to project {sess.project}, not {self.project}; "
                                 f"pass --project {sess.project} or another --session name")
        self.sandbox: Sandbox | None = None
        self._chan: Channel | None = None
        self._life = threading.Lock()
        self._execs: set[Supervisor] = set()  # the commands running: cancelled when the client goes
        self._execs_lock = threading.Lock()
        self.closed = False
        self.policy()  # a bad config is the server's start-up error, not the first tool's

    # ------------------------------------------------------------------ helpers

    def policy(self) -> Effective:
        """The merged policy (config tiers, the server's flags), read again each time:
        an edited config file counts from the next call on."""
        from ..core.prepare import load_policy

        sess = self._session_or_none()
        return load_policy(self.project, sess, self.opts.request.policy, None, self.opts.request)

    def max_output(self) -> int:
        return self.opts.max_output if self.opts.max_output is not None else self.policy().mcp_max_output

    def _session_or_none(self) -> store.Session | None:
        if self.session_id is None:
            return None
        try:
            return store.open_session(self.session_id)
        except SessionNotFound:
            return None

    def session(self, what: str) -> store.Session:
        sess = self._session_or_none()
        if sess is None:
            raise UsageError(f"{what}: this server has no session yet (nothing has run); "
                             "run a command first with the exec or run tool")
        return sess

    def _head(self) -> str:
        return f"session {self.session_id}" if self.session_id else "no session yet"

    def living(self) -> bool:
        sb = self.sandbox
        if sb is None:
            return False
        from ..live import registry

        lv = registry.read(sb.id)
        return lv is not None and lv.status == "running" and lv.holder_alive()

    def _cwd(self, cwd: str | None) -> str:
        """A tool's cwd: a directory of the project (relative to its root, or absolute inside it)."""
        if cwd is None:
            return str(self.cwd)
        c = Path(cwd)
        if not c.is_absolute():
            c = self.project / c
        try:
            c = c.resolve(strict=True)
        except OSError:
            raise UsageError(f"cwd {cwd!r}: no such directory in the project {self.project} (a directory made "
                             "inside the sandbox is not one yet: use `cd DIR && CMD` in the command)") from None
        if c != self.project and self.project not in c.parents:
            raise UsageError(f"cwd {cwd!r} is outside the project {self.project}; give a directory inside it, "
                             "relative to the project root")
        if not c.is_dir():
            raise UsageError(f"cwd {cwd!r} is not a directory")
        return str(c)

    def _timeout(self, timeout: float | None) -> float | None:
        """A tool's timeout under the sandbox's own (the server's --timeout, the config's
        limits.timeout): the API's timeout replaces that limit for a run, so it is capped here."""
        req = self.opts.request
        requested = set(req.requested_limits) if req.requested_limits is not None else None
        lim, _ = self.policy().limits_over(req.limits, requested)
        cap = lim.timeout if lim is not None else None
        if timeout is None or cap is None:
            return timeout if cap is None else cap
        return min(float(timeout), float(cap))

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        """Variables a tool adds: each checked by the policy's environment rules (a name it
        blocks, a value that looks like a token, a name the config sets: refused)."""
        if not env:
            return {}
        from ..policy.env import EnvFilter

        pol = self.policy()
        f = pol.env_filter()
        check = EnvFilter(f.allow, f.block, inherit="all", filter_values=f.filter_values)
        for name, value in env.items():
            if not name or "=" in name or "\0" in name or "\0" in value:
                raise UsageError(f"env {name!r}: not a variable name (no '=' or NUL; values no NUL)")
            if name in f.set_values:
                raise UsageError(f"env {name!r}: set by the policy ({f.set_values[name][1]}); a tool call cannot "
                                 "change it")
            d = check.decide(name, value)
            if not d.passed:
                raise UsageError(f"env {name!r}: refused by the policy's environment rules ({d.reason}); "
                                 "leave it out")
        return dict(env)

    # ------------------------------------------------------------------ the living sandbox

    def _sandbox(self, check: bool = True) -> Sandbox:
        """The living sandbox, started when there is none (the first exec, or start).
        ``check=False``: the one this server started is taken as running (an exec finds
        out otherwise, and the next call starts a new one)."""
        with self._life:
            if self.closed:
                raise UsageError("the server is shutting down")
            if self.sandbox is not None and (not check or self.living()):
                return self.sandbox
            if self.sandbox is not None:  # it ended (stopped from outside, its holder killed): a new one
                self._drop_sandbox()
            import stockade

            self.sandbox = stockade.Sandbox(self.project, session=self.session_id, persistent=True, **self.options)
            self.session_id = self.sandbox.id
            from ..live import Channel, registry

            self._chan = Channel(registry.running(self.sandbox.id))  # one connection for every exec
            return self.sandbox

    def _drop_sandbox(self) -> None:
        sb, chan, self.sandbox, self._chan = self.sandbox, self._chan, None, None
        if chan is not None:
            chan.close()
        if sb is not None:
            sb.close()

    def _stop_sandbox(self, grace: float | None = None) -> bool:
        """Stop the living sandbox if one runs (its changes stay). Called under ``_life``."""
        was = self.living()
        sb = self.sandbox
        if sb is None:
            return False
        try:
            if was:
                sb.stop_sandbox(timeout=grace)
        finally:
            self._drop_sandbox()
        return was

    def start(self) -> Reply:
        was = self.living()
        sb = self._sandbox()
        st = sb.status()
        lines = [f"{self._head()}: the living sandbox is {'already ' if was else ''}running "
                 f"(network {st.get('network')}, project {self.project}); exec runs commands in it"]
        return Reply("\n".join(lines), {"session": self.session_id, "started": not was, "sandbox": _brief(st)})

    def stop(self) -> Reply:
        with self._life:
            was = self._stop_sandbox()
        if not was:
            return Reply(f"{self._head()}: no living sandbox was running", {"session": self.session_id,
                                                                              "stopped": False})
        return Reply(f"{self._head()}: the living sandbox stopped (its processes ended); its changes stay for "
                     f"review: {self._counts_phrase()}", {"session": self.session_id, "stopped": True})

    def close(self, grace: float = 0.5) -> None:
        """The client went: in-flight execs cancelled, the sandbox stopped (its session stays)."""
        with self._execs_lock:
            for sup in list(self._execs):
                sup.cancel()
        with self._life:
            self.closed = True
            try:
                self._stop_sandbox(grace)
            except StockadeError:
                pass

    # ------------------------------------------------------------------ commands

    def exec(self, command: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None,
             timeout: float | None = None, stdin: str | None = None, call: Call | None = None) -> Reply:
        wd, extra = self._cwd(cwd), self._env(env)
        self._sandbox(check=False)
        chan = self._chan
        assert chan is not None

        out, err = output.Sink(), output.Sink()
        sups: list[Supervisor] = []
        t0 = time.monotonic()
        try:
            io = self._io(stdin, out, err, sups, call)
            try:
                res = chan.exec(command, io=io, env=extra, cwd=wd, timeout=timeout, shell=True)
            except subprocess.TimeoutExpired as e:
                got = getattr(e, "result", None)
                if got is None:
                    raise
                res = got
            except LiveError as e:
                if self.living():
                    raise
                with self._life:
                    if self._chan is chan:
                        self._drop_sandbox()
                raise LiveError(f"{e.one_line()}; the living sandbox had ended (stopped from outside?): call exec "
                                "again to start a new one over the same files") from None
            return self._command_reply("exec", command, res, out, err, time.monotonic() - t0)
        finally:
            self._done(sups)
            out.close()
            err.close()

    def _io(self, stdin: str | None, out: output.Sink, err: output.Sink, sups: list[Supervisor],
            call: Call | None) -> RunIO:
        """A command's streams (stdin given or /dev/null; stdout and stderr to files), and
        its supervisor kept once it runs: cancellable from there on (the request
        cancelled, the client gone)."""

        def started(sup: Supervisor) -> None:
            with self._execs_lock:
                sups.append(sup)
                self._execs.add(sup)
            if call is not None:
                call.add(sup)

        return RunIO(stdin=DEVNULL if stdin is None else None, input=stdin, stdout=out.fd, stderr=err.fd,
                     on_start=started)

    def _done(self, sups: list[Supervisor]) -> None:
        with self._execs_lock:
            for sup in sups:
                self._execs.discard(sup)

    def run(self, command: str, *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float | None = None, stdin: str | None = None, call: Call | None = None) -> Reply:
        wd, extra = self._cwd(cwd), self._env(env)
        timeout = self._timeout(timeout)
        if self.living():
            raise SessionBusy(f"run: session {self.session_id} has a living sandbox (started by exec or start); "
                              "use exec to run the command there, or call stop first (its changes stay)")
        from ..core.execute import execute

        out, err = output.Sink(), output.Sink()
        sups: list[Supervisor] = []
        t0 = time.monotonic()
        opts = {**self.options, "cwd": wd}
        try:
            # the core's run path, as stockade.run takes it (a pre-warmed sandbox is not
            # claimed: its supervisor would not be this server's to cancel)
            req = RunRequest(command, project=self.project, session=self.session_id, shell=True, env=extra or None,
                             timeout=timeout, **opts)
            try:
                res = execute(req, self._io(stdin, out, err, sups, call))
            except SessionBusy as e:
                raise SessionBusy(f"run: {e.one_line()}") from None
            except subprocess.TimeoutExpired as e:
                got = getattr(e, "result", None)
                if got is None:
                    raise
                res = got
            self.session_id = res.session
            return self._command_reply("run", command, res, out, err, time.monotonic() - t0)
        finally:
            self._done(sups)
            out.close()
            err.close()

    def _command_reply(self, verb: str, command: str, res: RunResult, out: output.Sink, err: output.Sink,
                       secs: float) -> Reply:
        self.session_id = res.session or self.session_id
        sid = self.session_id
        cap = self.max_output()
        where = f"the session keeps a copy in {store.sessions_dir() / str(sid) / 'runs' / str(res.run)}"
        so = out.read(cap, "stdout", where)
        se = err.read(cap, "stderr", where)
        status = 124 if res.outcome_kind == "timeout" else res.returncode
        head = f"exit status {status} ({res.outcome}) · session {sid}, run {res.run} · {secs:.2f} s"
        ef = res.exec_failed
        if ef is not None:
            import errno as _e

            why = "command not found" if ef.err in (_e.ENOENT, _e.ENOTDIR) else f"cannot execute: {os.strerror(ef.err)}"
            head += f" · {ef.path}: {why}"
        parts = [head]
        for name, s in (("stdout", so), ("stderr", se)):
            if s.size:
                parts.append(f"--- {name} ---\n{s.text}" + ("" if s.text.endswith("\n") else "\n"))
        if not so.size and not se.size:
            parts.append("(no output)")
        data = {"session": sid, "run": res.run, "kind": verb, "command": command, "exit_status": status,
                "outcome": res.outcome, "outcome_kind": res.outcome_kind, "seconds": round(secs, 4),
                "stdout": so.to_json(), "stderr": se.to_json()}
        return Reply("\n".join(parts).rstrip("\n"), data)

    # ------------------------------------------------------------------ change sets

    def _changes(self, what: str) -> ChangeSet:
        from ..changes.scan import scan

        return scan(self.session(what))

    def _counts_phrase(self) -> str:
        sess = self._session_or_none()
        if sess is None:
            return "no changes"
        from ..changes.scan import scan

        return scan(sess, classify=False).counts().phrase()

    def status(self) -> Reply:
        sess = self._session_or_none()
        data: dict[str, Any] = {"session": self.session_id, "project": str(self.project),
                                "sandbox": "running" if self.living() else "not running",
                                "apply_allowed": self.policy().mcp_allow_apply}
        lines = [f"{self._head()} · project {self.project} · living sandbox: {data['sandbox']}"]
        if self.sandbox is not None and data["sandbox"] == "running":
            st = self.sandbox.status()
            data["sandbox_status"] = _brief(st)
            res = st.get("resources") or {}
            lines.append(f"sandbox: network {st.get('network')}, {res.get('processes', '?')} processes, "
                         f"{res.get('memory_used', '?')} memory, {st.get('execs', 0)} execs")
        if sess is None:
            lines.append("nothing has run yet: the first exec (or run) makes the session")
            return Reply("\n".join(lines), data)
        from ..changes import snapshot

        cs = self._changes("status")
        counts = cs.counts()
        data["counts"] = {"added": counts.added, "modified": counts.modified, "deleted": counts.deleted,
                          "refused": counts.refused}
        data["changes"] = cs.changes_json()
        runs = sess.runs()
        data["runs"] = [_run_brief(r) for r in runs]
        data["snapshots"] = [s.name for s in snapshot.list_snapshots(sess)]
        lines.append(f"changes: {counts.phrase()}")
        for c in cs.changes[:200]:
            lines.append(f"  {c.letter} {c.path}")
        if len(cs.changes) > 200:
            lines.append(f"  ... {len(cs.changes) - 200} more (the diff tool with stat=true lists them all)")
        if runs:
            lines.append("runs (latest last):")
            for r in data["runs"][-20:]:
                code = "-" if r.get("exit_status") is None else r.get("exit_status")
                lines.append(f"  {r['run']:>3} {r.get('kind') or 'run':<7} exit {code!s:<4} {r.get('command') or ''}")
        if data["snapshots"]:
            lines.append("snapshots: " + ", ".join(data["snapshots"]))
        lines.append(f"review: `stockade diff {self.session_id}`; apply: "
                     + ("the apply tool" if data["apply_allowed"] else f"a person, `stockade apply -s {self.session_id}`"))
        return Reply("\n".join(lines), data)

    def diff(self, paths: Sequence[str] = (), stat: bool = False) -> Reply:
        cs = self._changes("diff")
        sel = cs.select(list(paths) or None)
        from ..changes.diff import render_diff, render_stat

        body = render_stat(cs, sel) if stat else render_diff(cs, sel).decode("utf-8", "replace")
        text, omitted = output.cut(body, self.max_output(), "the diff",
                                   "ask for fewer paths (paths=[...]), or stat=true for the list")
        held = cs.held_back(sel)
        data: dict[str, Any] = {"session": self.session_id, "paths": list(paths), "stat": stat,
                                "counts": cs.counts().phrase(), "changes": cs.changes_json(sel),
                                "omitted_bytes": omitted, "held_back": held}
        lines = [f"session {self.session_id}: {len(sel)} change(s) shown of {cs.counts().phrase()}"]
        lines.append(text.rstrip("\n") if text.strip() else "(no textual diff)")
        if held:
            lines.append(f"held back: never applied by the apply tool, a person applies them after review ({len(held)}):")
            lines += [f"  {p}: {why}" for p, why in held.items()]
        from ..changes.risks import counts, format_risks, summary

        risks = cs.risks(list(paths) or None)  # what deserves a second look (diff --risks's rules)
        data["risks"] = [r.to_json() for r in risks]
        data["risk_counts"] = counts(risks)
        lines.append(f"risks: {summary(risks)}" + (" (worth a second look before applying):" if risks else ""))
        if risks:
            lines.append(format_risks(risks).rstrip("\n"))
        return Reply("\n".join(lines), data)

    def snapshot(self, name: str = "") -> Reply:
        if self.living():
            assert self.sandbox is not None
            got = self.sandbox.snapshot(name)
            return Reply(f"session {self.session_id}: snapshot {got} taken of the running sandbox; "
                         f"restore it with the restore tool", {"session": self.session_id, "snapshot": got})
        from ..changes import snapshot

        sess = self.session("snapshot")
        snap = snapshot.create(sess, name or time.strftime("mcp-%Y%m%d-%H%M%S", time.gmtime()))
        return Reply(f"session {sess.id}: snapshot {snap.name} taken; restore it with the restore tool",
                     {"session": sess.id, "snapshot": snap.name})

    def _free(self, verb: str, act: Callable[[store.Session], Reply]) -> Reply:
        """``act`` with the session free: this server's living sandbox is stopped first."""
        with self._life:
            sess = self.session(verb)
            stopped = self._stop_sandbox()
            reply = act(sess)
        if stopped:
            reply.text += ("\n(the living sandbox was stopped first, as this needs the session free; its "
                           "processes ended; the next exec starts a new one over these files)")
            reply.data["sandbox_stopped"] = True
        return reply

    def restore(self, name: str) -> Reply:
        from ..changes import snapshot

        def act(sess: store.Session) -> Reply:
            dropped = snapshot.restore(sess, name)
            return Reply(f"session {sess.id}: restored to snapshot {name}"
                         + (f" (later snapshots dropped: {', '.join(dropped)})" if dropped else "")
                         + f"; changes now: {self._counts_phrase()}",
                         {"session": sess.id, "snapshot": name, "dropped": dropped})

        return self._free("restore", act)

    def discard(self, paths: Sequence[str] = ()) -> Reply:
        def act(sess: store.Session) -> Reply:
            from ..changes.scan import scan

            cs = scan(sess, classify=False)
            if not cs.changes:
                raise UsageError(f"discard: session {sess.id} has no changes to discard")
            dropped = cs.discard(list(paths) or None)
            return Reply(f"session {sess.id}: discarded {len(dropped)} change(s); the project is untouched; "
                         f"changes now: {self._counts_phrase()}", {"session": sess.id, "discarded": dropped})

        return self._free("discard", act)

    def apply(self, paths: Sequence[str] = ()) -> Reply:
        """Apply the change set (``paths`` select) when ``[mcp] allow_apply`` (global config
        only) is on, else answer with a person's command. The agent is untrusted: a held-back
        path (hooks, CI, .envrc, policy files, git metadata) is never applied, even named."""
        sess = self.session("apply")
        pol = self.policy()
        spec = "".join(" " + shlex.quote(p) for p in paths)
        if not pol.mcp_allow_apply:
            cmd = f"stockade apply -s {sess.id}{spec}"
            review = f"stockade review {sess.id}"
            return Reply(
                f"session {sess.id}: not applied. Applying is for a person after review (this server has "
                f"[mcp] allow_apply off). Tell the user to review the changes with `{review}` (the review page) "
                f"or `stockade diff {sess.id}`, and apply them with:\n  {cmd}",
                {"session": sess.id, "applied": False, "gated": True, "apply_command": cmd,
                 "review_command": review})

        def act(s: store.Session) -> Reply:
            from ..changes.scan import scan

            # the agent's paths only select: held-back paths (hooks, CI, .envrc, policy files,
            # git metadata) never apply through here, named or not; the engine decides it again
            # under the apply's lock on exactly what it writes
            res = scan(s).apply(list(paths) or None, never_held=True)
            lines = [f"session {s.id}: applied {len(res.applied)} path(s) to {self.project} (apply {res.apply_id}); "
                     f"a person undoes it with `stockade rollback {res.apply_id}`"]
            lines += [f"  {p}" for p in res.applied]
            if res.why_held:
                held_cmd = f"stockade apply -s {s.id}" + "".join(" " + shlex.quote(p) for p in res.why_held)
                lines.append(f"held back ({len(res.why_held)}): a person applies these after review: "
                             f"`{held_cmd}` or `stockade review {s.id}`:")
                lines += [f"  {p}: {why}" for p, why in res.why_held.items()]
            if res.refused:
                lines.append(f"refused (fifos, sockets, devices, masked secrets): {', '.join(res.refused)}")
            return Reply("\n".join(lines), {"session": s.id, "applied": True, **res.to_json()})

        return self._free("apply", act)


def _brief(st: Mapping[str, Any]) -> dict[str, Any]:
    res = st.get("resources") or {}
    return {"id": st.get("id"), "status": st.get("status"), "network": st.get("network"),
            "execs": st.get("execs"), "limits": st.get("limits"),
            "memory_used": res.get("memory_used"), "processes": res.get("processes")}


def _run_brief(r: Mapping[str, Any]) -> dict[str, Any]:
    argv = r.get("argv") or r.get("args") or []
    cmd = argv[-1] if isinstance(argv, list) and argv[:2] == ["/bin/sh", "-c"] else (
        " ".join(argv) if isinstance(argv, list) else str(argv))
    if r.get("status") == "incomplete":  # no record yet: the living sandbox itself, or a run in flight or killed
        return {"run": r.get("run"), "kind": "running", "command": "(running, or ended without a record)",
                "exit_status": None, "outcome": "incomplete"}
    if r.get("kind") == "sandbox":
        cmd = "(the living sandbox)"
    return {"run": r.get("run"), "kind": r.get("kind") or "run", "command": cmd,
            "exit_status": r.get("exit_status", r.get("returncode")), "outcome": r.get("outcome") or r.get("status")}
