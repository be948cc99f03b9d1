"""`stockade explain`: build the plan a run would execute and print it (nothing runs)."""

from __future__ import annotations

from typing import Any


def explain(**kw: Any) -> str:
    from . import api

    return api.plan_for(**kw).describe()
