"""What the sandbox sees of the host outside the project and the grants (system dirs,
the curated /etc, its own /proc and /dev), in policy's terms: which host paths a deny
can hide, and why a path there is or is not visible."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..sandbox_fs import (
    DEVICES,
    ETC_ALLOW,
    PROC_MASKED,
    PROC_MASKED_DIRS,
    PROC_READONLY,
    SYSTEM_DIRS,
    system_layout,
)
from .config import Item, Origin
from .rules import Decision, Rule, is_under

# /etc entries the runtime writes itself (resolv.conf: the host's with --net host, the
# proxy's DNS responder with --net allow, none with --net none)
ETC_MADE = ("passwd", "group", "hostname", "hosts", "resolv.conf")
# private in the sandbox: a host path beneath these is never what the sandbox sees there
OWN_MOUNTS = ("/dev/shm", "/dev/mqueue")


def sandbox_sees(p: str, etc_extra: Sequence[str] = ()) -> bool:
    """Whether the sandbox shows the host path ``p`` (resolved) outside the project and
    the grants: beneath a system dir or a curated /etc entry."""
    for d, link in system_layout():
        if link is None and is_under(p, d):
            return True
    if p == "/etc":
        return True
    if is_under(p, "/etc"):
        return any(is_under(p, "/etc/" + n) for n in (*ETC_MADE, *ETC_ALLOW)) or any(is_under(p, e) for e in etc_extra)
    return False


def deny_refusal(p: str) -> str | None:
    """Why a deny of ``p`` (resolved) cannot be honoured, or None.

    /proc and /dev inside are the sandbox's own (a new procfs, a minimal /dev): a host
    path there is not what the sandbox sees, so neither hiding it nor ``why`` could be
    right."""
    if any(is_under(p, o) for o in OWN_MOUNTS):
        return None
    if is_under(p, "/proc") or is_under(p, "/dev"):
        top = "/proc" if is_under(p, "/proc") else "/dev"
        return (f"{p} is inside {top}, which the sandbox gets its own of "
                f"({'a new procfs' if top == '/proc' else 'a minimal /dev'}); a deny there cannot be honoured, remove it")
    return None


def why_outside(p: str, beaten: tuple[Rule, ...], *, project: str, home: str, etc_items: Sequence[Item],
                net_mode: str = "none") -> Decision:
    """Why the host path ``p`` (resolved), outside the project and every grant, is or is
    not visible inside: a system dir, the curated /etc, the sandbox's own /proc and /dev."""
    dflt = Origin("default")
    for s in SYSTEM_DIRS:
        if is_under(p, s):
            return Decision(p, True, "ro", Rule("path", "allow-ro", s, dflt), f"visible read-only: system directory {s}", beaten)
    if is_under(p, "/proc") or is_under(p, "/dev"):
        return why_own(p, beaten)
    if is_under(p, "/etc"):
        for i in etc_items:
            if is_under(p, i.value):
                return Decision(p, True, "ro", Rule("etc", "allow", i.value, i.origin),
                                f"visible read-only: etc.extra {i.value} from {i.origin}", beaten)
        if is_under(p, "/etc/resolv.conf") and net_mode == "allow":
            return Decision(p, True, "ro", None, "visible read-only: written by the runtime (--net allow): "
                            "nameserver 127.0.0.1, the proxy's DNS responder (allowlisted names only)", beaten)
        if is_under(p, "/etc/resolv.conf") and net_mode == "host" and os.path.lexists("/etc/resolv.conf"):
            return Decision(p, True, "ro", None, "visible read-only: the host's resolv.conf (--net host)", beaten)
        for n in (*ETC_MADE[:4], *ETC_ALLOW):  # resolv.conf: by the network mode, above
            if is_under(p, "/etc/" + n) and (n in ETC_MADE or os.path.lexists("/etc/" + n)):
                made = n in ETC_MADE
                return Decision(p, True, "ro", None,
                                f"visible read-only: {'written by the runtime' if made else 'a curated entry'} (/etc/{n})", beaten)
        return Decision(p, False, "absent", None,
                        "/etc is hidden except the runtime's curated entries (passwd, hosts, ssl/certs, ...) and etc.extra",
                        beaten)
    if is_under(project, p):
        return Decision(p, False, "absent", None,
                        "not visible: a parent of the project (only the project itself is mounted)", beaten)
    if is_under(p, "/tmp"):
        return Decision(p, False, "absent", None, "/tmp is a private, empty tmpfs inside the sandbox", beaten)
    if is_under(p, home):
        return Decision(p, False, "absent", None,
                        f"not visible: {home} is an empty tmpfs inside the sandbox; only the project and grants are visible",
                        beaten)
    return Decision(p, False, "absent", None, "not visible: outside the project and every grant", beaten)


def why_own(p: str, beaten: tuple[Rule, ...]) -> Decision:
    """/proc and /dev: the sandbox has its own (a new procfs, a minimal /dev)."""
    if is_under(p, "/proc"):
        top = p[len("/proc/"):].split("/", 1)[0] if p != "/proc" else ""
        if top.isdigit():
            return Decision(p, False, "absent", None,
                            "a host process: the sandbox's own procfs shows only the processes of its PID namespace", beaten)
        if top in PROC_MASKED or top in PROC_MASKED_DIRS:
            return Decision(p, False, "masked", None, f"masked: /proc/{top} is hidden in the sandbox's procfs", beaten)
        if top in PROC_READONLY:
            return Decision(p, True, "ro", None, f"visible read-only: /proc/{top} (kernel tunables) is read-only inside", beaten)
        return Decision(p, True, "ro", None, "visible: the sandbox's own procfs (its own processes)", beaten)
    if any(is_under(p, "/dev/" + d) for d in (*DEVICES, "pts", "ptmx")):
        return Decision(p, True, "rw", None, "visible: a device of the sandbox's minimal /dev (its own devpts)", beaten)
    if is_under(p, "/dev/shm") or is_under(p, "/dev/mqueue"):
        return Decision(p, False, "absent", None, "/dev/shm inside is a private, empty tmpfs", beaten)
    if p == "/dev":
        return Decision(p, True, "ro", None, "visible: the sandbox's minimal /dev", beaten)
    return Decision(p, False, "absent", None,
                    "/dev inside is minimal: null, zero, full, random, urandom, tty, pts, shm", beaten)
