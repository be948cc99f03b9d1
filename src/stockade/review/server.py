"""The review page's server: uvicorn on a loopback socket bound here (so a port in use is a
one-line error before anything starts), in a thread of its own; ``close`` ends it."""

from __future__ import annotations

import errno
import ipaddress
import secrets
import socket
import threading
import time

from ..errors import UsageError
from ..session import store
from ..session.store import Session


def _loopback(host: str) -> None:
    try:
        ok = ipaddress.ip_address(host).is_loopback and ipaddress.ip_address(host).version == 4
    except ValueError:
        ok = False
    if not ok:
        raise UsageError(f"the review page is served on a loopback IPv4 address only (such as 127.0.0.1), "
                         f"not {host!r}")


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: expected a port number from 1 to 65535 (or 0 for a free one)")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(64)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use; pick another with --port, or leave --port out "
                             "for a free one") from None
        if e.errno == errno.EACCES:
            raise UsageError(f"port {port} on {host} needs privileges to bind; pick one above 1023") from None
        raise
    sock.set_inheritable(False)
    return sock


class ReviewServer:
    """One session's review page, served until ``close``. ``url`` carries the token."""

    def __init__(self, session: Session, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from . import app

        _loopback(host)
        self.session = session
        self.token = secrets.token_urlsafe(32)
        self._sock = _bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self.origin = f"http://{self.host}:{self.port}"
        self.url = f"{self.origin}/?token={self.token}"
        hosts = frozenset({f"{self.host}:{self.port}", f"localhost:{self.port}"})
        self.page_loaded = threading.Event()  # set once the page has been served (its token checked)
        application = app.build(session, self.token, self.origin, hosts, on_page=self.page_loaded.set)
        config = uvicorn.Config(application, log_config=None, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=2, proxy_headers=False,
                                server_header=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"stockade-review-{session.id}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise UsageError(f"the review server for session {session.id} did not start")
            time.sleep(0.01)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server ends (or ``timeout``); True when it has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> ReviewServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(session: Session | str, host: str = "127.0.0.1", port: int = 0) -> ReviewServer:
    """Serve ``session``'s review page (a Session or its name) on ``host``:``port`` (0: a
    free port); returns once it answers. Raises SessionNotFound, or UsageError for a port
    in use or a host that is not loopback, before anything is bound."""
    sess = store.open_session(session) if isinstance(session, str) else session
    sess.meta()  # a session removed meanwhile: SessionNotFound now, not at the first request
    return ReviewServer(sess, host, port)
