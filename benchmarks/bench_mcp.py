"""`stockade mcp` (issue 18): what an agent's command costs through the MCP server.

One table, its candidates interleaved round by round (one sample each per round, so
background load hits them alike), median and p90 of BENCH_N:

* bare `true` and bare `sh -c true` (``subprocess.run``): the floor;
* ``sb.exec(["true"])`` and ``sb.exec("true", shell=True)`` into a living sandbox of
  this process (the API directly);
* the ``exec`` tool with ``{"command": "true"}`` through a real ``stockade mcp``
  (the console script, a subprocess) driven by the MCP SDK's own client over stdio:
  the round trip a client sees (JSON-RPC both ways, the argument check, a worker
  thread, the exec into the server's living sandbox — a shell, as every tool command
  runs under ``/bin/sh -c`` — the output files, the reply).

The sandbox's start (the first exec) is outside the samples (warm-up). Everything it
starts, it stops; the last line says whether any sandbox was left.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from ._util import bench_dir, interleaved, median
from .bench_live import _living, _ok, _settle, _stop_all, p90
from .bench_runtime import _must

N = int(os.environ.get("BENCH_N", "200"))


def _server_argv(proj: Path) -> list[str]:
    exe = shutil.which("stockade", path=os.path.dirname(sys.executable)) or shutil.which("stockade")
    base = [exe] if exe else [sys.executable, "-m", "stockade"]
    return [*base, "mcp", "--project", str(proj)]


def main() -> None:
    with bench_dir("stockade-bench-mcp-") as base:
        proj = base / "proj"
        proj.mkdir()
        (proj / "f").write_text("x\n")
        try:
            _table(proj)
        finally:
            _stop_all()
            _settle()
            left = _living()
            from stockade.cgroups.base import flush_deferred

            flush_deferred()
            print(f"cleanup: {len(left)} living sandbox(es) left running" + (f": {left}" if left else ""))


def _table(proj: Path) -> None:
    import anyio.from_thread
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    import stockade

    argv = _server_argv(proj)
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ), cwd=str(proj))

    @asynccontextmanager
    async def connect() -> Any:
        with open(os.devnull, "w") as errlog:
            async with stdio_client(params, errlog=errlog) as (r, w), ClientSession(r, w) as s:
                await s.initialize()
                yield s

    fns: dict[str, Callable[[], object]] = {
        "bare `true` (subprocess.run)": _must(["true"]),
        "bare `sh -c true` (subprocess.run)": _must(["sh", "-c", "true"]),
    }
    live = stockade.Sandbox(proj, persistent=True)
    try:
        with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(connect()) as s:

            def tool() -> object:
                res = portal.call(s.call_tool, "exec", {"command": "true"})
                if res.is_error or not isinstance(res.structured_content, dict) \
                        or res.structured_content.get("exit_status") != 0:
                    raise SystemExit(f"bench: the exec tool failed: {res.content}")
                return res

            tool()  # the server's living sandbox starts here, outside the samples
            fns["sb.exec(['true']) (living sandbox, API)"] = lambda: _ok("sb.exec", live.exec(["true"]))
            fns["sb.exec('true', shell=True) (API)"] = lambda: _ok("sb.exec", live.exec("true", shell=True))
            fns["MCP exec tool {'command': 'true'} (round trip)"] = tool
            res = interleaved(fns, N)
    finally:
        live.close()
    bare = median(res["bare `true` (subprocess.run)"])
    direct = median(res["sb.exec(['true']) (living sandbox, API)"])
    print(f"== `true` through `stockade mcp` (median and p90 of {N}, interleaved; added over bare `true`; "
          "ratio to sb.exec(['true']))")
    print(f"  {'':<50} {'median':>11} {'p90':>11}")
    for name, xs in res.items():
        extra = f"+{(median(xs) - bare) * 1e3:6.2f} ms  {median(xs) / direct:6.2f}x sb.exec"
        print(f"  {name:<50} {median(xs) * 1e3:8.2f} ms {p90(xs) * 1e3:8.2f} ms  {extra}")
    mcp = median(res["MCP exec tool {'command': 'true'} (round trip)"])
    shell = median(res["sb.exec('true', shell=True) (API)"])
    print(f"  the MCP layer (round trip less sb.exec of the same shell command): {(mcp - shell) * 1e3:.2f} ms")
