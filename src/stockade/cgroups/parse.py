"""Parsing of limit values (CLI flags and config), with one-line errors.

Sizes: ``512M``, ``1.5G``, ``1024``, ``64k``, ``2GiB``, ``1gb``: K/M/G/T are powers
of 1024 whatever the spelling (like docker and systemd), a bare number is bytes.
Durations: ``30s``, ``1.5m``, ``500ms``, ``2h``, ``1d``; a bare number is seconds.
``none``/``unlimited``/``max`` remove a limit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from stockade.cgroups.base import (
    ACCEPTED_FORM,
    FLAG_FOR,
    LIMIT_NAMES,
    MIN_CPUS,
    MIN_DISK,
    MIN_NOFILE,
    MIN_PIDS,
    Limits,
    MiB,
)
from stockade.errors import UsageError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*(?:([kmgt])(?:i?b?)|(b))?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_DUR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DUR_MULT = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_INT_RE = re.compile(r"^\s*\d+\s*$")
_NONE_WORDS = frozenset({"none", "unlimited", "max", "infinity"})

#: Sizes above this are refused (the kernel's "max" is 2^63 - page).
MAX_SIZE = 2**62


def parse_size(text: str) -> int | None:
    """Bytes, or None if ``text`` is not a size. ``1.5G`` -> 1610612736."""
    m = _SIZE_RE.match(text)
    if not m:
        return None
    number, unit = m.group(1), (m.group(2) or "").lower()
    value = float(number) * _SIZE_MULT[unit]
    if not math.isfinite(value) or value > MAX_SIZE:
        return None
    if "." in number and value != int(value):
        value = math.floor(value)
    return int(value)


def parse_duration(text: str) -> float | None:
    """Seconds, or None if ``text`` is not a duration. ``1.5m`` -> 90.0."""
    m = _DUR_RE.match(text)
    if not m:
        return None
    unit = m.group(2).lower() if m.group(2) else None
    value = float(m.group(1)) * _DUR_MULT[unit]
    if not math.isfinite(value):
        return None
    return value


def _error(name: str, raw: object, source: str) -> UsageError:
    where = FLAG_FOR[name] if source == "flag" else f"{source}: limits.{name.replace('_', '-')}"
    return UsageError(f"{where}: invalid value {raw!r}: expected {ACCEPTED_FORM[name]}")


def parse_limit(name: str, raw: object, *, source: str = "flag") -> int | float | None:
    """Parse one limit value (a CLI string or a config number/string).

    Returns the value in bytes / seconds / count, or None for "no limit"; raises a
    one-line ``UsageError`` naming the flag (or ``source`` key) and the accepted form.
    """
    if name not in LIMIT_NAMES:
        raise UsageError(f"unknown limit {name!r}: expected one of {', '.join(LIMIT_NAMES)}")
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise _error(name, raw, source)
    if isinstance(raw, str) and raw.strip().lower() in _NONE_WORDS:
        return None

    value: int | float | None
    if name in ("memory", "max_file_size", "disk", "disk_floor"):
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, str):
            value = parse_size(raw)
        else:
            value = None
        if value is None or value < 0:
            raise _error(name, raw, source)
        if name == "memory" and value < MiB:
            raise _error(name, raw, source)
        if name == "disk" and value < MIN_DISK:
            raise _error(name, raw, source)
        return value
    if name in ("timeout", "cpu_time"):
        if isinstance(raw, int | float):
            value = float(raw)
        elif isinstance(raw, str):
            value = parse_duration(raw)
        else:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            raise _error(name, raw, source)
        return value
    if name == "cpus":
        try:
            value = float(raw) if isinstance(raw, int | float | str) else None
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < MIN_CPUS:
            raise _error(name, raw, source)
        return value
    # pids, nofile: integers
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, str) and _INT_RE.match(raw):
        value = int(raw)
    else:
        raise _error(name, raw, source)
    minimum = MIN_PIDS if name == "pids" else MIN_NOFILE
    if value < minimum or value > 2**31 - 1:
        raise _error(name, raw, source)
    return value


def limits_from_mapping(data: Mapping[str, object], *, base: Limits | None = None, source: str = "config") -> Limits:
    """Build limits from a config mapping (values as numbers or CLI-style strings).

    Unknown keys and malformed values raise ``UsageError`` naming ``source`` and key.
    """
    out = base if base is not None else Limits()
    changes: dict[str, Any] = {}
    for key, raw in data.items():
        name = key.replace("-", "_")
        if name not in LIMIT_NAMES:
            raise UsageError(
                f"{source}: unknown limit {key!r}: expected one of "
                + ", ".join(n.replace("_", "-") for n in LIMIT_NAMES)
            )
        changes[name] = parse_limit(name, raw, source=source)
    return out.replace(**changes)
