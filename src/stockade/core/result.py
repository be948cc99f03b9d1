"""``RunResult``: what a run returns, to the API and the CLI alike: a
``subprocess.CompletedProcess`` plus what stockade knows about the run."""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..cgroups.base import Manager
    from ..linux.native import Report


class RunResult(subprocess.CompletedProcess[Any]):
    """A CompletedProcess plus the run's session, number, outcome and degradations."""

    def __init__(
        self,
        args: Any,
        returncode: int,
        stdout: Any = None,
        stderr: Any = None,
        *,
        session: str = "",
        run: int = 0,
        outcome: str = "",
        outcome_kind: str = "",
        peak_memory: int | None = None,
        cpu_time: float | None = None,
        degraded: tuple[str, ...] = (),
        exec_failed: Report | None = None,
        cg_manager: Manager | None = None,
        network: str | None = None,
        disk: str | None = None,
    ) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.session = session
        self.run = run
        self.outcome = outcome
        self.outcome_kind = outcome_kind
        self.peak_memory = peak_memory
        self.cpu_time = cpu_time
        self.degraded = degraded
        self.exec_failed = exec_failed  # the command could not be executed: its path and errno
        self.cg_manager = cg_manager  # the cgroup backend the run used
        self.network = network  # --net allow: what the proxy blocked, one line (None: nothing)
        # the run made an anonymous session and changed nothing: the session is gone (changes/retention.py)
        self.session_removed = False
        # the disk cap or floor: what ended the run (outcome_kind "disk-limit-hit") or a
        # tmpfs it filled (ENOSPC) and survived, e.g. "disk limit 10G: /tmp"; None: neither
        self.disk = disk

    @property
    def exit_status(self) -> int:
        """The shell-style status: the code, or 128+N when killed by signal N."""
        return self.returncode if self.returncode >= 0 else 128 - self.returncode
