"""Imports made by a thread of ours, safe against a fork made meanwhile.

A thread importing a module for the first time holds that module's import lock. A fork
made then, by another thread (the program's own, a ``multiprocessing`` pool's), copies
the lock held by a thread the child does not have, and the child's first import of that
module waits forever (CPython re-initialises only its global import lock after a fork).

Our threads therefore import nothing on their own: what they need is imported by the
module that starts them (in the caller's thread), or, where that would cost every caller
too much (pyroute2: a third of a second, needed only when the proxy dials a name), by
``import_module`` here, under a lock that a fork of this process waits for.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from types import ModuleType

_lock = threading.Lock()


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``; a fork made meanwhile waits until it is done."""
    mod = sys.modules.get(name)
    spec = getattr(mod, "__spec__", None)
    if mod is not None and not getattr(spec, "_initializing", False):
        return mod  # loaded: no import lock is taken
    with _lock:
        return importlib.import_module(name)


def _before_fork() -> None:
    _lock.acquire()


def _after_fork_in_parent() -> None:
    _lock.release()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
