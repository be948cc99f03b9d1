"""CLI helpers for resource limits (the lead's ``cli.py`` calls these).

``add_limit_arguments(parser)`` adds ``--memory --cpus --pids --timeout --cpu-time
--max-file-size --nofile``; ``limits_from_args(args)`` turns them into ``Limits``
over the defaults (or a base from config), raising one-line ``UsageError``s that
name the flag and the accepted form. Every flag also takes ``none`` to lift a
default limit.
"""

from __future__ import annotations

import argparse

from stockade.cgroups.base import ACCEPTED_FORM, FLAG_FOR, LIMIT_NAMES, Limits

_HELP = {
    "memory": "memory limit, e.g. 512M or 2G (swap is disabled); default: half the RAM",
    "cpus": "CPU bandwidth in CPUs, e.g. 0.5 or 1.5; default: no limit",
    "pids": "maximum number of tasks in the sandbox; default: 1024",
    "timeout": "wall-clock limit, e.g. 30s, 5m; on expiry SIGTERM, a grace period, SIGKILL (exit 124)",
    "cpu_time": "CPU time limit per process, e.g. 60s (SIGXCPU, then SIGKILL)",
    "max_file_size": "largest file the command may write, e.g. 1G",
    "nofile": "open files per process; default: 4096",
}


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("resource limits ('none' lifts a limit)")
    for name in LIMIT_NAMES:
        group.add_argument(
            FLAG_FOR[name],
            dest=name,
            metavar=name.split("_")[-1].upper() if name != "max_file_size" else "SIZE",
            default=None,
            help=_HELP[name],
        )


def requested_limits(args: argparse.Namespace) -> set[str]:
    """Names of the limits given explicitly on the command line."""
    return {n for n in LIMIT_NAMES if getattr(args, n, None) is not None}


def limits_from_args(args: argparse.Namespace, base: Limits | None = None) -> Limits:
    """``Limits`` from parsed flags over ``base`` (default ``Limits.defaults()``)."""
    from stockade.cgroups.parse import parse_limit

    changes: dict[str, int | float | None] = {}
    for name in LIMIT_NAMES:
        raw = getattr(args, name, None)
        if raw is not None:
            changes[name] = parse_limit(name, raw, source="flag")
    out = base if base is not None else Limits.defaults()
    return out.replace(**changes) if changes else out


__all__ = [
    "ACCEPTED_FORM",
    "add_limit_arguments",
    "limits_from_args",
    "requested_limits",
]
