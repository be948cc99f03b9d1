"""Error tree. Every error names the operation, the path, the errno and a remedy.

``UsageError`` is bad input: the CLI prints its one-line message and exits 2.
``SandboxError`` is a failure setting up or running the sandbox.
"""

from __future__ import annotations

import errno as _errno
import os


class StockadeError(Exception):
    """Base of every error stockade raises on purpose."""

    exit_status = 2

    def one_line(self) -> str:
        return str(self).replace("\n", " ")


class UsageError(StockadeError):
    """Bad input: unknown option, malformed config, a path outside the project."""


class SandboxError(StockadeError):
    """A step of setting up or running the sandbox failed.

    Carries the step (operation), the path it acted on, the errno and a remedy,
    like runc's mountError.
    """

    def __init__(
        self,
        step: str,
        *,
        path: str | None = None,
        errno: int = 0,
        remedy: str | None = None,
        detail: str | None = None,
    ) -> None:
        self.step = step
        self.path = path
        self.errno = errno
        self.remedy = remedy
        self.detail = detail
        super().__init__(self._format())

    def _format(self) -> str:
        parts = [f"{self.step} failed"]
        if self.path:
            parts[0] += f" on {self.path}"
        if self.errno:
            name = _errno.errorcode.get(self.errno, str(self.errno))
            parts.append(f"{name}: {os.strerror(self.errno)}")
        if self.detail:
            parts.append(self.detail)
        msg = ": ".join(parts)
        if self.remedy:
            msg += f" (fix: {self.remedy})"
        return msg


class UnsupportedKernel(SandboxError):
    """A kernel feature the policy needs is missing; fail closed."""


class SessionBusy(StockadeError):
    """Another run holds the session's lock (and --no-wait was given)."""


class SessionNotFound(UsageError):
    """No session with that name or id."""


class ProjectGone(UsageError):
    """A session's project directory no longer exists (its changes can never be applied)."""


class PolicyError(UsageError):
    """Malformed or contradictory policy (config file, pattern, profile)."""
