"""The review page's HTTP side (Starlette): the page and its assets, the data it reads, the
decisions it posts.

Who may use it: the server listens on loopback only, and every request but the static
assets (which hold no data) carries the page's token (``?token=`` or the
``X-Stockade-Token`` header), compared in constant time. A request whose Host is not the
server's own address is refused (a DNS-rebinding page), and a state-changing request (POST)
must also come from the page's own origin (``Origin``: another site's page in the same
browser cannot post even if it guessed the port) with a JSON body (no plain form post).
Each refusal is a 403 before anything is read or changed."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..changes.apply import ApplyConflict, StaleChangeSet
from ..changes.journal import list_applies
from ..changes.rollback import rollback
from ..errors import SessionBusy, StockadeError, UsageError
from ..session.store import Session
from . import data, decide

MAX_BODY = 64 << 20
_STATIC = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
}


def _asset(name: str) -> bytes:
    return resources.files("stockade.review").joinpath("static", name).read_bytes()


class _AsciiJSON(JSONResponse):
    """A file name the sandbox chose need not be UTF-8 (walked with surrogateescape):
    escaped as JSON allows (``\\udcff``), it reaches the page and comes back the same
    string; UTF-8 encoding of it failed the whole answer."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _json(body: Any, status: int = 200) -> JSONResponse:
    return _AsciiJSON(body, status_code=status, headers=_HEADERS)


def _error(status: int, kind: str, message: str, **extra: Any) -> JSONResponse:
    return _json({"error": message, "kind": kind, **extra}, status)


def build(session: Session, token: str, origin: str, hosts: frozenset[str],
          on_page: Callable[[], None] | None = None) -> Starlette:
    """The app for one session; ``origin`` is the page's (``http://127.0.0.1:PORT``) and
    ``hosts`` the Host values it is reached by; ``on_page`` is called each time the page
    itself is served (its token checked)."""
    lock = threading.Lock()  # one state-changing request at a time

    def token_ok(req: Request) -> bool:
        given = req.headers.get("x-stockade-token") or req.query_params.get("token") or ""
        return secrets.compare_digest(given.encode(), token.encode())

    def guard(fn: Callable[[Request], Awaitable[Response]], *, post: bool = False,
              need_token: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def handler(req: Request) -> Response:
            host = req.headers.get("host", "")
            if host not in hosts:
                return _error(403, "host", "refused: this server answers only at its own loopback address")
            if need_token and not token_ok(req):
                return _error(403, "token", "refused: missing or wrong token (open the URL `stockade review` printed)")
            if post:
                # the page's own origin: the address it was loaded from (the one printed, or localhost)
                if req.headers.get("origin") != f"http://{host}":
                    return _error(403, "origin", f"refused: a change must come from the review page itself "
                                                 f"({origin}), not from {req.headers.get('origin') or 'no origin'}")
                if req.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                    return _error(415, "content-type", "expected a JSON body")
            try:
                return await fn(req)
            except StaleChangeSet as e:
                return _error(409, "stale", e.one_line())
            except ApplyConflict as e:
                return _error(409, "conflict", e.one_line(), paths=list(e.paths))
            except SessionBusy as e:
                return _error(409, "busy", e.one_line())
            except UsageError as e:
                return _error(400, "usage", e.one_line())
            except StockadeError as e:
                return _error(500, "failed", e.one_line())
            except OSError as e:
                return _error(500, "failed", f"{e.strerror or e} ({e.filename or 'no path'})")

        return handler

    async def body(req: Request) -> dict[str, Any]:
        raw = await req.body()
        if len(raw) > MAX_BODY:
            raise UsageError(f"request too large ({len(raw)} bytes; at most {MAX_BODY})")
        try:
            got = json.loads(raw)
        except ValueError as e:
            raise UsageError(f"the request is not JSON: {e}") from None
        if not isinstance(got, dict):
            raise UsageError("the request must be a JSON object")
        return got

    async def index(req: Request) -> Response:
        if on_page is not None:
            on_page()
        return Response(_asset("index.html"), media_type="text/html", headers=_HEADERS)

    async def static(req: Request) -> Response:
        name = req.path_params["name"]
        if name not in _STATIC or name == "index.html":
            return Response(b"not found", status_code=404, headers=_HEADERS)
        return Response(_asset(name), media_type=_STATIC[name], headers=_HEADERS)

    async def state(req: Request) -> Response:
        return _json(await run_in_threadpool(data.state, session))

    async def fp(req: Request) -> Response:
        return _json({"fingerprint": await run_in_threadpool(data.fingerprint_of, session)})

    async def file(req: Request) -> Response:
        path = req.query_params.get("path")
        if "pathj" in req.query_params:  # (a name a URL cannot carry as UTF-8: as a JSON string)
            try:
                path = json.loads(req.query_params["pathj"])
            except ValueError:
                path = None
            if not isinstance(path, str):
                raise UsageError("?pathj= must be a JSON string")
        if not path:
            raise UsageError("which file? (?path=)")
        return _json(await run_in_threadpool(data.file_view, session, path))

    async def apply(req: Request) -> Response:
        decisions = await body(req)

        def run() -> dict[str, Any]:
            with lock:
                return decide.carry_out(session, decisions).to_json()

        return _json(await run_in_threadpool(run))

    async def undo(req: Request) -> Response:
        got = await body(req)
        apply_id = got.get("apply_id")
        if not isinstance(apply_id, str) or not apply_id:
            raise UsageError("which apply? (apply_id)")

        if apply_id not in {a.id for a in list_applies(session.id)}:
            raise UsageError(f"no apply {apply_id!r} of session {session.id}")

        def run() -> dict[str, Any]:
            with lock:
                rec = rollback(apply_id)
            return {"rolled_back": rec.id, "paths": list(rec.paths), "session": rec.session}

        return _json(await run_in_threadpool(run))

    routes = [
        Route("/", guard(index), methods=["GET"]),
        Route("/static/{name}", guard(static, need_token=False), methods=["GET"]),
        Route("/api/state", guard(state), methods=["GET"]),
        Route("/api/fingerprint", guard(fp), methods=["GET"]),
        Route("/api/file", guard(file), methods=["GET"]),
        Route("/api/apply", guard(apply, post=True), methods=["POST"]),
        Route("/api/rollback", guard(undo, post=True), methods=["POST"]),
    ]
    return Starlette(routes=routes)
