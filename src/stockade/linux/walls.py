"""Walls a container engine can keep a sandbox from building, probed only when the
caller allows a run without them (``--allow-degraded proc`` / ``hostname``).

A probe makes the sandbox's own call (a new procfs; sethostname) in a throwaway
child with new namespaces (``sk_probe``, about 0.5 ms), once per process and pair
of user and mount namespaces: an engine's options do not change while it runs.
Without the option nothing is probed: the run fails at that step, and
linux/remedies.py names the engine option that fixes it.
"""

from __future__ import annotations

import errno as _errno
import os

PROC = "proc"
HOSTNAME = "hostname"
WALLS = (PROC, HOSTNAME)

_CACHE: dict[tuple[str, int, int], int] = {}


def ns_key() -> tuple[int, int]:
    """This process's user and mount namespaces: what a probe's answer holds for."""
    try:
        return os.stat("/proc/self/ns/user").st_ino, os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return 0, 0


def refused(what: str) -> int:
    """0 when a sandbox can build ``what`` here, else the errno its probe got."""
    key = (what, *ns_key())
    hit = _CACHE.get(key)
    if hit is None:
        from .._native import lib

        r = lib.sk_probe(lib.SK_PROBE_PROC if what == PROC else lib.SK_PROBE_HOSTNAME)
        # no namespaces at all (r < 0): not a wall to drop; the run itself fails and says why
        hit = max(int(r), 0)
        _CACHE[key] = hit
    return hit


def degraded(allowed: frozenset[str] | set[str]) -> list[str]:
    """The run summary's entries for the allowed walls this environment refuses;
    each starts with the wall's name (plan.build reads it)."""
    out: list[str] = []
    if PROC in allowed and (e := refused(PROC)):
        out.append(f"proc (a new procfs is refused here: {_errno.errorcode.get(e, e)}; /proc is empty inside: "
                   "no process is visible, not even the sandbox's own)")
    if HOSTNAME in allowed and (e := refused(HOSTNAME)):
        out.append(f"hostname (sethostname is refused here: {_errno.errorcode.get(e, e)}; the sandbox's own UTS "
                   f"namespace keeps this one's hostname, {os.uname().nodename!r})")
    return out


def clear_cache() -> None:
    _CACHE.clear()
