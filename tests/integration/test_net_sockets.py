"""--net allow refuses a socket of the host's network handed in: through it a command
could reach any address past the proxy (disconnect it, connect it elsewhere; Landlock's
TCP rules name ports, never addresses, and UDP has none). Checked from the host: a
listener the sandbox would reach through it counts no connection. Both CLI paths,
root and unprivileged."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ..conftest import User
from .test_bad_input import listing

pytestmark = pytest.mark.cli_paths

# inside: disconnect the handed-in socket and connect it to the host's listener
ESCAPE = ("import socket,sys; s=socket.socket(fileno=int(sys.argv[1])); "
          "s.connect(('127.0.0.1', int(sys.argv[2]))); s.sendall(b'escaped')")


def _settle(user: User, project: Path) -> None:
    """A first run: the state dir as a user has it (its caches), before the one compared."""
    r = user.cli(["run", "--net", "allow", "--", "true"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()


def _listener() -> socket.socket:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    lst.setblocking(False)
    return lst


def _count(lst: socket.socket) -> int:
    n = 0
    while True:
        try:
            c, _ = lst.accept()
        except BlockingIOError:
            return n
        c.close()
        n += 1


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_a_passed_inet_socket_is_refused(user: User, project: Path, kind: int) -> None:
    target = _listener()
    port = target.getsockname()[1]
    s = socket.socket(socket.AF_INET, kind)
    _settle(user, project)
    try:
        before = listing(user.state)
        r = user.cli(["run", "--session", "newone", "--net", "allow", "--pass-fd", str(s.fileno()), "--",
                      "python3", "-c", ESCAPE, str(s.fileno()), str(port)],
                     cwd=project, pass_fds=(s.fileno(),))
        err = r.stderr.decode()
        assert r.returncode == 2 and err.count("\n") == 1, err
        assert f"--pass-fd {s.fileno()} is an IPv4/IPv6 socket of the host's network" in err and "--net host" in err
        assert listing(user.state) == before  # nothing made
        assert _count(target) == 0
    finally:
        s.close()
        target.close()


def test_an_inet_socket_as_stdin_is_refused(user: User, project: Path) -> None:
    src = _listener()
    target = _listener()
    c = socket.create_connection(src.getsockname())
    _settle(user, project)
    try:
        before = listing(user.state)
        r = user.cli(["run", "--net", "allow", "--", "python3", "-c", ESCAPE, "0", str(target.getsockname()[1])],
                     cwd=project, stdin=c.fileno())
        err = r.stderr.decode()
        assert r.returncode == 2 and "stdin is an IPv4/IPv6 socket of the host's network" in err, err
        assert listing(user.state) == before
        assert _count(target) == 0
    finally:
        c.close()
        src.close()
        target.close()


def test_a_pipe_or_unix_socket_still_passes(user: User, project: Path) -> None:
    a, b = socket.socketpair()
    try:
        r = user.cli(["run", "--net", "allow", "--pass-fd", str(a.fileno()), "--", "python3", "-c",
                      "import os, sys; os.write(int(sys.argv[1]), b'through\\n')", str(a.fileno())],
                     cwd=project, pass_fds=(a.fileno(),))
        assert r.returncode == 0, r.stderr.decode()
        assert b.recv(100) == b"through\n"
    finally:
        a.close()
        b.close()
    r = user.cli(["run", "--net", "allow", "--", "cat"], cwd=project, input=b"piped\n")
    assert r.returncode == 0 and r.stdout == b"piped\n", r.stderr.decode()
