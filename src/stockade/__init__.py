"""stockade: run untrusted commands in a Linux sandbox, review their writes as a change set."""

TYPE_CHECKING = False  # not typing's: importing typing costs the CLI milliseconds

__all__ = [
    "DEVNULL",
    "PIPE",
    "STDOUT",
    "PolicyError",
    "Sandbox",
    "SandboxError",
    "SessionBusy",
    "StockadeError",
    "UsageError",
    "clean",
    "run",
    "sessions",
]

if TYPE_CHECKING:
    from typing import Any

    from .api import DEVNULL, PIPE, STDOUT, Sandbox, clean, run, sessions
    from .errors import PolicyError, SandboxError, SessionBusy, StockadeError, UsageError


def __getattr__(name: str) -> "Any":  # quoted: no __future__ import (the CLI client imports this module)
    # Lazy: `import stockade` stays cheap; the API pulls in the native core on first use.
    if name in ("PolicyError", "SandboxError", "SessionBusy", "StockadeError", "UsageError"):
        from . import errors

        return getattr(errors, name)
    if name in ("Sandbox", "run", "RunResult", "PIPE", "STDOUT", "DEVNULL", "clean", "sessions"):
        from . import api

        return getattr(api, name)
    if name == "Limits":
        from .cgroups.base import Limits

        return Limits
    if name == "ChangeSet":
        from .changes.scan import ChangeSet

        return ChangeSet
    raise AttributeError(f"module 'stockade' has no attribute {name!r}")
