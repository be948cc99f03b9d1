"""Resource limits: cgroup v2 / v1 / hybrid / none backends, rlimits, outcomes.

Public surface (``base.py``; ``rlimits_for`` from ``rlimit.py``): ``Limits``, ``CgroupStats``, ``Outcome``,
``classify``, ``rlimits_for``, ``Manager``, ``RunCgroup``; the backend is chosen by
``stockade.cgroups.detect.detect()`` (imported on demand: backends stay off the
import path of code that only needs the data types).
"""

from __future__ import annotations

from stockade.cgroups.base import (
    CgroupStats,
    Limits,
    Manager,
    Outcome,
    RunCgroup,
    check_enforceable,
    classify,
    degraded_limits,
)
from stockade.cgroups.rlimit import rlimits_for

__all__ = [
    "CgroupStats",
    "Limits",
    "Manager",
    "Outcome",
    "RunCgroup",
    "check_enforceable",
    "classify",
    "degraded_limits",
    "rlimits_for",
]
