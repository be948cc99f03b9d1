"""`stockade mcp`: stockade as an agent's shell over the Model Context Protocol (stdio).

``workspace`` holds one MCP session's state (its session, its living sandbox) and does
what each tool asks through the public API and the change-set engine; ``tools`` is the
table of tools, their typed arguments and their descriptions; ``output`` cuts a
command's streams to the size cap; ``server`` is the one module that speaks MCP (the
official SDK, imported only when the verb runs).

Layer: the top, beside the CLI (it imports the API, ``live`` and ``changes``); nothing
below imports it, and importing ``stockade.cli`` does not import it.
"""
