"""net/netns.py, the listeners of --net allow made in a sandbox's own network namespace:
they live there (read from the host's /proc), and a refused step names the cause and the
fix that doctor's network lines name (linux/remedies.py)."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.errors import SandboxError
from stockade.linux import libc, remedies
from stockade.net import DNS_PORT, PROXY_PORT, netns
from tests.conftest import need


@pytest.fixture
def target() -> Iterator[int]:
    """A process in its own user and network namespace (what a held sandbox is)."""
    need(shutil.which("unshare") is not None, "unshare (util-linux) is not installed")
    p = subprocess.Popen(["unshare", "-Urn", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.stat(f"/proc/{p.pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino:
            assert time.monotonic() < deadline and p.poll() is None, "unshare -Urn did not start"
            time.sleep(0.01)
        yield p.pid
    finally:
        p.kill()
        p.wait()


def _tcp_inodes(path: str) -> set[int]:
    out = set()
    for line in Path(path).read_text().splitlines()[1:]:
        f = line.split()
        out.add(int(f[9]))
    return out


def test_listeners_live_in_the_sandbox_namespace(target: int) -> None:
    pidfd = os.pidfd_open(target)
    try:
        socks = netns.make(pidfd, target, proxy=True, forward=(5999,))
    finally:
        os.close(pidfd)
    try:
        assert {s.getsockname()[1] for s in socks.proxy} == {PROXY_PORT}
        assert socks.dns_udp[0].getsockname() == ("127.0.0.1", DNS_PORT)
        assert 5999 in socks.forward
        inodes = {os.fstat(s.fileno()).st_ino for s in socks.proxy + socks.dns_tcp + socks.forward[5999]}
        inside = _tcp_inodes(f"/proc/{target}/net/tcp") | _tcp_inodes(f"/proc/{target}/net/tcp6")
        host = _tcp_inodes("/proc/self/net/tcp") | _tcp_inodes("/proc/self/net/tcp6")
        assert inodes <= inside and not inodes & host
    finally:
        socks.close()


def test_a_refused_setns_names_the_cause_and_fix(target: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(fd: int, nstype: int) -> int:
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(libc, "setns", refused)  # the forked helper inherits it
    pidfd = os.pidfd_open(target)
    try:
        with pytest.raises(SandboxError) as ei:
            netns.make(pidfd, target, proxy=True)
    finally:
        os.close(pidfd)
    e = ei.value
    want = remedies.setns(errno.EPERM, remedies.detect())
    assert e.errno == errno.EPERM and "setns" in e.step
    assert e.remedy == want.fix and e.detail == want.cause
    assert "EPERM" in str(e) and "fix:" in str(e)
