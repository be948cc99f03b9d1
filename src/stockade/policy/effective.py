"""The merged policy of one run: :class:`Effective` (settings, path rules, secret
masks, environment, commands, limits, ``why``) and :func:`load`, which reads the
tiers and merges them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PolicyError
from . import config as _config
from .config import Item, Layer, Origin
from .env import EnvFilter, EnvRule
from .layers import CliPolicy, read_layers
from .rules import (
    Decision,
    PathResolution,
    Rule,
    exposure_warnings,
    is_under,
    path_rule,
    resolve_paths,
)
from .view import deny_refusal, sandbox_sees, why_outside

if TYPE_CHECKING:
    from ..cgroups.base import Limits
    from ..pathsig import Consulted
    from .network import HostDecision, NetPolicy
    from .secrets import Matcher, PatternRule


@dataclass(frozen=True)
class Masked:
    """A path inside a visible tree to hide: absent (whiteout) or empty, read-only."""

    path: Path
    is_dir: bool
    rule: str  # the pattern or path rule that masks it
    source: str  # the layer of that rule
    origin: str = ""  # "layer (file:line)"
    is_symlink: bool = False  # the entry itself is a symlink (mount over it would follow)


@dataclass(frozen=True)
class Grant:
    """An extra host path visible at the same path inside the sandbox."""

    host_path: Path
    writable: bool
    source: str
    origin: str = ""


# --------------------------------------------------------------------------- Effective

# (the key as written, the Layer attribute, the default)
_LIVE_SETTINGS: tuple[tuple[str, str, Any], ...] = (
    ("snapshots.auto_on_start", "snapshots_auto", False),
    ("snapshots.max_auto", "snapshots_max_auto", _config.DEFAULT_MAX_AUTO),
    ("snapshots.retention", "snapshots_retention", None),
    ("prewarm.enabled", "prewarm_enabled", False),
    ("prewarm.ttl", "prewarm_ttl", _config.DEFAULT_PREWARM_TTL),
    ("live.idle_timeout", "live_idle_timeout", _config.DEFAULT_IDLE_TIMEOUT),
    ("sessions.keep", "sessions_keep", _config.DEFAULT_SESSIONS_KEEP),
)


class Effective:
    """The merged policy of one run (or one `policy` command)."""

    def __init__(self, project: Path, session_dir: Path | None, cli: CliPolicy, layers: list[Layer], warnings: list[str]) -> None:
        self.project = Path(_config.realpath(str(project)))
        self.session_dir = session_dir
        self.cli = cli
        self.layers = layers
        self.home = _config.realpath(os.path.expanduser("~"))
        self.warnings: list[str] = list(warnings)
        self.files = [(lay.name, lay.file) for lay in layers if lay.file]

        def last(attr: str, default: Any) -> tuple[Any, Origin]:
            val: tuple[Any, Origin] = (default, Origin("default"))
            for lay in layers:
                v = getattr(lay, attr)
                if v is not None:
                    val = v
            return val

        self._read_only = last("read_only", False)
        self._mask_mode = last("mask_mode", "absent")
        self._secret_defaults = last("secret_defaults", True)
        self._env_inherit = last("env_inherit", "all")
        self._env_filter_values = last("env_filter_values", True)
        self._exec_allow: tuple[list[Item] | None, Origin] = last("exec_allow", None)
        self.read_only: bool = bool(self._read_only[0])
        self.mask_mode: str = str(self._mask_mode[0])
        if self._secret_defaults[0] is False:
            self.warnings.append(f"built-in secret patterns are disabled by {self._secret_defaults[1]}")

        use_default_secrets = bool(self._secret_defaults[0])
        self.secret_rules: list[tuple[str, str, Origin]] = []  # (pattern, deny|allow, origin)
        for lay in layers:
            if lay.name == "default" and not use_default_secrets:
                continue
            self.secret_rules += [(i.value, "deny", i.origin) for i in lay.secret_patterns]
            self.secret_rules += [(i.value, "allow", i.origin) for i in lay.secret_allow]
        self.env_rules = [
            EnvRule(i.value, "allow", i.origin) for lay in layers for i in lay.env_allow
        ] + [EnvRule(i.value, "block", i.origin) for lay in layers for i in lay.env_block]
        self.env_set: dict[str, tuple[str, Origin]] = {}
        for lay in layers:
            self.env_set.update(lay.env_set)
        self.command_entries = [c for lay in layers for c in lay.commands_deny]
        self.commands_deny: list[list[str]] = [list(c.argv) for c in self.command_entries]
        items = self._exec_allow[0]
        self.exec_allow: list[str] | None = None if items is None else [i.value for i in items]
        self.etc_items = [i for lay in layers for i in lay.etc_extra]
        # config limits: the latest layer sets each one; flags on the command line beat them
        self.limits_set: dict[str, tuple[int | float | None, str, Origin]] = {}
        for lay in layers:
            self.limits_set.update(lay.limits)
        self.etc_extra: list[str] = sorted({i.value for i in self.etc_items})
        self._network: NetPolicy = network_of(layers)
        # [snapshots], [prewarm], [live] (living sandboxes): the latest tier wins; seconds, None = never
        self._live_settings: dict[str, tuple[Any, Origin]] = {
            key: last(attr, default) for key, attr, default in _LIVE_SETTINGS}
        self.snapshots_auto: bool = bool(self._live_settings["snapshots.auto_on_start"][0])
        self.snapshots_max_auto: int = int(self._live_settings["snapshots.max_auto"][0])
        self.snapshots_retention: float | None = self._live_settings["snapshots.retention"][0]
        self.prewarm_enabled: bool = bool(self._live_settings["prewarm.enabled"][0])
        self.prewarm_ttl: float = float(self._live_settings["prewarm.ttl"][0])
        self.live_idle_timeout: float | None = self._live_settings["live.idle_timeout"][0]
        # [mcp] (`stockade mcp`): the latest tier wins
        self._mcp_allow_apply: tuple[bool, Origin] = last("mcp_allow_apply", False)
        self._mcp_max_output: tuple[int, Origin] = last("mcp_max_output", _config.DEFAULT_MCP_MAX_OUTPUT)
        self.mcp_allow_apply: bool = bool(self._mcp_allow_apply[0])
        self.mcp_max_output: int = int(self._mcp_max_output[0])
        self._observe: tuple[Any, Origin] = last("audit_observe", False)
        self.observe: bool = bool(self._observe[0])  # [audit] observe: `run --observe` by default
        self.observe_origin: Origin = self._observe[1]

        self.paths: PathResolution = resolve_paths(e for lay in layers for e in lay.paths)
        for d in self.paths.denies:
            why_not = deny_refusal(d.path) if d.origin.layer != "default" else None
            if why_not is not None:
                raise PolicyError(f"deny {d.path} ({d.origin}): {why_not}")
        self.warnings += self.paths.warnings
        self.warnings += exposure_warnings(self.paths, self.home, str(self.project))
        self.grants: list[Grant] = []
        self.exact_allow: dict[str, int] = {}
        for p, a in sorted(self.paths.allows.items()):
            if is_under(p, str(self.project)):
                self.exact_allow[p] = a.origin.index
                if a.access == "rw" and self.read_only:
                    self.warnings.append(
                        f"allow {p} --rw ({a.origin}) is inside the read-only project; it stays read-only"
                    )
                continue
            if not _config.lexists(p):
                self.warnings.append(f"allow {p} ({a.origin}): no such path; not granted")
                continue
            self.grants.append(Grant(Path(p), a.access == "rw", a.origin.layer, str(a.origin)))
        for pat, _action, o in self.secret_rules:
            if o.layer == "default":
                continue
            from .secrets import never_matches

            why = never_matches(pat)
            if why is not None:
                self.warnings.append(f"secret pattern {pat!r} ({o}) can never match: {why}")
        self.project_deny = self.paths.deny_covering(str(self.project))
        self._matcher: Matcher | None = None
        self._masked: dict[str, list[Masked]] = {}
        self.scan_stats: dict[str, dict[str, int]] = {}
        self.digest: str = self._digest()
        self._real_trees = frozenset([str(self.project), *(str(g.host_path) for g in self.grants)])
        self._base_warnings = tuple(self.warnings)
        self._env_memo: list[Any] = []
        self.scan_deps: dict[str, tuple[dict[str, Any], list[tuple[str, bool, bool, bool]], bool]] = {}
        self.cached_by: Consulted | None = None  # what load_cached revalidates (on the copies it hands out)

    def fresh_copy(self, session_dir: Path | None) -> Effective:
        """A copy for one more run: shares the merged rules, resets per-run state."""
        e = object.__new__(Effective)
        e.__dict__.update(self.__dict__)
        e.session_dir = session_dir
        e.warnings = list(self._base_warnings)
        e._masked = {}
        e.scan_stats = {}
        e.scan_deps = {}
        return e

    # ---- settings --------------------------------------------------------------
    def _digest(self) -> str:
        doc = {
            "read_only": self.read_only,
            "mask_mode": self.mask_mode,
            "project": str(self.project),
            "denies": sorted((d.path, d.origin.layer) for d in self.paths.denies),
            "grants": [(str(g.host_path), g.writable) for g in self.grants],
            "exact_allow": sorted(self.exact_allow.items()),
            "secrets": [(p, a, o.index) for p, a, o in self.secret_rules],
            "env": [(r.pattern, r.action, r.origin.index) for r in self.env_rules],
            "env_inherit": self._env_inherit[0],
            "env_filter_values": self._env_filter_values[0],
            "env_set": sorted(
                (k, hashlib.sha256(v.encode()).hexdigest()[:16]) for k, (v, _) in self.env_set.items()
            ),
            "cli_env": sorted(self.cli.env),
            "exec_allow": self.exec_allow,
            "commands_deny": self.commands_deny,
            "etc_extra": self.etc_extra,
            "limits": sorted((k, v[0]) for k, v in self.limits_set.items()),
            "network": self._network.digest,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    # ---- network -------------------------------------------------------------------
    @property
    def network(self) -> NetPolicy:
        """The run's network policy: every tier's [network] and host rules, the command
        line's --net/--allow-host/--forward, and STOCKADE_NET_RESOLVER (read now)."""
        from .network import env_resolver

        if self._network.mode != "allow":
            return self._network  # the variable is the proxy's: a run without one never reads it
        res = env_resolver()
        if res is None or res == self._network.resolver:
            return self._network
        return dataclasses.replace(self._network, resolver=res)

    def why_host(self, host: str, port: int) -> HostDecision:
        """Which host rule decides ``host:port`` (whatever the mode: the mode is said apart)."""
        net = self.network
        return dataclasses.replace(net, mode="allow").decide(host, port)

    # ---- environment -------------------------------------------------------------
    def env_filter(self) -> EnvFilter:
        return EnvFilter(
            [r for r in self.env_rules if r.action == "allow"],
            [r for r in self.env_rules if r.action == "block"],
            inherit=str(self._env_inherit[0]),
            filter_values=bool(self._env_filter_values[0]),
            set_values=self.env_set,
        )

    def env(self, environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
        """(environment passed to the sandbox incl. --env, names removed).

        The last answer for ``os.environ`` is kept (shared by the copies ``load_cached``
        hands out): a process usually runs many commands with one environment."""
        raw = getattr(environ, "_data", None) if environ is os.environ else None
        memo: list[Any] = self._env_memo  # the last few (environment, passed, removed), newest first
        if isinstance(raw, dict):
            for hit in memo:
                if hit[0] == raw:
                    return dict(hit[1]), list(hit[2])
        passed, removed = self.env_filter().apply(dict(environ), dict(self.cli.env))
        if isinstance(raw, dict):
            memo[:] = [(dict(raw), passed, removed), *memo[:3]]
        return dict(passed), list(removed)

    # ---- commands ------------------------------------------------------------------
    def check_command(self, argv: list[str]) -> str | None:
        """Reason the top-level command is refused, or None. Advisory for what a shell starts."""
        if not argv or not self.command_entries:
            return None
        head = [os.path.basename(argv[0]), *argv[1:]]
        for c in self.command_entries:
            rule = list(c.argv)
            cand = head if "/" not in rule[0] else [os.path.realpath(argv[0]) if os.path.isabs(argv[0]) else argv[0], *argv[1:]]
            if len(cand) >= len(rule) and cand[: len(rule)] == rule:
                return f"command '{' '.join(rule)}' is denied by {c.origin}"
        return None

    # ---- secrets -------------------------------------------------------------------
    def matcher(self) -> Matcher:
        if self._matcher is None:
            from .secrets import Matcher, PatternRule

            deny = [PatternRule(p, "deny", o) for p, a, o in self.secret_rules if a == "deny"]
            allow = [PatternRule(p, "allow", o) for p, a, o in self.secret_rules if a == "allow"]
            self._matcher = Matcher(deny, allow, self.exact_allow)
        return self._matcher

    def visible_trees(self) -> list[Path]:
        return [self.project, *(g.host_path for g in self.grants)]

    def masked(self, tree: Path) -> list[Masked]:
        """Paths inside ``tree`` (the project or a grant) to mask, sorted.

        Every call of a fresh policy rescans, incrementally: the scan cache (kept in
        memory, and on disk for runs of a session) is validated against each
        directory's inode and mtime."""
        from . import secrets

        root = str(tree)
        if root not in self._real_trees:
            root = os.path.realpath(root)
        if root in self._masked:
            return self._masked[root]
        m = self.matcher()
        denies = [d for d in self.paths.denies if is_under(d.path, root) and d.path != root]
        skip = [d.path for d in denies if os.path.isdir(d.path) and not os.path.islink(d.path)]
        scanner = secrets.SecretScanner(m, skip_dirs=skip)
        hits, err, scan = secrets.scan_cached(scanner, root, persist=self.session_dir is not None)
        if err is not None:
            self.warnings.append(err)
        self.scan_stats[root] = dict(scanner.stats)
        self.warnings += [f"secret scan: cannot list {e}" for e in scanner.errors]
        out: dict[str, Masked] = {}
        facts: list[tuple[str, bool, bool, bool]] = []  # (deny, lexists, islink, isdir)
        for d in denies:
            exists = os.path.lexists(d.path)
            is_link = exists and os.path.islink(d.path)
            is_dir = exists and os.path.isdir(d.path)
            facts.append((d.path, exists, is_link, is_dir))
            if not exists:
                continue
            out[d.path] = Masked(Path(d.path), is_dir and not is_link, d.path, d.origin.layer, str(d.origin), is_link)
        # what the result depends on, for stockade.warm (a later process revalidates it)
        self.scan_deps[root] = (scan, facts, bool(scanner.errors))
        for h in hits:
            p = os.path.join(root, h.rel)
            if any(is_under(p, q) for q in skip) or p in out:
                continue
            rule: PatternRule = m.deny[h.rule]
            out[p] = Masked(Path(p), h.kind == "d", rule.pattern, rule.origin.layer, str(rule.origin), h.kind == "l")
        # a mask inside a masked directory is redundant
        result: list[Masked] = []
        for p in sorted(out):
            if result and result[-1].is_dir and is_under(p, str(result[-1].path)):
                continue
            result.append(out[p])
        self._masked[root] = result
        return result

    def outside_masks(self) -> list[Masked]:
        """Denied paths the sandbox would see outside the project and the grants (the
        system dirs, the curated /etc): hidden like secrets, an empty read-only file or
        directory mounted over each, so ``why`` (DENIED) and the sandbox agree.

        Denies elsewhere (the home, /tmp, other trees) name paths the sandbox cannot see
        anyway; those inside the project and grants are masked by :meth:`masked`."""
        trees = [str(t) for t in self.visible_trees()]
        out: list[Masked] = []
        facts: list[tuple[str, bool, bool, bool]] = []
        for d in sorted(self.paths.denies, key=lambda d: d.path):
            p = d.path
            if any(is_under(p, t) for t in trees) or not sandbox_sees(p, self.etc_extra):
                continue
            exists = os.path.lexists(p)
            is_link = exists and os.path.islink(p)
            is_dir = exists and os.path.isdir(p)
            facts.append((p, exists, is_link, is_dir))
            if not exists or is_link:  # realpath'ed: a symlink here dangles or loops
                continue
            if out and out[-1].is_dir and is_under(p, str(out[-1].path)):
                continue  # inside a directory already masked
            out.append(Masked(Path(p), is_dir, p, d.origin.layer, str(d.origin)))
        # for stockade.warm: a later process revalidates these facts before reusing the plan
        self.scan_deps["(outside)"] = ({"dirs": {}}, facts, False)
        return out

    # ---- show / why ----------------------------------------------------------------
    def rules(self) -> list[Rule]:
        out: list[Rule] = []
        for name, val in (
            ("read_only", self._read_only),
            ("mask_mode", self._mask_mode),
            ("env.inherit", self._env_inherit),
            ("env.filter_values", self._env_filter_values),
        ):
            out.append(Rule("setting", "set", f"{name} = {json.dumps(val[0])}", val[1]))
        if self._exec_allow[0] is not None:
            for i in self._exec_allow[0]:
                out.append(Rule("exec", "allow", i.value, i.origin))
        void = {id(loser): winner for loser, winner in self.paths.void}
        for lay in self.layers:
            for e in lay.paths:
                if id(e) in void:
                    w = void[id(e)]
                    out.append(path_rule(e, active=False, note=f"overridden by {w.access} {w.path} ({w.origin})"))
                else:
                    note = ""
                    if e.access != "deny" and e.path in self.exact_allow:
                        note = "exception inside the project"
                    out.append(path_rule(e, note=note))
        for pat, action, o in self.secret_rules:
            out.append(Rule("secret", "mask" if action == "deny" else "allow", pat, o))
        for r in self.env_rules:
            out.append(Rule("env", r.action, r.pattern, r.origin))
        for name, (_, o) in self.env_set.items():
            out.append(Rule("env", "set", name, o))
        for c in self.command_entries:
            out.append(Rule("command", "deny", " ".join(c.argv), c.origin))
        for i in self.etc_items:
            out.append(Rule("etc", "allow", i.value, i.origin))
        for name, (_v, raw, o) in sorted(self.limits_set.items()):
            out.append(Rule("setting", "set", f"limits.{name} = {raw}", o))
        for key, (val, o) in self._live_settings.items():
            if o.layer != "default":  # listed once a tier sets it, as the limits
                shown = json.dumps(val) if isinstance(val, bool | int) else ('"none"' if val is None else f'"{val:g}s"')
                out.append(Rule("setting", "set", f"{key} = {shown}", o))
        mcp_settings: tuple[tuple[str, tuple[bool | int, Origin]], ...] = (
            ("mcp.allow_apply", self._mcp_allow_apply), ("mcp.max_output", self._mcp_max_output))
        for key, (setting, where) in mcp_settings:
            if where.layer != "default":
                out.append(Rule("setting", "set", f"{key} = {json.dumps(setting)}", where))
        net = self._network
        last = _last_mode(self.layers)
        for lay in self.layers:
            if lay.net_mode is not None:  # the last one set is in force
                out.append(Rule("setting", "set", f"network.mode = {json.dumps(lay.net_mode[0])}", lay.net_mode[1],
                                lay.net_mode[1] is last))
        for h in net.rules:
            o = Origin(h.tier, None if h.source in ("command line", h.tier) else h.source, h.line)
            out.append(Rule("host", h.action, h.pattern, o, note=f"preset {h.preset}" if h.preset else ""))
        for p in net.forward:
            out.append(Rule("forward", "allow", f"localhost:{p}", next(
                (o for lay in self.layers for q, o in lay.net_forward if q == p), Origin("cli"))))
        return out

    # ---- limits --------------------------------------------------------------------
    def limits_over(self, limits: Limits | None, requested: set[str] | None) -> tuple[Limits | None, set[str] | None]:
        """(limits, names asked for) with the config's limits applied.

        A flag on the command line (``requested``) beats the config; a complete
        ``Limits`` from the Python API (``requested`` None) is taken as it is. Limits the
        config names count as asked for: one it cannot enforce is refused, as a flag's."""
        if not self.limits_set or (limits is not None and requested is None):
            return limits, requested
        from ..cgroups.base import Limits

        req = set(requested or ())
        changes = {k: v[0] for k, v in self.limits_set.items() if k not in req}
        if not changes:
            return limits, requested
        base = limits if limits is not None else Limits.defaults()
        return base.replace(**changes), req | {k for k in changes if k in ("memory", "cpus", "pids")}

    def why(self, path: Path | str, *, resolved: bool = False) -> Decision:
        """``resolved``: ``path`` is already absolute with no symlink in it (observe mode
        resolves thousands with a per-directory memo)."""
        p = str(path) if resolved else os.path.realpath(os.path.abspath(os.path.expanduser(str(path))))
        beaten = tuple(path_rule(e, active=False) for e in self.paths.beaten(p))
        d = self.paths.deny_covering(p)
        if d is not None:
            rule = path_rule(d)
            what = f"denied by path rule {d.path}" if d.path == p else f"denied: inside {d.path}, denied by path rule"
            how = ""
            if not any(is_under(d.path, str(t)) for t in self.visible_trees()) and sandbox_sees(d.path, self.etc_extra):
                kind = "directory" if os.path.isdir(d.path) else "file"
                how = f"; hidden inside: an empty read-only {kind} is mounted over {d.path}"
            return Decision(p, False, "denied", rule, f"{what} from {d.origin}{how}", beaten)
        proj = str(self.project)
        tree: str | None = None
        grant: Grant | None = None
        if is_under(p, proj):
            tree = proj
        for g in self.grants:
            gp = str(g.host_path)
            if is_under(p, gp) and (tree is None or len(gp) > len(tree)):
                tree, grant = gp, g
        if tree is None:
            return self._why_outside(p, beaten)
        rel = os.path.relpath(p, tree)
        m = self.matcher()
        if rel != ".":
            parts = rel.split("/")
            for i in range(1, len(parts) + 1):
                sub = "/".join(parts[:i])
                full = os.path.join(tree, sub)
                is_dir = i < len(parts) or (os.path.isdir(full) and not os.path.islink(full))
                hit, exempt = m.decide(sub, is_dir, full)
                if hit is not None:
                    r = Rule("secret", "mask", hit.pattern, hit.origin)
                    inside = "" if i == len(parts) else f" (inside masked {full})"
                    mode = "reads as absent" if self.mask_mode == "absent" else "reads as empty"
                    return Decision(
                        p, False, "masked", r,
                        f"masked{inside}: matches sensitive pattern {hit.pattern!r} from {hit.origin}; {mode}",
                        beaten,
                    )
                if i == len(parts) and exempt:
                    ex = exempt[-1]
                    return Decision(
                        p, True, self._tree_access(grant), Rule("secret", "allow", ex.pattern, ex.origin),
                        f"visible: allow pattern {ex.pattern!r} from {ex.origin} exempts it from the sensitive patterns",
                        beaten,
                    )
        if p in self.exact_allow:
            a = self.paths.allows[p]
            return Decision(p, True, self._tree_access(grant), path_rule(a), f"visible: allowed explicitly by {a.origin}", beaten)
        if grant is not None:
            a = self.paths.allows[str(grant.host_path)]
            return Decision(
                p, True, self._tree_access(grant), path_rule(a),
                f"visible {'read-write' if grant.writable else 'read-only'}: granted {grant.host_path} by {a.origin}",
                beaten,
            )
        ro = self._read_only
        if self.read_only:
            return Decision(p, True, "ro", Rule("setting", "set", "read_only = true", ro[1]),
                            f"visible read-only: inside the project, read_only set by {ro[1]}", beaten)
        return Decision(p, True, "rw", None,
                        "visible: inside the project (writes land in the session's change set)", beaten)

    def _tree_access(self, grant: Grant | None) -> str:
        if grant is None:
            return "ro" if self.read_only else "rw"
        return "rw" if grant.writable else "ro"

    def _why_outside(self, p: str, beaten: tuple[Rule, ...]) -> Decision:
        return why_outside(p, beaten, project=str(self.project), home=self.home, etc_items=self.etc_items,
                           net_mode=self._network.mode)

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "project": str(self.project),
            "session_dir": str(self.session_dir) if self.session_dir else None,
            "files": [{"layer": n, "file": f} for n, f in self.files],
            "read_only": self.read_only,
            "mask_mode": self.mask_mode,
            "grants": [{"path": str(g.host_path), "writable": g.writable, "source": g.source, "origin": g.origin} for g in self.grants],
            "exec_allow": self.exec_allow,
            "commands_deny": self.commands_deny,
            "etc_extra": self.etc_extra,
            "network": self.network.to_json(),
            "snapshots": {"auto_on_start": self.snapshots_auto, "max_auto": self.snapshots_max_auto,
                          "retention": self.snapshots_retention},
            "prewarm": {"enabled": self.prewarm_enabled, "ttl": self.prewarm_ttl},
            "live": {"idle_timeout": self.live_idle_timeout},
            "mcp": {"allow_apply": self.mcp_allow_apply, "max_output": self.mcp_max_output},
            "rules": [r.to_json() for r in self.rules()],
            "warnings": self.warnings,
        }


