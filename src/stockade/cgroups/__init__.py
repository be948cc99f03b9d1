"""Resource limits: cgroup v2 / v1 / hybrid / none backends, rlimits, outcomes.

Public surface (see ``base.py``): ``Limits``, ``CgroupStats``, ``Outcome``,
``classify``, ``rlimits_for``, ``Manager``, ``RunCgroup``, and ``detect()``.
Backend modules are imported lazily so that importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stockade.cgroups.base import (
    CgroupStats,
    Limits,
    Manager,
    Outcome,
    RunCgroup,
    check_enforceable,
    classify,
    degraded_limits,
    rlimits_for,
)

if TYPE_CHECKING:  # pragma: no cover
    from stockade.cgroups.detect import detect as detect

__all__ = [
    "CgroupStats",
    "Limits",
    "Manager",
    "Outcome",
    "RunCgroup",
    "check_enforceable",
    "classify",
    "degraded_limits",
    "detect",
    "rlimits_for",
]


def __getattr__(name: str) -> Any:
    if name == "detect":
        from stockade.cgroups.detect import detect

        return detect
    raise AttributeError(name)
