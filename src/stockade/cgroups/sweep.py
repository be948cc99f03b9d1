"""Removing run cgroups left behind by supervisors that were SIGKILLed.

Kept apart from ``detect`` so that the CLI can sweep with the manager its run used,
without importing every backend.
"""

from __future__ import annotations

import os

from stockade.linux.procs import pid_alive

TYPE_CHECKING = False
if TYPE_CHECKING:
    from stockade.cgroups.base import Manager
    from stockade.cgroups.fs import CgroupFS


def _is_run_dir(name: str, tag: str) -> int | None:
    """The creator pid of ``stockade-<name>-<pid>-<6 hex>-<tag>`` (``fs.run_dir_name``),
    or None: not a run cgroup, or one of another user or state dir (another tag, or
    none: made by an older stockade, whose owner cannot be told)."""
    if not name.startswith("stockade-"):
        return None
    name, _, owner = name.rpartition("-")
    if owner != tag:
        return None
    head, _, tail = name.rpartition("-")
    if len(tail) != 6 or not all(c in "0123456789abcdef" for c in tail):
        return None
    rest, _, pid = head.rpartition("-")
    if not pid.isdigit() or not pid.isascii() or len(rest) <= len("stockade-"):
        return None
    return int(pid)


def run_parents(manager: Manager) -> list[str]:
    """Directories under which ``manager`` creates run cgroups."""
    kind = getattr(manager, "kind", "")
    if kind == "v2":
        return [manager.parent]  # type: ignore[attr-defined]
    if kind == "v1":
        return sorted({h.own_dir for h in manager.hierarchies.values()})  # type: ignore[attr-defined]
    if kind == "hybrid":
        return run_parents(manager.v2) + run_parents(manager.v1)  # type: ignore[attr-defined]
    return []


def sweep_stale(manager: Manager, fs: CgroupFS | None = None, tag: str | None = None) -> list[str]:
    """Remove *empty* run cgroups whose creating process is gone (a supervisor that
    was SIGKILLed cannot clean up after itself), made by this user for this state
    dir only. Cgroups with tasks, or whose creator pid is alive (even if reused by
    another process), are left alone. Returns the removed paths; call it from
    ``stockade doctor`` or at start-up. ``tag``: another user's and state dir's
    (``fs.owner_tag``), e.g. a test's that removes what its state dir left."""
    from stockade.cgroups.fs import owner_tag

    parents = run_parents(manager)
    if not parents:
        return []
    tag = tag or owner_tag()
    if fs is None:
        from stockade.cgroups.fs import CgroupFS

        fs = CgroupFS()
    removed: list[str] = []
    for parent in parents:
        try:
            names = fs.subdirs(parent)
        except OSError:
            continue
        for name in names:
            pid = _is_run_dir(name, tag)
            if pid is None or pid_alive(pid):
                continue
            path = os.path.join(parent, name)
            try:
                fs.rmdir(path)  # EBUSY when tasks (or child cgroups) remain: keep it
            except OSError:
                continue
            removed.append(path)
    return removed
