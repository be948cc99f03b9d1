"""`stockade review`: a session's change set as a local web page (loopback, a token, the
page's own origin), where a reviewer approves or rejects each file and hunk, edits, applies
through the CLI's apply engine, and rolls back. ``serve(session)`` is the API; the HTTP
side is Starlette on uvicorn (``app``, ``server``), the page's assets are in ``static/``."""

from .server import ReviewServer, serve

__all__ = ["ReviewServer", "serve"]
