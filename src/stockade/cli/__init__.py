"""The ``stockade`` command (console script and ``python -m stockade``).

One argparse table (``cli.table``) and one module per group of verbs: ``run``
(run, explain, shell), ``changes``, ``policy``, ``limits`` (the limit options), ``log``,
``doctor``, ``profiles``. A `stockade run` is first offered to the user's CLI server
(``stockade.fast``), which runs this same ``main`` in a supervisor forked from a warm
process (``serve``); else it runs here. Importing this module imports nothing: the
served path costs the interpreter and ``stockade.fast.client`` only.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

# How a client starts a server for this CLI (``python -P -c SERVER_ENTRY dir name``).
SERVER_ENTRY = "from stockade.cli import serve; serve()"


def main(argv: list[str] | None = None, *, serve: bool = True) -> int:
    """``stockade ARGV`` (default: this process's own arguments); its exit status."""
    words = sys.argv[1:] if argv is None else argv
    # arguments and paths may hold bytes that are not UTF-8 (os.fsdecode's surrogate
    # escapes): what we print of them goes out as those bytes, as ls and cat do, never
    # a UnicodeEncodeError (stderr already escapes them: backslashreplace)
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None and getattr(sys.stdout, "errors", "") == "strict":
        reconfigure(errors="surrogateescape")
    if serve and argv is None and (words[:1] == ["run"] or (words[:1] == ["exec"] and not _tty(words))):
        # the user's warm server runs it (this same code, this process's context), else here
        from ..fast.client import serve_and_exit

        serve_and_exit(words, SERVER_ENTRY)
    if argv is None:  # the process's own command line: --pass-fd means the fds it was started with
        from ..callerfds import snapshot

        snapshot()
    from .table import fast_parse

    args = fast_parse(words)
    if args is None:
        from .table import parse

        args = parse(words)
    func = getattr(args, "func", None)
    if func is None:
        print("stockade: no command given; try `stockade run -- CMD`, or `stockade --help` for every verb",
              file=sys.stderr)
        return 2

    def verb() -> int:
        if args.verb not in ("run", "explain", "shell", "recover", "exec"):
            _recover_quietly()
        return int(func(args))

    return _guarded(verb)


def _tty(words: list[str]) -> bool:
    """`exec -t` relays this terminal in raw mode: it runs here, never served."""
    for w in words[1:]:
        if w == "--":
            return False
        if w in ("-t", "--tty") or (w.startswith("-") and not w.startswith("--") and "t" in w[1:]):
            return True
    return False


def _guarded(fn: Callable[[], int]) -> int:
    """Run a verb: our errors as one line and their exit status, Ctrl-C as 130, EPIPE as 141."""
    from ..errors import StockadeError

    try:
        return fn()
    except StockadeError as e:
        sys.stderr.write(f"stockade: {e.one_line()}\n")
        return e.exit_status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 141


def _recover_quietly() -> None:
    from ..changes.recovery import recover_pending

    for line in recover_pending():
        sys.stderr.write(f"stockade: {line}\n")


def _served(argv: list[str], after_reply: list[Callable[[], None]]) -> int:
    """A served run, in a supervisor that took on its client's context."""
    from . import run

    run.after_reply = after_reply
    return main(argv)


def serve() -> None:
    """The CLI server's process (started by ``stockade.fast.client`` with ``SERVER_ENTRY``)."""
    from ..fast import server

    server.main(_served)


if __name__ == "__main__":
    sys.exit(main())
