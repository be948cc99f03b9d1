"""`stockade explain`: build the plan a run would execute and print it (nothing runs)."""

from __future__ import annotations

from typing import Any


def explain(**kw: Any) -> str:
    """``kw``: a run's keywords (``RunRequest``'s fields)."""
    from .core.execute import explain_plan
    from .core.request import RunRequest

    prep = explain_plan(RunRequest(**kw))
    out = [prep.plan.describe()]
    from .cgroups.base import format_size

    mgr, lim = prep.cg_manager, prep.limits
    out.append(f"limits:      cgroup backend {mgr.kind}")
    for name, how in mgr.enforcement(lim).items():
        value = getattr(lim, name, None)
        if name in ("disk", "disk_floor") and value is not None:
            value = format_size(value)
        out.append(f"  {name:<14} {'-' if value is None else value!s:<14} {how}")
    if lim.disk is not None:
        from .core import diskwatch
        from .paths import state_dir

        tm = ", ".join(prep.plan.writable_tmpfs) or "none"
        out.append(f"  disk: {tm} capped at {format_size(prep.plan.tmpfs_size)} each (their sum and the layers: "
                   f"{format_size(lim.disk)}); {diskwatch.mechanism(str(state_dir()))}")
    net = prep.net
    if net is not None:
        out.append("network rules (checked by the proxy per connection; deny wins; session rules are re-read live):")
        out.extend(f"  {ln}" for ln in net.explain_lines())
    if prep.observe:
        out.append("observe:     on: every exec, open outside the project and connect/send target is logged "
                   "(seccomp user notification, answered CONTINUE; `stockade log --observed`)")
    return "\n".join(out)
