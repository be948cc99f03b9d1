"""Network decisions made when a run starts (the plan's are in ``plan.tcp_wall``)."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
from typing import IO, Any

from .. import plan as planmod


def inet_socket(fd: int) -> bool:
    """Whether ``fd`` is an IPv4/IPv6 socket (of whatever network namespace made it)."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return s.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) in (socket.AF_INET, socket.AF_INET6)
    except OSError:
        return False
    finally:
        s.close()


def for_stdin(plan: planmod.Plan, stdin: int | IO[Any] | None, piped: bool) -> planmod.Plan:
    """The plan for a run whose stdin is ``stdin`` (None: this process's fd 0; ``piped``:
    stockade feeds it through a pipe of its own). An inet socket as stdin is the
    caller's network namespace inside the sandbox (bind/connect on it would reach the
    host's network): with network none, Landlock's TCP wall goes back up for that run."""
    ll = plan.landlock
    if piped or ll is None or ll.abi < 4 or ll.handled_net or plan.network != "none":
        return plan
    fd = 0 if stdin is None else stdin if isinstance(stdin, int) else stdin.fileno()
    if fd < 0 or not inet_socket(fd):
        return plan
    wall = dataclasses.replace(ll, handled_net=planmod.LL_NET_BIND_TCP | planmod.LL_NET_CONNECT_TCP)
    notes = tuple(planmod.tcp_note("none", True, ll.abi) if n.startswith("network none:") else n for n in plan.notes)
    return dataclasses.replace(plan, landlock=wall, notes=notes)
