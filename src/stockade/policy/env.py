"""Environment filter: which of the caller's variables reach the sandbox.

Order of decisions for one variable:

1. ``--env K=V`` on the command line and ``env.set`` in a config always pass.
2. ``env.inherit``: ``all`` (default) considers every variable, ``core`` only those an
   allow pattern names, ``none`` none.
3. A block pattern (``AWS_*``, ``*_TOKEN``...) removes it unless an allow pattern from
   the same or a later layer names it too (deny wins otherwise).
4. With ``env.filter_values`` (default on), a value that looks like a known token
   format (``ghp_…``, ``AKIA…``, ``sk-…``, a URL with a password…) removes it unless a
   user layer (not the defaults) explicitly allows the name.

Names are matched case-insensitively with shell globs.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _tokens

if TYPE_CHECKING:
    from .config import Origin

__all__ = [
    "DEFAULT_ALLOW", "DEFAULT_BLOCK", "TOKEN_PATTERNS", "EnvDecision", "EnvFilter", "EnvRule", "hidden_refs", "hidden_warning",
    "name_matches", "path_refs", "token_kind",
]

DEFAULT_ALLOW: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TERM",
    "COLORTERM", "TZ", "NODE_ENV", "DEBUG", "CI", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
    "EDITOR", "PAGER", "NO_COLOR", "FORCE_COLOR", "TMPDIR", "PWD",
)
# Each pattern blocks some name no other one does (tests/unit/test_policy_env.py holds
# this, so the loss of any one is noticed); *_API_KEY is *_KEY's.
DEFAULT_BLOCK: tuple[str, ...] = (
    "*_KEY", "*_APIKEY", "*_SECRET", "*_SECRET_*", "*_TOKEN", "*_TOKEN_*",
    "*PASSWORD*", "*PASSWD*", "*CREDENTIAL*", "AWS_*", "GITHUB_*", "*_PAT",
    "SSH_AUTH_SOCK", "GPG_AGENT_INFO",
)

TOKEN_PATTERNS = _tokens.patterns()


@functools.lru_cache(maxsize=4096)
def token_kind(value: str) -> str | None:
    """The label of the first token format found in ``value``."""
    for label, rx in TOKEN_PATTERNS:
        if rx.search(value):
            return label
    return None


@functools.lru_cache(maxsize=1 << 16)
def name_matches(pattern: str, name: str) -> bool:
    # Cached: every run filters the same environment against the same patterns.
    return fnmatch.fnmatchcase(name.upper(), pattern.upper())


@dataclass(frozen=True)
class EnvRule:
    pattern: str
    action: str  # "allow" | "block"
    origin: Origin


@dataclass(frozen=True)
class EnvDecision:
    name: str
    passed: bool
    rule: EnvRule | None
    reason: str


class EnvFilter:
    def __init__(
        self,
        allow: list[EnvRule],
        block: list[EnvRule],
        *,
        inherit: str = "all",
        filter_values: bool = True,
        set_values: dict[str, tuple[str, Origin]] | None = None,
    ) -> None:
        self.allow = allow
        self.block = block
        self.inherit = inherit
        self.filter_values = filter_values
        self.set_values = dict(set_values or {})

    def decide(self, name: str, value: str) -> EnvDecision:
        if name in self.set_values:
            o = self.set_values[name][1]
            return EnvDecision(name, True, None, f"set explicitly by {o}")
        allows = [a for a in self.allow if name_matches(a.pattern, name)]
        if self.inherit == "none":
            return EnvDecision(name, False, None, "env.inherit = \"none\"")
        if self.inherit == "core" and not allows:
            return EnvDecision(name, False, None, "env.inherit = \"core\" and no allow pattern names it")
        for b in self.block:
            if not name_matches(b.pattern, name):
                continue
            if any(a.origin.index >= b.origin.index for a in allows):
                continue
            return EnvDecision(name, False, b, f"name matches {b.pattern} ({b.origin})")
        user_allows = [a for a in allows if a.origin.layer != "default"]
        if self.filter_values and not user_allows:
            kind = token_kind(value)
            if kind is not None:
                return EnvDecision(name, False, None, f"value looks like a {kind}")
        if allows:
            return EnvDecision(name, True, allows[-1], f"allowed by {allows[-1].pattern} ({allows[-1].origin})")
        return EnvDecision(name, True, None, "env.inherit = \"all\"")

    def apply(self, environ: dict[str, str], cli_env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
        passed: dict[str, str] = {}
        removed: list[str] = []
        for name, value in environ.items():
            if name in cli_env or name in self.set_values:
                continue
            if self.decide(name, value).passed:
                passed[name] = value
            else:
                removed.append(name)
        for name, (value, _) in self.set_values.items():
            passed[name] = value
        passed.update(cli_env)
        return passed, sorted(removed)


# ---------------------------------------------------------------------------
# variables that point at paths the sandbox hides

# Not checked: the sandbox sets these itself, and stockade's own settings name host
# paths (the state dir) on purpose.
PATH_REF_SKIP = frozenset({"PATH", "PWD", "OLDPWD", "HOME", "_"})


def path_refs(value: str) -> list[str]:
    """The absolute paths a value names: itself, or the words of a whitespace-separated
    list (``PIP_FIND_LINKS="/opt/a /opt/b"``). A value with a ``:`` is a search list
    (PATH, PYTHONPATH, LD_LIBRARY_PATH...: their readers skip a missing entry quietly,
    and ~/.local/bin would warn on every run) or a URL: not checked."""
    if ":" in value:
        return []
    return [w for w in value.split() if w.startswith("/")]


def hidden_refs(env: Mapping[str, str], visible: Callable[[str], bool]) -> list[tuple[str, str]]:
    """(name, path) for each variable naming a path that exists on the host but that
    the sandbox does not show (``visible`` answers for a resolved host path); the first
    such path of each variable. A path absent on the host too is left alone: the tool
    would meet the same absence outside."""
    out: list[tuple[str, str]] = []
    for name in sorted(env):
        if name in PATH_REF_SKIP or name.startswith("STOCKADE_"):
            continue
        for p in path_refs(env[name]):
            if p.startswith(("/dev/", "/proc/")):
                continue  # the sandbox's own /dev and /proc: such a path names its files there
            real = os.path.realpath(p)
            if os.path.exists(real) and not visible(real):
                out.append((name, p))
                break
    return out


def hidden_warning(name: str, path: str) -> str:
    # The variable still passes: dropping it would change what a tool does without a
    # word (its default may be worse than a clear "not found"); the user decides.
    return f"{name} points at {path}, hidden inside the sandbox (passed unchanged; drop: --env {name}= or env.block; show: stockade allow {path})"
