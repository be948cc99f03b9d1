"""The limit options of `run`, `explain` and `shell` (``--memory --cpus --pids --timeout
--cpu-time --max-file-size --nofile``, declared in ``cli.table``) made ``Limits``.

``limits_from_args(args)`` lays them over the defaults (or a base from config), raising
one-line ``UsageError``s that name the flag and the accepted form. Every flag also takes
``none`` to lift a default limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..cgroups.base import LIMIT_NAMES, Limits

if TYPE_CHECKING:
    from .table import Args


def requested_limits(args: Args) -> set[str]:
    """Names of the limits given explicitly on the command line."""
    return {n for n in LIMIT_NAMES if getattr(args, n, None) is not None}


def limits_from_args(args: Args, base: Limits | None = None) -> Limits:
    """``Limits`` from parsed flags over ``base`` (default ``Limits.defaults()``)."""
    from ..cgroups.parse import parse_limit

    changes: dict[str, int | float | None] = {}
    for name in LIMIT_NAMES:
        raw = getattr(args, name, None)
        if raw is not None:
            changes[name] = parse_limit(name, raw, source="flag")
    out = base if base is not None else Limits.defaults()
    return out.replace(**changes) if changes else out
