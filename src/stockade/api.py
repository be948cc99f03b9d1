"""Python API: ``stockade.run`` (subprocess.run-compatible) and ``Sandbox`` (a session).

A thin face on the core run path (``stockade.core``): the keywords become a
``RunRequest`` (what to run, and how confined) and a ``RunIO`` (its streams).
Safe to call from many threads at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import plan as planmod
from .core.request import DEVNULL, PIPE, STDOUT, RunIO, RunRequest
from .core.result import RunResult
from .session import store

if TYPE_CHECKING:
    from .changes.scan import ChangeSet

__all__ = ["DEVNULL", "PIPE", "STDOUT", "RunResult", "Sandbox", "run"]

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
    """

    def __init__(self, project: str | os.PathLike[str] = ".", session: str | None = None, **options: Any) -> None:
        self.project = planmod.resolve_project(project)
        self.session = store.open_or_create(self.project, session)
        self.options = options

    @property
    def id(self) -> str:
        return self.session.id

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the cgroups kept for later runs (also done at interpreter exit)."""
        from .cgroups.base import flush_deferred

        flush_deferred()

    def run(self, args: Sequence[str] | str, **kwargs: Any) -> RunResult:
        from .core.execute import execute_in

        req, io = _split(args, self.project, self.session.id, {**self.options, **kwargs})
        return execute_in(self.session, req, io)

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
    return execute(req, io)
