"""`stockade shell`: an interactive shell in the sandbox.

The host side allocates a pty, puts the user's terminal in raw mode and relays
bytes both ways; window size changes are copied to the pty. The sandbox only
ever holds the pty's far end (its own session's controlling terminal), never
the user's terminal, so it cannot inject keystrokes into it.
"""

from __future__ import annotations

import argparse
import os
import sys
import termios
import tty


def cmd_shell(args: argparse.Namespace) -> int:
    from . import api
    from .cli import _after_run, _run_kwargs

    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    kw = _run_kwargs(args, default_cmd=[shell, "-i"])
    argv = kw.pop("args")
    project = kw.pop("project")
    session = kw.pop("session")
    saved = None
    if os.isatty(0):
        saved = termios.tcgetattr(0)
        tty.setraw(0)
    try:
        res = api.run(argv, project=project, session=session, forward_signals=True, pty=True, quiet=False, **kw)
    finally:
        if saved is not None:
            termios.tcsetattr(0, termios.TCSADRAIN, saved)
    sys.stdout.flush()
    _after_run(res)
    return int(res.exit_status)
