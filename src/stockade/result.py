"""``RunResult``: what ``stockade.run`` returns, a ``subprocess.CompletedProcess``.

Apart from ``api`` so that the CLI, which does not need one, does not import
subprocess."""

from __future__ import annotations

import subprocess
from typing import Any

from .api import RunDetails


class RunResult(subprocess.CompletedProcess[Any], RunDetails):
    """A CompletedProcess plus what stockade knows about the run."""

    def __init__(self, args: Any, returncode: int, stdout: Any = None, stderr: Any = None) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self._init_details()
