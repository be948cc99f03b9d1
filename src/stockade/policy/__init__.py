"""Layered policy: what a sandbox may see and do, and why.

``load(project, session_dir, cli)`` reads the tiers (default < global < workspace <
session < cli; :mod:`.layers`), merges them (settings: the later layer wins; paths and
patterns: deny wins, see :mod:`.rules`) and returns an :class:`Effective` policy
(:mod:`.effective`) the plan builder turns into mounts, Landlock rules and an
environment. ``load_cached`` (:mod:`.cache`) keeps it per process, revalidated.
:mod:`.view` says what the sandbox sees of the host outside its trees.
"""

from __future__ import annotations

from ..errors import PolicyError
from .cache import clear_cache, load_cached
from .effective import Effective, Grant, Masked, load
from .layers import CliPolicy, read_layers
from .rules import Decision, Rule
from .view import deny_refusal, sandbox_sees

__all__ = [
    "CliPolicy",
    "Decision",
    "Effective",
    "Grant",
    "Masked",
    "PolicyError",
    "Rule",
    "clear_cache",
    "deny_refusal",
    "load",
    "load_cached",
    "read_layers",
    "sandbox_sees",
]
