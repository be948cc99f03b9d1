"""The policy's tiers, lowest first: built-in defaults, the global file, the workspace
(``.stockade.toml`` / ``pyproject.toml``), the session's ``policy.json``, and the
command line (:class:`CliPolicy`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PolicyError
from . import config as _config
from .config import CommandEntry, HostEntry, Item, Layer, Origin, PathEntry
from .env import DEFAULT_ALLOW as ENV_DEFAULT_ALLOW
from .env import DEFAULT_BLOCK as ENV_DEFAULT_BLOCK
from .rules import is_under

DEFAULT_HOME_DENY = (
    ".ssh", ".aws", ".gnupg", ".config/gh", ".config/gcloud", ".azure", ".kube", ".docker",
    ".git-credentials", ".netrc", ".npmrc", ".pypirc",
)


@dataclass(frozen=True)
class CliPolicy:
    """Policy given on the command line (the last, highest layer)."""

    read_only: bool | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # --env K=V: always passes
    allow_paths: tuple[tuple[str, bool], ...] = ()  # --allow PATH[:rw] -> (path, writable)
    deny_paths: tuple[str, ...] = ()  # --deny PATH
    mask_mode: str | None = None  # --mask-mode absent|empty
    mask_patterns: tuple[str, ...] = ()  # --mask PATTERN
    unmask_patterns: tuple[str, ...] = ()  # --unmask PATTERN
    env_allow: tuple[str, ...] = ()  # --env-allow NAME|GLOB
    env_block: tuple[str, ...] = ()  # --env-block NAME|GLOB
    exec_allow: tuple[str, ...] | None = None  # --exec-allow DIR (repeatable)
    commands_deny: tuple[str, ...] = ()  # --deny-command "git push"
    cwd: str | None = None  # base for relative paths (default: os.getcwd())
    net_mode: str | None = None  # --net none|allow|host (None: the config's mode, else none)
    allow_hosts: tuple[str, ...] = ()  # --allow-host HOST[:PORT] | @preset
    forward: tuple[int | str, ...] = ()  # --forward PORT



# --------------------------------------------------------------------------- layers


def _default_layer(home: str, state: str) -> Layer:
    from .secrets import DEFAULT_ALLOW, DEFAULT_PATTERNS

    o = Origin("default")
    lay = Layer("default")
    lay.secret_patterns = [Item(p, o) for p in DEFAULT_PATTERNS]
    lay.secret_allow = [Item(p, o) for p in DEFAULT_ALLOW]
    lay.env_allow = [Item(p, o) for p in ENV_DEFAULT_ALLOW]
    lay.env_block = [Item(p, o) for p in ENV_DEFAULT_BLOCK]
    lay.paths = [PathEntry(_config.realpath(os.path.join(home, n)), "deny", o) for n in DEFAULT_HOME_DENY]
    lay.paths.append(PathEntry(_config.realpath(state), "deny", o))
    return lay


def _cli_layer(cli: CliPolicy, project: Path) -> Layer:
    base = Path(cli.cwd or os.getcwd())
    lay = Layer("cli")

    def o(flag: str) -> Origin:
        return Origin("cli", flag)

    def norm(raw: str, flag: str) -> str:
        p = os.path.expanduser(raw)
        if not p.strip():
            raise PolicyError(f"{flag}: empty path")
        return _config.realpath(p if os.path.isabs(p) else os.path.join(base, p))

    if cli.read_only is not None:
        lay.read_only = (cli.read_only, o("--read-only"))
    if cli.mask_mode is not None:
        if cli.mask_mode not in _config.MASK_MODES:
            raise PolicyError(f"--mask-mode: invalid value {cli.mask_mode!r}; expected absent or empty")
        lay.mask_mode = (cli.mask_mode, o("--mask-mode"))
    seen: dict[str, str] = {}
    for raw, writable in cli.allow_paths:
        p = norm(raw, "--allow")
        if not is_under(p, str(project)) and not _config.lexists(p):
            # refused, not warned: a run that goes ahead without the asked-for path is two outcomes
            raise PolicyError(f"--allow {raw}: no such file or directory ({p}); create it first, or fix the path")
        seen[p] = "allow"
        lay.paths.append(PathEntry(p, "rw" if writable else "ro", o("--allow")))
    for raw in cli.deny_paths:
        p = norm(raw, "--deny")
        if seen.get(p) == "allow":
            raise PolicyError(f"--allow and --deny both name {p}; keep one")
        lay.paths.append(PathEntry(p, "deny", o("--deny")))
    for pat in cli.mask_patterns:
        _config._check_pattern(pat, "--mask", None, "")
        lay.secret_patterns.append(Item(pat, o("--mask")))
    for pat in cli.unmask_patterns:
        _config._check_pattern(pat, "--unmask", None, "")
        lay.secret_allow.append(Item(pat, o("--unmask")))
    for pat in cli.env_allow:
        if not _config._ENV_PATTERN_RE.match(pat):
            raise PolicyError(f"--env-allow: {pat!r} is not a variable name or glob")
        lay.env_allow.append(Item(pat, o("--env-allow")))
    for pat in cli.env_block:
        if not _config._ENV_PATTERN_RE.match(pat):
            raise PolicyError(f"--env-block: {pat!r} is not a variable name or glob")
        lay.env_block.append(Item(pat, o("--env-block")))
    if cli.exec_allow is not None:
        lay.exec_allow = ([Item(norm(p, "--exec-allow"), o("--exec-allow")) for p in cli.exec_allow], o("--exec-allow"))
    for cmd in cli.commands_deny:
        argv = _config.split_command(cmd)
        if not argv:
            raise PolicyError("--deny-command: empty command")
        lay.commands_deny.append(CommandEntry(argv, o("--deny-command")))
    for name in cli.env:
        if not _config._ENV_NAME_RE.match(name):
            raise PolicyError(f"--env: {name!r} is not a valid environment variable name")
    if cli.net_mode is not None or cli.allow_hosts or cli.forward:
        _cli_network(cli, lay)
    return lay


def _cli_network(cli: CliPolicy, lay: Layer) -> None:
    from . import network as netpol

    if cli.net_mode is not None:
        if cli.net_mode not in netpol.MODES:
            raise PolicyError(f"--net {cli.net_mode!r} is not a network mode; use none, allow or host")
        lay.net_mode = (cli.net_mode, Origin("cli", "--net"))
    for raw in cli.allow_hosts:
        try:
            netpol.check_raw(raw)
        except netpol.PatternError as e:
            raise PolicyError(f"--allow-host: {e}; expected HOST[:PORT], *.DOMAIN, an IP address or CIDR, or @preset") from None
        lay.net_rules.append(HostEntry(raw.strip(), "allow", Origin("cli", "--allow-host"), "--allow-host"))
    for port in cli.forward:
        try:
            lay.net_forward.append((netpol.parse_forward(port), Origin("cli", "--forward")))
        except netpol.PatternError as e:
            raise PolicyError(f"--forward: {e}") from None


def read_layers(project: Path, session_dir: Path | None, cli: CliPolicy) -> tuple[list[Layer], list[str]]:
    """Every tier as a Layer, lowest first, plus warnings about the files themselves."""
    from ..paths import state_dir

    home = os.path.expanduser("~")
    layers = [_default_layer(home, state_dir())]
    warnings: list[str] = []
    g = _config.read_toml("global", _config.global_config_path())
    if g is not None:
        layers.append(_config.layer_from_source(g, project=project))
    w, ww = _config.workspace_sources(project)
    warnings += ww
    if w is not None:
        layers.append(_config.layer_from_source(w, project=project))
    if session_dir is not None:
        s = _config.read_json("session", _config.session_policy_path(session_dir))
        if s is not None:
            layers.append(_config.layer_from_source(s, project=project))
    layers.append(_cli_layer(cli, project))
    return layers, warnings
