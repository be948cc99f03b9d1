"""Where stockade keeps its state. Builtins only: the CLI's fast path needs it before
anything else is imported."""

from __future__ import annotations

import os


def state_dir() -> str:
    """``$STOCKADE_STATE_DIR``, else ``$XDG_STATE_HOME/stockade``, else ``~/.local/state/stockade``.

    Always absolute (a relative value is taken from the working directory, ``~`` is
    expanded): the session's layers are handed to mounts made from other working
    directories (the sandbox's staging root), and a CLI server runs from /."""
    env = os.environ.get("STOCKADE_STATE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_STATE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.abspath(os.path.join(base, "stockade"))


# The process whose cgroup runs are placed under: this one, or the client a CLI
# server's supervisor serves (set in the forked supervisor, see stockade.fast.server).
CGROUP_OWNER: int | None = None


def proc_cgroup_path() -> str:
    return f"/proc/{CGROUP_OWNER or 'self'}/cgroup"
