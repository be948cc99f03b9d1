"""`stockade mcp`: serve an MCP client (an agent) over stdio (``stockade.mcp``).

The run options on its command line are the sandbox's, for the server's whole life:
the tools an agent calls choose commands, never options. The SDK is imported here,
when the verb runs, never by `import stockade.cli`.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .table import Args


def cmd_mcp(args: Args) -> int:
    from ..core.request import RunRequest
    from ..errors import UsageError
    from .run import run_kwargs

    if getattr(args, "command", None):
        raise UsageError("mcp takes no command: the agent sends its commands through the server's tools")
    max_output = None
    if args.max_output is not None:
        from ..policy.config import parse_output_cap

        try:
            max_output = parse_output_cap(args.max_output)
        except ValueError as e:
            raise UsageError(f"--max-output: {e}") from None
    vars(args)["command"] = ["--", "true"]  # run_kwargs wants one; the server never runs it
    kw = run_kwargs(args)
    session = kw.pop("session", None)
    req = RunRequest(**kw)
    try:
        from ..mcp.server import serve
    except ImportError as e:  # the SDK is a dependency: a broken install says so
        raise UsageError(f"stockade mcp needs the MCP SDK (`pip install 'mcp>=2.3,<3'`): {e}") from None
    from ..mcp.workspace import Options

    return serve(Options(req, session=session, max_output=max_output))
