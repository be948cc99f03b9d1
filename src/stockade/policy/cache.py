"""``load_cached``: the merged policy kept per process and revalidated on every call."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..pathsig import RACY_NS, Consulted, read_bytes
from ..pathsig import file_sig as _file_sig
from . import config as _config
from .effective import Effective, load
from .layers import CliPolicy

# --------------------------------------------------------------------------- cached load
#
# A process that runs many commands (an agent's Sandbox) loads the same policy again
# and again. ``load_cached`` keeps the merged policy and revalidates it on every call
# against everything loading consulted: each tier's file (stat: device, inode, size,
# mtime and ctime; a file changed within RACY_NS of being read is compared by content
# until it is older), the variables that locate the files, and every path that was
# resolved or tested (a path with no symlink along it resolves to itself until one of
# its components becomes a symlink; any other is resolved again). Secrets are not part
# of it: ``Effective.masked`` rescans (incrementally) on every fresh copy.

_ENV_KEYS = ("HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "STOCKADE_STATE_DIR")


_CACHE: dict[tuple[Any, ...], tuple[Effective, Consulted]] = {}
_CACHE_MAX = 64
_ENV_KEYS_B = tuple(os.fsencode(k) for k in _ENV_KEYS)
_FILES: dict[tuple[Any, ...], list[str]] = {}
_CLI_KEYS: dict[int, tuple[CliPolicy, tuple[Any, ...]]] = {}
_DEFAULT_CLI = CliPolicy()


def _cli_key(cli: CliPolicy) -> tuple[Any, ...]:
    out: list[Any] = []
    for k, v in sorted(cli.__dict__.items()):
        out.append((k, tuple(sorted(v.items())) if isinstance(v, Mapping) else v))
    return tuple(out)


def load_cached(project: Path, session_dir: Path | None, cli: CliPolicy | None = None) -> Effective:
    """``load(project, session_dir, cli)`` (strict), from the cache while it still holds.

    The result is a fresh copy: its secret masks are recomputed on first use."""
    import time

    cli = cli or _DEFAULT_CLI
    proj = str(project)
    sdir = str(session_dir) if session_dir is not None else None
    raw_env = getattr(os.environ, "_data", None)
    if isinstance(raw_env, dict):
        env_key: tuple[Any, ...] = tuple(raw_env.get(k) for k in _ENV_KEYS_B)
    else:  # pragma: no cover - os.environ without its bytes mapping
        env_key = tuple(os.environ.get(k) for k in _ENV_KEYS)
    fkey = (proj, env_key)
    common = _FILES.get(fkey)
    if common is None:
        common = [str(_config.global_config_path()), os.path.join(proj, ".stockade.toml"), os.path.join(proj, "pyproject.toml")]
        if len(_FILES) > 256:
            _FILES.clear()
        _FILES[fkey] = common
    files = common if sdir is None else [*common, sdir + "/policy.json"]
    sigs = [_file_sig(f) for f in files]
    # the session tier is part of the key only when the session has a policy file
    has_session_policy = sdir is not None and sigs[-1] is not None
    needs_cwd = bool(cli.allow_paths or cli.deny_paths or cli.exec_allow) and cli.cwd is None
    ck = _CLI_KEYS.get(id(cli))
    if ck is None or ck[0] is not cli:
        ck = (cli, _cli_key(cli))
        if len(_CLI_KEYS) > 64:
            _CLI_KEYS.clear()
        _CLI_KEYS[id(cli)] = ck
    key = (proj, sdir if has_session_policy else None, ck[1], os.getcwd() if needs_cwd else None, env_key)
    hit = _CACHE.get(key)
    if hit is not None and hit[1].valid(sigs):
        out = hit[0].fresh_copy(session_dir)
        out.cached_by = hit[1]
        return out
    # contents of files changed within the timestamp granularity are read *before*
    # loading: a later change then shows up as a difference
    started = time.time_ns()
    recorded: list[tuple[str, Any, bytes | None]] = []
    for f, sig in zip(files, sigs, strict=True):
        racy = sig is not None and sig[3] >= started - RACY_NS
        recorded.append((f, sig, read_bytes(f) if racy else None))
    with _config.noting() as notes:
        eff = load(project, session_dir, cli)
    eff.matcher()  # shared by the copies
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    entry = Consulted(recorded, notes, started)
    _CACHE[key] = (eff, entry)
    out = eff.fresh_copy(session_dir)
    out.cached_by = entry
    return out


def clear_cache() -> None:
    """Forget cached policies and scans (tests)."""
    from . import secrets

    _CACHE.clear()
    _FILES.clear()
    _CLI_KEYS.clear()
    secrets._SCANS.clear()
