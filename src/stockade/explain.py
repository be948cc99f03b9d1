"""`stockade explain`: build the plan a run would execute and print it (nothing runs)."""

from __future__ import annotations

import os
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
        from .paths import state_dir

        tm = ", ".join(prep.plan.writable_tmpfs) or "none"
        out.append(f"  disk: {tm} capped at {format_size(prep.plan.tmpfs_size)} each (their sum and the layers: "
                   f"{format_size(lim.disk)}); {disk_mechanism(str(state_dir()))}")
    net = prep.net
    if net is not None:
        out.append("network rules (checked by the proxy per connection; deny wins; session rules are re-read live):")
        out.extend(f"  {ln}" for ln in net.explain_lines())
    if prep.observe:
        out.append("observe:     on: every exec, open outside the project and connect/send target is logged "
                   "(seccomp user notification, answered CONTINUE; `stockade log --observed`)")
    return "\n".join(out)


def disk_mechanism(state: str, free: bool = True) -> str:
    """How this host holds --disk on the state dir ``state``, in one line (``explain``;
    ``doctor``, whose cached answer leaves out the free space): a project quota where
    ``linux.quota.probe`` says the filesystem and this process allow one, else the
    supervisor's watchdog."""
    return disk_mechanism_of(state, free)[0]


def disk_mechanism_of(state: str, free: bool = True) -> tuple[str, str]:
    """(the line, ``"project quota"`` or ``"watchdog"``)."""
    from .core import diskwatch
    from .linux import quota

    support = quota.probe(state)
    if isinstance(support, str):
        return diskwatch.mechanism(state, free, no_quota=support), "watchdog"
    refused = quota.refusal(support.fstype)
    line = (f"each writable tmpfs: the kernel's size= and nr_inodes=; the session's layers on {support.fstype} "
            f"at {support.mount_point}: a project quota per session (the kernel's {refused} at the cap), the "
            f"supervisor's watchdog beside it (the free-space floor, and the tmpfs and layers together)")
    if free:
        try:
            s = os.statvfs(state if os.path.exists(state) else support.mount_point)
            line += f", {diskwatch.size_text(s.f_bavail * s.f_frsize)} free of {diskwatch.size_text(s.f_blocks * s.f_frsize)}"
        except OSError:
            pass
    return line, "project quota"
