"""The MCP server over stdio, with the official SDK's low-level ``Server``: the tools
of ``tools.TOOLS``, each call run in a worker thread on one ``Workspace``.

stdout is the protocol: the SDK's stdio transport points fd 1 at stderr while it
serves (stray output of anything below misses the wire), and logging goes to stderr.
When the client goes (stdin's end, or SIGTERM/SIGINT/SIGHUP to the server) the calls
in flight are cancelled, their commands killed, the living sandbox stopped, and the
process exits; its session stays for review. A server killed outright takes its
sandbox with it all the same (the sandbox's holder watches its owner's pidfd).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import anyio
import anyio.to_thread
import mcp.types as mt
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from ..errors import StockadeError
from . import tools
from .workspace import Call, Options, Reply, Workspace

log = logging.getLogger("stockade.mcp")

INSTRUCTIONS = (
    "stockade runs your shell commands in a sandbox over the user's project: the exec tool runs a command "
    "in a living sandbox that keeps its files and processes between calls, run in a fresh one-shot one. "
    "Nothing you write reaches the real project until a person reviews and applies the session's change "
    "set: use diff and status to see it, snapshot/restore to go back, and tell the user the session id. "
    "The sandbox's network and visible paths are fixed by the server."
)


def _setup_logging() -> None:
    """Our lines and the SDK's warnings on stderr (stdout is the protocol)."""
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("stockade mcp: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(logging.WARNING)
    log.setLevel(logging.INFO)
    level = os.environ.get("STOCKADE_MCP_LOG", "").upper()
    if level in ("DEBUG", "INFO"):
        root.setLevel(level)


def _result(reply: Reply) -> mt.CallToolResult:
    return mt.CallToolResult(content=[mt.TextContent(type="text", text=reply.text)],
                             structured_content=reply.data, is_error=False)


def _error(tool: str, msg: str) -> mt.CallToolResult:
    return mt.CallToolResult(content=[mt.TextContent(type="text", text=msg)],
                             structured_content={"error": msg, "tool": tool}, is_error=True)


def build(ws: Workspace) -> Server[Any]:
    listed = [mt.Tool(name=t.name, title=t.title, description=t.description, input_schema=tools.schema(t),
                      annotations=mt.ToolAnnotations(title=t.title, read_only_hint=t.read_only,
                                                     destructive_hint=t.destructive, idempotent_hint=t.idempotent,
                                                     open_world_hint=False))
              for t in tools.TOOLS]

    async def list_tools(ctx: ServerRequestContext[Any], params: mt.PaginatedRequestParams | None) -> mt.ListToolsResult:
        return mt.ListToolsResult(tools=listed)

    async def call_tool(ctx: ServerRequestContext[Any], params: mt.CallToolRequestParams) -> mt.CallToolResult:
        t = tools.BY_NAME.get(params.name)
        if t is None:
            return _error(params.name, f"unknown tool {params.name!r}; the tools are "
                                       f"{', '.join(x.name for x in tools.TOOLS)}")
        call = Call()
        try:
            args = tools.parse(t, params.arguments)

            def work() -> Reply:
                return t.call(ws, args, call)

            # abandon_on_cancel: a cancelled request (or the client gone) returns at once;
            # its command is ended through ``call`` and the thread finishes on its own
            return _result(await anyio.to_thread.run_sync(work, abandon_on_cancel=True))
        except StockadeError as e:
            return _error(t.name, f"{t.name}: {e.one_line().removeprefix(t.name + ': ')}")
        except anyio.get_cancelled_exc_class():
            call.cancel()
            raise
        except Exception as e:  # a bug of ours: the server stays up and says what it was
            log.exception("tool %s failed", t.name)
            return _error(t.name, f"{t.name}: internal error {type(e).__name__}: {e} (the server's stderr has "
                                  "the traceback)")

    return Server("stockade", version=_version(), title="stockade sandbox", instructions=INSTRUCTIONS,
                  on_list_tools=list_tools, on_call_tool=call_tool)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stockade")
    except PackageNotFoundError:
        return "0"


async def _serve(ws: Workspace) -> None:
    server = build(ws)
    async with anyio.create_task_group() as tg:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async for sig in sigs:
                    log.info("%s: stopping", signal.Signals(sig).name)
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(on_signals)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        tg.cancel_scope.cancel()  # stdin's end: the client went


def serve(opts: Options) -> int:
    """Serve one client on stdin/stdout until it goes, then exit the process (0, or 1
    when the server failed); a bad option or config raises its UsageError first."""
    _setup_logging()
    ws = Workspace(opts)  # a bad option or config: the caller's one-line error, before serving
    log.info("serving project %s over stdio (session %s; the sandbox starts on the first exec)",
             ws.project, ws.session_id or "made by the first command")
    code = 0
    try:
        anyio.run(_serve, ws)
    except KeyboardInterrupt:
        pass
    except BaseException:  # a failure of the transport or of ours: said on stderr, exit 1
        log.exception("the server failed")
        code = 1
    finally:
        ws.close()
        log.info("client gone; %s", f"session {ws.session_id} kept for review" if ws.session_id else "nothing ran")
        from ..cgroups.base import flush_deferred

        flush_deferred()
        sys.stderr.flush()
    # a one-shot run still in flight has a worker thread that would hold up the exit:
    # its sandbox ends with this process (the launcher ends a run whose requester is gone)
    os._exit(code)
