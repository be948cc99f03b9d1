"""Accounting without cgroups (the "none" backend), from the supervisor's side.

``stats_from_rusage``: ``os.wait4`` on the sandbox's init returns the rusage of the
init plus every descendant it reaped, and the init reaps the whole tree, so the
CPU time is exact for the tree. ``ru_maxrss`` is the largest single process's
peak RSS, a lower bound of the tree's peak (said in ``source``).

``TreeMemorySampler``: optional psutil sampling of the tree's summed RSS, for a
closer peak when the supervisor polls anyway (e.g. every 100 ms while waiting).
"""

from __future__ import annotations

import resource
from typing import Any

from stockade.cgroups.base import CgroupStats


def stats_from_rusage(ru: resource.struct_rusage) -> CgroupStats:
    return CgroupStats(
        peak_memory=int(ru.ru_maxrss) * 1024,  # Linux reports KiB
        cpu_time=float(ru.ru_utime + ru.ru_stime),
        source="rusage",
    )


class TreeMemorySampler:
    """Peak of the summed RSS of a process and its descendants, sampled."""

    def __init__(self, pid: int) -> None:
        import psutil  # lazy: not on the run path unless asked for

        self._psutil: Any = psutil
        self.pid = pid
        self.peak = 0
        try:
            self._root: Any = psutil.Process(pid)
        except psutil.Error:
            self._root = None

    def sample(self) -> int:
        """Current summed RSS in bytes (0 once the tree is gone); updates ``peak``."""
        if self._root is None:
            return 0
        total = 0
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except self._psutil.Error:
            return 0
        for p in procs:
            try:
                total += int(p.memory_info().rss)
            except self._psutil.Error:
                continue
        self.peak = max(self.peak, total)
        return total

    def stats(self) -> CgroupStats:
        return CgroupStats(peak_memory=self.peak or None, source="psutil")
