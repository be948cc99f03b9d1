"""Listening sockets made inside a sandbox's own network namespace.

The parent's side of ``--net allow`` and forwarded ports: a helper forked from the
supervisor joins the sandbox's user and network namespaces (``setns``; the sandbox
is held before its command execs), brings ``lo`` up and checks, with pyroute2, that
the namespace has no interface but ``lo`` and no route out; then it makes the
listening sockets there and hands them back over SCM_RIGHTS. A socket stays in the
namespace it was made in wherever its fd goes: the host-side proxy accepts what a
process inside sends to ``127.0.0.1:PROXY_PORT``, and nothing in the host's own
namespace (no path, no port) leads to it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import SandboxError
from ..linux import libc, remedies
from . import DNS_PORT, PROXY_PORT

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
IFF_UP = 0x1

_REMEDY_SETNS = ("this process may not join the sandbox's namespaces (a container engine's seccomp profile "
                 "refusing setns, or a user namespace of another owner): `stockade doctor` names the cause; "
                 "--net none (or --net host) runs without the proxy")


@dataclass
class Sockets:
    """What ``make`` returns: listening sockets living in the sandbox's namespace."""

    proxy: list[socket.socket] = field(default_factory=list)
    dns_udp: list[socket.socket] = field(default_factory=list)
    dns_tcp: list[socket.socket] = field(default_factory=list)
    forward: dict[int, list[socket.socket]] = field(default_factory=dict)

    def all(self) -> list[socket.socket]:
        return [*self.proxy, *self.dns_udp, *self.dns_tcp, *(s for ss in self.forward.values() for s in ss)]

    def close(self) -> None:
        for s in self.all():
            s.close()


# (role, family, type, address, port, required)
_Spec = tuple[str, int, int, str, int, bool]


def _specs(proxy: bool, forward: tuple[int, ...]) -> list[_Spec]:
    out: list[_Spec] = []
    if proxy:
        out += [("proxy", socket.AF_INET, socket.SOCK_STREAM, "127.0.0.1", PROXY_PORT, True),
                ("proxy", socket.AF_INET6, socket.SOCK_STREAM, "::1", PROXY_PORT, False),
                ("dns_udp", socket.AF_INET, socket.SOCK_DGRAM, "127.0.0.1", DNS_PORT, True),
                ("dns_tcp", socket.AF_INET, socket.SOCK_STREAM, "127.0.0.1", DNS_PORT, True)]
    for p in forward:
        out += [(f"forward:{p}", socket.AF_INET, socket.SOCK_STREAM, "127.0.0.1", p, True),
                (f"forward:{p}", socket.AF_INET6, socket.SOCK_STREAM, "::1", p, False)]
    return out


