"""Whether a process still lives, as the kernel sees it.

A process that exited stays a zombie until its parent reaps it. An orphan's new
parent is the namespace's init, and some inits (a container's shell, a VM's agent)
reap late or never: a zombie has left its cgroups and closed its files, so it counts
as gone here.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (another user's counts)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # /proc hides it (hidepid): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat.rpartition(b")")[2].split(None, 1)[0] not in (b"Z", b"X")
