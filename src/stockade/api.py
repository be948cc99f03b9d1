"""Python API: ``stockade.run`` (subprocess.run-compatible) and ``Sandbox`` (a session).

A thin face on the core run path (``stockade.core``): the keywords become a
``RunRequest`` (what to run, and how confined) and a ``RunIO`` (its streams).
Safe to call from many threads at once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import plan as planmod
from .core.request import DEVNULL, PIPE, STDOUT, RunIO, RunRequest
from .core.result import RunResult
from .errors import UsageError
from .session import store

if TYPE_CHECKING:
    from .changes.retention import Outcome, SessionInfo
    from .changes.scan import ChangeSet
    from .live import Channel, LivePopen

__all__ = ["DEVNULL", "PIPE", "STDOUT", "RunResult", "Sandbox", "clean", "run", "sessions"]

# the keywords that are the run's I/O (RunIO); every other one is the request's
_IO = frozenset({"input", "stdin", "stdout", "stderr", "capture_output", "text", "encoding", "errors", "check",
                 "quiet", "forward_signals", "pty"})


def _split(args: Sequence[str] | str, project: str | os.PathLike[str], session: str | None,
           kwargs: dict[str, Any]) -> tuple[RunRequest, RunIO]:
    io = {k: v for k, v in kwargs.items() if k in _IO}
    opts = {k: v for k, v in kwargs.items() if k not in _IO}
    return RunRequest(args, project=project, session=session, **opts), RunIO(**io)


class Sandbox:
    """A session: successive runs stack their writes in one upper layer.

    ``with Sandbox("proj") as sb: sb.run(["make"]); sb.changes().diff()``

    ``persistent=True``: a living sandbox, started once; ``sb.exec`` (and ``sb.run``)
    runs each command in it at the cost of a fork, ``sb.popen`` gives a ``Popen``-like
    handle, background processes live on between commands. It ends with ``close`` (or
    the ``with`` block), or when this process exits; with ``detached=True`` it outlives
    this process and ends after ``idle_timeout`` seconds with nothing running (``None``:
    the config's ``[live] idle_timeout``, else 30 minutes). ``Sandbox.attach(name)``
    reaches one started elsewhere (``stockade start``)."""

    def __init__(self, project: str | os.PathLike[str] = ".", session: str | None = None, *,
                 persistent: bool = False, detached: bool = False, idle_timeout: float | None = None,
                 **options: Any) -> None:
        self.project = planmod.resolve_project(project)
        self.options = options
        self.persistent = persistent
        self._chan: Channel | None = None
        self._owns = False
        if not persistent:
            if detached or idle_timeout is not None:
                raise UsageError("detached and idle_timeout apply to a living sandbox: pass persistent=True")
            self.session = store.open_or_create(self.project, session)
            return
        from . import live

        bad = sorted(k for k in options if k in _IO or k in ("args", "pass_fds"))
        if bad:
            raise UsageError(f"Sandbox(persistent=True): {', '.join(bad)} belong to each exec, not to the sandbox")
        if options.get("observe"):
            from .core.observe import LIVE_REFUSED

            raise UsageError(LIVE_REFUSED)
        # [audit] observe is for one-shot runs
        req = RunRequest(("true",), project=project, **{**options, "observe": False})
        spec = live.StartSpec(req, name=session, detached=detached, idle=idle_timeout,
                              owner_pid=None if detached else os.getpid())
        lv = live.start(spec)
        self._chan = live.Channel(lv)
        self._owns = True
        self.session = store.open_session(lv.id)
        if not detached:
            import atexit

            atexit.register(self.close)

    @classmethod
    def attach(cls, name: str) -> Sandbox:
        """The running living sandbox ``name`` (``stockade start``); ``close`` leaves it running."""
        from . import live
        from .live import registry

        lv = registry.running(name)
        sb = cls.__new__(cls)
        sb.project = planmod.resolve_project(str(lv.data.get("project") or "."))
        sb.options = {}
        sb.persistent = True
        sb._chan = live.Channel(lv)
        sb._owns = False
        sb.session = store.open_session(lv.id)
        return sb

    @property
    def id(self) -> str:
        return self.session.id

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """A living sandbox this object started is stopped (its changes stay); the cgroups
        kept for later runs are removed (also done at interpreter exit)."""
        from .cgroups.base import flush_deferred

        chan, self._chan = self._chan, None
        if chan is not None:
            chan.close()
            if self._owns:
                self.stop_sandbox(chan)
        flush_deferred()

    def stop_sandbox(self, chan: Channel | None = None, timeout: float | None = None) -> dict[str, Any]:
        from . import live
        from .live import registry

        lv = registry.read(self.session.id)
        if lv is None:
            return {}
        return live.stop(lv, timeout)

    def _living(self) -> Channel:
        if self._chan is None:
            raise UsageError(f"sandbox {self.session.id!r} is not a living one (persistent=True), or it was closed")
        return self._chan

    def run(self, args: Sequence[str] | str, **kwargs: Any) -> RunResult:
        if self.persistent:
            return self.exec(args, **kwargs)
        from .core.execute import execute_in

        req, io = _split(args, self.project, self.session.id, {**self.options, **kwargs})
        return execute_in(self.session, req, io)

    def exec(self, args: Sequence[str] | str, *, env: Mapping[str, str] | None = None,
             cwd: str | os.PathLike[str] | None = None, timeout: float | None = None, shell: bool = False,
             pass_fds: Sequence[int] = (), **io: Any) -> RunResult:
        """One command in the living sandbox, ``subprocess.run``-style (``input``,
        ``capture_output``, ``text``, ``check``, ``timeout`` ...). Thread-safe."""
        bad = sorted(k for k in io if k not in _IO)
        if bad:
            raise UsageError(f"exec: {', '.join(bad)}: not an option of a command (the sandbox's policy, "
                             "network and limits are fixed when it starts)")
        return self._living().exec(args, io=RunIO(**io), env=env, cwd=cwd, timeout=timeout, shell=shell,
                                   pass_fds=pass_fds)

    def popen(self, args: Sequence[str] | str, **kwargs: Any) -> LivePopen:
        """A ``subprocess.Popen``-like handle on a command in the living sandbox."""
        return self._living().popen(args, **kwargs)

    def status(self) -> dict[str, Any]:
        """The living sandbox's status (``stockade status NAME --json``'s schema; CPU use
        over the last second or two)."""
        res = self._living().request("status")["status"]
        assert isinstance(res, dict)
        return res

    def snapshot(self, name: str = "") -> str:
        """Freeze the living sandbox, copy its layer into snapshot ``name``, thaw it."""
        return str(self._living().request("snapshot", timeout=600, name=name)["snapshot"])

    def changes(self) -> ChangeSet:
        from .changes.scan import scan

        return scan(self.session)


def run(
    args: Sequence[str] | str,
    *,
    project: str | os.PathLike[str] = ".",
    session: str | None = None,
    **kwargs: Any,
) -> RunResult:
    """Run ``args`` sandboxed, like ``subprocess.run``; the result also has ``.session``.

    Network: ``network="none"`` (the default unless the config's ``[network] mode``
    says otherwise), ``"allow"`` (only the hosts the policy allows, through a proxy:
    ``allow_hosts=["pypi.org", "@github"]`` adds to the config's) or ``"host"``;
    ``forward=[5432]`` lets the sandbox reach the host's ``localhost:5432``. Bad values
    raise ``UsageError`` before anything runs."""
    from .core.execute import execute

    # a new session each call: the next one's directories are made while this sandbox starts
    req, io = _split(args, project, session, {**kwargs, "session_ahead": session is None})
    if session is None and os.environ.get("STOCKADE_PREWARM", "1") != "0":
        from .live.registry import warm_waiting

        if warm_waiting():  # a pre-warmed sandbox of these options: the speed-up, above the core
            from .live import run_claimed

            res: RunResult | None = run_claimed(req, io)
            if res is not None:
                return res
    return execute(req, io)


def sessions() -> list[SessionInfo]:
    """Every session with its state (running, idle, locked, has-changes, applied, empty,
    project-gone, unreadable), age since last use (seconds), size on disk and change
    counts: ``stockade status``."""
    from .changes.retention import list_infos

    return list_infos()


def clean(older_than: str | float | None = None, *, include_unapplied: bool = False,
          dry_run: bool = False) -> list[Outcome]:
    """Remove the sessions unused for ``older_than`` (``"7d"``, ``"12h"``, ``"0s"`` or
    seconds; None: the config's ``[sessions] keep``, else 7 days): ``stockade clean
    --older-than``. A session in use is never removed, one with unapplied changes only
    with ``include_unapplied``. Returns each removed (``dry_run``: would-remove) and
    skipped session with the reason."""
    from .changes import retention

    if older_than is None:
        age = retention.keep_setting()
        if age is None:
            return []  # [sessions] keep = "never"
    elif isinstance(older_than, str):
        age = retention.parse_age(older_than, "older_than")
    elif isinstance(older_than, bool) or not isinstance(older_than, int | float) or not older_than >= 0:
        raise UsageError(f"older_than: invalid value {older_than!r}: expected seconds (>= 0) or a duration "
                         f"({retention.DURATION_FORMS})")
    else:
        age = float(older_than)
    return retention.clean(age, include_unapplied=include_unapplied, dry_run=dry_run)