def _ns_ino(pid: int | str, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def make(pidfd: int, pid: int, *, proxy: bool, forward: tuple[int, ...] = ()) -> Sockets:
    """Listening sockets in the network namespace of the held sandbox ``pid``: the proxy's
    (HTTP and SOCKS5 on one port) and the DNS responder's when ``proxy``, one pair per
    forwarded port. Raises SandboxError naming the step, the errno and the fix."""
    warm_netlink()
    specs = _specs(proxy, forward)
    try:
        join_user = _ns_ino(pid, "user") != _ns_ino("self", "user")
    except OSError as e:
        raise SandboxError("read the sandbox's namespaces", path=f"/proc/{pid}/ns", errno=e.errno or 0,
                           remedy="the sandbox ended before its network was set up; its report says why") from None
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        helper = os.fork()
    except OSError:
        parent.close()
        child.close()
        raise
    if helper == 0:  # never returns
        parent.close()
        _helper(child, pidfd, pid, join_user, specs)
    child.close()
    try:
        msg, fds, _flags, _addr = socket.recv_fds(parent, 65536, 64)
    finally:
        parent.close()
        os.waitpid(helper, 0)
    got = [socket.socket(fileno=fd) for fd in fds]
    try:
        reply = json.loads(msg.decode() or "{}")
    except ValueError:
        reply = {}
    if "error" in reply or not msg:
        for s in got:
            s.close()
        info = reply.get("error") or {"step": "set up the sandbox's network (helper)", "errno": 0, "path": None}
        err = int(info.get("errno") or 0)
        remedy, detail = info.get("remedy"), info.get("detail")
        if err and info.get("concern"):
            r = _remedy(str(info["concern"]), err, int(info.get("port") or 0))
            remedy, detail = r.fix, r.cause
        raise SandboxError(info["step"], path=info.get("path"), errno=err, remedy=remedy, detail=detail)
    out = Sockets()
    for role, s in zip(reply["roles"], got, strict=True):
        if role.startswith("forward:"):
            out.forward.setdefault(int(role.split(":", 1)[1]), []).append(s)
        else:
            getattr(out, role).append(s)
    return out


def _remedy(concern: str, err: int, port: int) -> remedies.Remedy:
    env = remedies.detect()
    if concern == "setns":
        return remedies.setns(err, env)
    if concern == "netlink":
        return remedies.netlink(err, env)
    return remedies.low_port(err, env, port)


_warmed: list[bool] = []


def warm_netlink() -> None:
    """pyroute2 imported and its message classes built once in this process, before any
    fork: each helper would otherwise pay it again (a tenth of a second to import)."""
    if _warmed:
        return
    from pyroute2 import IPRoute

    try:
        with IPRoute() as ipr:
            ipr.get_links()
            for fam in (socket.AF_INET, socket.AF_INET6):
                ipr.get_routes(family=fam, table=254)
    except OSError:
        pass  # the helper reports netlink's failure in the sandbox's namespace
    _warmed.append(True)


def _helper(conn: socket.socket, pidfd: int, pid: int, join_user: bool, specs: list[_Spec]) -> None:
    """In the forked helper: join, check, make the sockets, send them, exit."""
    code = 1
    try:
        _join(pidfd, pid, join_user)
        _lo_up_and_check(pid)
        socks: list[socket.socket] = []
        roles: list[str] = []
        for role, fam, typ, addr, port, required in specs:
            s = _listen(fam, typ, addr, port, required)
            if s is not None:
                socks.append(s)
                roles.append(role)
        socket.send_fds(conn, [json.dumps({"roles": roles}).encode()], [s.fileno() for s in socks])
        code = 0
    except _Failed as f:
        _send_error(conn, f.info)
    except BaseException as e:  # the helper must always answer
        _send_error(conn, {"step": "set up the sandbox's network (helper)", "errno": getattr(e, "errno", 0) or 0,
                           "detail": f"{type(e).__name__}: {e}"})
    finally:
        os._exit(code)


class _Failed(Exception):
    """A step of the helper failed. ``concern``: the remedies.py function that names the
    cause and fix of this errno here (the same one doctor's network lines use)."""

    def __init__(self, step: str, *, path: str | None = None, err: int = 0, remedy: str | None = None,
                 detail: str | None = None, concern: str | None = None, port: int = 0) -> None:
        super().__init__(step)
        self.info = {"step": step, "path": path, "errno": err, "remedy": remedy, "detail": detail,
                     "concern": concern, "port": port}


def _send_error(conn: socket.socket, info: Mapping[str, object]) -> None:
    try:
        conn.send(json.dumps({"error": info}).encode())
    except OSError:
        pass


def _join(pidfd: int, pid: int, join_user: bool) -> None:
    flags = CLONE_NEWNET | (CLONE_NEWUSER if join_user else 0)
    if libc.setns(pidfd, flags) == 0:
        return
    err = libc.errno()
    if err != errno.EINVAL:
        raise _Failed("setns into the sandbox's user and network namespaces", path=f"/proc/{pid}/ns/net", err=err,
                      remedy=_REMEDY_SETNS, concern="setns")
    # a kernel before 5.8 takes no pidfd here: the namespace files, user first
    for kind, flag, wanted in (("user", CLONE_NEWUSER, join_user), ("net", CLONE_NEWNET, True)):
        if not wanted:
            continue
        path = f"/proc/{pid}/ns/{kind}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise _Failed("open the sandbox's namespace", path=path, err=e.errno or 0, remedy=_REMEDY_SETNS) from None
        rc = libc.setns(fd, flag)
        os.close(fd)
        if rc != 0:
            raise _Failed(f"setns into the sandbox's {kind} namespace", path=path, err=libc.errno(),
                          remedy=_REMEDY_SETNS, concern="setns")


def _lo_up_and_check(pid: int) -> None:
    """lo up (the child does it too, maybe not yet), and a tripwire: no interface but lo,
    no route that leaves it. A namespace that has one is not ours to proxy: fail closed."""
    from pyroute2 import IPRoute

    where = f"/proc/{pid}/ns/net"
    try:
        with IPRoute() as ipr:
            links = list(ipr.get_links())
            lo = None
            others = []
            for link in links:
                name = link.get_attr("IFLA_IFNAME")
                if name == "lo":
                    lo = link
                else:
                    others.append(str(name))
            if others or lo is None:
                raise _Failed("check the sandbox's network namespace", path=where,
                              detail=f"it has interfaces besides lo: {', '.join(others) or '(no lo)'}",
                              remedy="report this: a sandbox's own namespace starts with lo only")
            if not lo["flags"] & IFF_UP:
                ipr.link("set", index=lo["index"], state="up")
            for fam in (socket.AF_INET, socket.AF_INET6):
                for r in ipr.get_routes(family=fam, table=254):
                    if r.get_attr("RTA_OIF") != lo["index"] or r.get_attr("RTA_GATEWAY"):
                        raise _Failed("check the sandbox's network namespace", path=where,
                                      detail=f"it has a route out: {r.get_attr('RTA_DST') or 'default'}",
                                      remedy="report this: a sandbox's own namespace has no route out")
    except _Failed:
        raise
    except OSError as e:
        raise _Failed("bring lo up in the sandbox's network namespace (netlink)", path=where, err=e.errno or 0,
                      concern="netlink",
                      remedy="`stockade doctor` checks netlink in a new network namespace") from None


def _listen(fam: int, typ: int, addr: str, port: int, required: bool) -> socket.socket | None:
    try:
        s = socket.socket(fam, typ | socket.SOCK_CLOEXEC)
    except OSError as e:
        if not required and e.errno == errno.EAFNOSUPPORT:
            return None  # no IPv6 here: the IPv4 listener serves
        raise _Failed("socket", path=f"{addr}:{port}", err=e.errno or 0) from None
    try:
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((addr, port))
        if typ == socket.SOCK_STREAM:
            s.listen(128)
    except OSError as e:
        s.close()
        if not required and e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return None  # IPv6 disabled in the namespace
        raise _Failed("listen in the sandbox's network namespace", path=f"{addr}:{port}", err=e.errno or 0,
                      concern="bind", port=port,
                      remedy="choose another --forward port" if port not in (PROXY_PORT, DNS_PORT) else None) from None
    return s
