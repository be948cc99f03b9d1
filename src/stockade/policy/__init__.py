"""Layered policy: what a sandbox may see and do, and why.

``load(project, session_dir, cli)`` reads the tiers (default < global < workspace <
session < cli; :mod:`.layers`), merges them (settings: the later layer wins; paths and
patterns: deny wins, see :mod:`.rules`) and returns an :class:`Effective` policy
(:mod:`.effective`) the plan builder turns into mounts, Landlock rules and an
environment, and the network policy of ``--net allow`` (:mod:`.network`). ``load_cached`` (:mod:`.cache`) keeps it per process, revalidated.
:mod:`.view` says what the sandbox sees of the host outside its trees.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import PolicyError

if TYPE_CHECKING:
    from .cache import clear_cache, load_cached
    from .effective import Effective, Grant, Masked, load
    from .layers import CliPolicy, read_layers
    from .network import HostDecision, HostRule, LiveNetPolicy, NetPolicy
    from .rules import Decision, Rule
    from .view import deny_refusal, sandbox_sees

# The face loads a module when one of its names is first asked for: the run path
# imports policy.env (plan's warnings about hidden paths) on every run, and must not
# pay for the config reader and the whole policy with it.
_HOME = {
    "clear_cache": "cache", "load_cached": "cache",
    "Effective": "effective", "Grant": "effective", "Masked": "effective", "load": "effective",
    "CliPolicy": "layers", "read_layers": "layers",
    "HostDecision": "network", "HostRule": "network", "LiveNetPolicy": "network", "NetPolicy": "network",
    "Decision": "rules", "Rule": "rules",
    "deny_refusal": "view", "sandbox_sees": "view",
}


def __getattr__(name: str) -> object:
    mod = _HOME.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CliPolicy",
    "Decision",
    "Effective",
    "Grant",
    "HostDecision",
    "HostRule",
    "LiveNetPolicy",
    "Masked",
    "NetPolicy",
    "PolicyError",
    "Rule",
    "clear_cache",
    "deny_refusal",
    "load",
    "load_cached",
    "read_layers",
    "sandbox_sees",
]