def _last_mode(layers: list[Layer]) -> Origin | None:
    found: Origin | None = None
    for lay in layers:
        if lay.net_mode is not None:
            found = lay.net_mode[1]
    return found


def network_of(layers: list[Layer]) -> NetPolicy:
    """The NetPolicy the tiers state: the last mode set (else none), every tier's host
    rules with @presets expanded (the presets of every tier, a later one replacing an
    earlier one of the same name), the forwarded ports of every tier, the last resolver."""
    from . import network as netpol

    presets = dict(netpol.BUILTIN_PRESETS)
    for lay in layers:
        presets.update({k: v[0] for k, v in lay.net_presets.items()})
    mode = "none"
    resolver = None
    rules: list[netpol.HostRule] = []
    forward: list[int] = []
    for lay in layers:
        if lay.net_mode is not None:
            mode = lay.net_mode[0]
        if lay.net_resolver is not None:
            resolver = lay.net_resolver[0]
        for e in lay.net_rules:
            o = e.origin
            try:
                pairs = netpol.expand(e.raw, presets)
            except netpol.PatternError as err:
                if o.layer == "cli":
                    raise PolicyError(f"{e.key}: {err}") from None
                where = o.file if o.line is None else f"{o.file}:{o.line}"
                raise PolicyError(f"{where}: {e.key}: {err}") from None
            source = "command line" if o.layer == "cli" else (o.file or o.layer)
            for pat, preset in pairs:
                rules.append(netpol.HostRule(pat, e.action, o.layer, source, preset, o.line))
        for p, _o in lay.net_forward:
            if p not in forward:
                forward.append(p)
    return netpol.NetPolicy(mode=mode, rules=tuple(rules), forward=tuple(forward), resolver=resolver,
                            presets=tuple(sorted(presets.items())))


def load(project: Path, session_dir: Path | None, cli: CliPolicy | None = None, *, strict: bool = True) -> Effective:
    """Read and merge every tier. ``strict`` refuses a project that a rule denies."""
    cli = cli or CliPolicy()
    project = Path(os.path.realpath(project))
    layers, warnings = read_layers(project, session_dir, cli)
    eff = Effective(project, session_dir, cli, layers, warnings)
    if strict and eff.project_deny is not None:
        d = eff.project_deny
        raise PolicyError(
            f"the project {project} is inside {d.path}, denied by {d.origin}; "
            f"remove that deny, or allow {d.path} itself in a later layer (deny wins over allows of paths inside it)"
        )
    return eff
