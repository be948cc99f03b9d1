"""Ages as people write them (``30m``, ``12h``, ``7d``, ``2w``): ``stockade clean
--older-than`` and the config's ``[sessions] keep``."""

from __future__ import annotations

import re

from ..errors import UsageError

DURATION_FORMS = "a number and a unit: 30s, 30m, 12h, 7d or 2w (0s: any age)"
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_AGE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", re.ASCII | re.IGNORECASE)


def parse_age(raw: str, what: str = "--older-than") -> float:
    """Seconds; else a one-line UsageError naming ``what``, the value and the accepted forms."""
    m = _AGE_RE.fullmatch(raw)
    if m is None:
        raise UsageError(f"{what}: invalid duration {raw!r}: expected {DURATION_FORMS}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]
