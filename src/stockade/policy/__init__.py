"""Layered policy: what a sandbox may see and do, and why.

``load(project, session_dir, cli)`` reads the tiers (default < global < workspace <
session < cli), merges them (settings: the later layer wins; paths and patterns:
deny wins, see :mod:`stockade.policy.rules`) and returns an :class:`Effective`
policy the plan builder turns into mounts, Landlock rules and an environment.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PolicyError
from ..pathsig import file_sig as _file_sig
from ..pathsig import paths_hold
from . import config as _config
from .config import CommandEntry, Item, Layer, Origin, PathEntry
from .env import DEFAULT_ALLOW as ENV_DEFAULT_ALLOW
from .env import DEFAULT_BLOCK as ENV_DEFAULT_BLOCK
from .env import EnvFilter, EnvRule
from .rules import (
    Decision,
    PathResolution,
    Rule,
    exposure_warnings,
    is_under,
    path_rule,
    resolve_paths,
)

if TYPE_CHECKING:
    from .secrets import Matcher, PatternRule

__all__ = [
    "CliPolicy",
    "Decision",
    "Effective",
    "Grant",
    "Masked",
    "PolicyError",
    "Rule",
    "deny_refusal",
    "load",
    "sandbox_sees",
]

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
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


# /etc entries the runtime writes itself (resolv.conf only with --net host)
ETC_MADE = ("passwd", "group", "hostname", "hosts", "resolv.conf")
# private in the sandbox: a host path beneath these is never what the sandbox sees there
_OWN_MOUNTS = ("/dev/shm", "/dev/mqueue")


def sandbox_sees(p: str, etc_extra: Sequence[str] = ()) -> bool:
    """Whether the sandbox shows the host path ``p`` (resolved) outside the project and
    the grants: beneath a system dir or a curated /etc entry."""
    from ..plan import ETC_ALLOW, system_layout

    for d, link in system_layout():
        if link is None and is_under(p, d):
            return True
    if p == "/etc":
        return True
    if is_under(p, "/etc"):
        return any(is_under(p, "/etc/" + n) for n in (*ETC_MADE, *ETC_ALLOW)) or any(is_under(p, e) for e in etc_extra)
    return False


def deny_refusal(p: str) -> str | None:
    """Why a deny of ``p`` (resolved) cannot be honoured, or None.

    /proc and /dev inside are the sandbox's own (a new procfs, a minimal /dev): a host
    path there is not what the sandbox sees, so neither hiding it nor ``why`` could be
    right."""
    if any(is_under(p, o) for o in _OWN_MOUNTS):
        return None
    if is_under(p, "/proc") or is_under(p, "/dev"):
        top = "/proc" if is_under(p, "/proc") else "/dev"
        return (f"{p} is inside {top}, which the sandbox gets its own of "
                f"({'a new procfs' if top == '/proc' else 'a minimal /dev'}); a deny there cannot be honoured, remove it")
    return None


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
    return lay


def read_layers(project: Path, session_dir: Path | None, cli: CliPolicy) -> tuple[list[Layer], list[str]]:
    """Every tier as a Layer, lowest first, plus warnings about the files themselves."""
    from ..session.store import state_dir

    home = os.path.expanduser("~")
    layers = [_default_layer(home, str(state_dir()))]
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


# --------------------------------------------------------------------------- Effective


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
        self.cached_by: _Cached | None = None  # set on the copies load_cached hands out

    def _fresh(self, session_dir: Path | None) -> Effective:
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
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

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
        scanner = secrets.Scanner(m, skip_dirs=skip)
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
        return out

    # ---- limits --------------------------------------------------------------------
    def limits_over(self, limits: Any, requested: set[str] | None) -> tuple[Any, set[str] | None]:
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

    def why(self, path: Path | str) -> Decision:
        p = os.path.realpath(os.path.abspath(os.path.expanduser(str(path))))
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
        dflt = Origin("default")
        for s in SYSTEM_DIRS:
            if is_under(p, s):
                return Decision(p, True, "ro", Rule("path", "allow-ro", s, dflt), f"visible read-only: system directory {s}", beaten)
        if is_under(p, "/proc") or is_under(p, "/dev"):
            return self._why_own(p, beaten)
        if is_under(p, "/etc"):
            for i in self.etc_items:
                if is_under(p, i.value):
                    return Decision(p, True, "ro", Rule("etc", "allow", i.value, i.origin),
                                    f"visible read-only: etc.extra {i.value} from {i.origin}", beaten)
            from ..plan import ETC_ALLOW

            for n in (*ETC_MADE[:4], *ETC_ALLOW):  # resolv.conf: only with --net host
                if is_under(p, "/etc/" + n) and (n in ETC_MADE or os.path.lexists("/etc/" + n)):
                    made = n in ETC_MADE
                    return Decision(p, True, "ro", None,
                                    f"visible read-only: {'written by the runtime' if made else 'a curated entry'} (/etc/{n})", beaten)
            return Decision(p, False, "absent", None,
                            "/etc is hidden except the runtime's curated entries (passwd, hosts, ssl/certs, ...) and etc.extra",
                            beaten)
        if is_under(str(self.project), p):
            return Decision(p, False, "absent", None,
                            "not visible: a parent of the project (only the project itself is mounted)", beaten)
        if is_under(p, "/tmp"):
            return Decision(p, False, "absent", None, "/tmp is a private, empty tmpfs inside the sandbox", beaten)
        if is_under(p, self.home):
            return Decision(p, False, "absent", None,
                            f"not visible: {self.home} is an empty tmpfs inside the sandbox; only the project and grants are visible",
                            beaten)
        return Decision(p, False, "absent", None, "not visible: outside the project and every grant", beaten)

    def _why_own(self, p: str, beaten: tuple[Rule, ...]) -> Decision:
        """/proc and /dev: the sandbox has its own (a new procfs, a minimal /dev)."""
        from ..plan import DEVICES, PROC_MASKED, PROC_MASKED_DIRS, PROC_READONLY

        if is_under(p, "/proc"):
            top = p[len("/proc/"):].split("/", 1)[0] if p != "/proc" else ""
            if top.isdigit():
                return Decision(p, False, "absent", None,
                                "a host process: the sandbox's own procfs shows only the processes of its PID namespace", beaten)
            if top in PROC_MASKED or top in PROC_MASKED_DIRS:
                return Decision(p, False, "masked", None, f"masked: /proc/{top} is hidden in the sandbox's procfs", beaten)
            if top in PROC_READONLY:
                return Decision(p, True, "ro", None, f"visible read-only: /proc/{top} (kernel tunables) is read-only inside", beaten)
            return Decision(p, True, "ro", None, "visible: the sandbox's own procfs (its own processes)", beaten)
        if any(is_under(p, "/dev/" + d) for d in (*DEVICES, "pts", "ptmx")):
            return Decision(p, True, "rw", None, "visible: a device of the sandbox's minimal /dev (its own devpts)", beaten)
        if is_under(p, "/dev/shm") or is_under(p, "/dev/mqueue"):
            return Decision(p, False, "absent", None, "/dev/shm inside is a private, empty tmpfs", beaten)
        if p == "/dev":
            return Decision(p, True, "ro", None, "visible: the sandbox's minimal /dev", beaten)
        return Decision(p, False, "absent", None,
                        "/dev inside is minimal: null, zero, full, random, urandom, tty, pts, shm", beaten)

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
            "rules": [r.to_json() for r in self.rules()],
            "warnings": self.warnings,
        }


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

RACY_NS = 2_000_000_000
_ENV_KEYS = ("HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "STOCKADE_STATE_DIR")


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


class _Cached:
    """One cached policy and what it depends on."""

    def __init__(self, eff: Effective, files: list[tuple[str, Any, bytes | None]], notes: list[tuple[str, str, object]], started_ns: int) -> None:
        import stat as _stat

        self.eff = eff
        # (file, stat signature, content while racy)
        self.files = files
        # A path with no symlink along it keeps resolving to itself while none of its
        # components is a symlink. A directory whose identity and mtime are unchanged
        # has the same entries (none can have been replaced by a symlink); one that
        # changed (or changed within RACY_NS of the recording, so may change again
        # unseen) has the entries on the recorded paths checked one by one.
        # dir -> [(dev, ino, mtime) or None when racy, entries of it on the paths]
        self.dirs: dict[str, list[Any]] = {}
        self.resolved: list[tuple[str, str]] = []  # (raw, realpath) resolved again each time
        self.exists: list[tuple[str, bool]] = []
        for kind, raw, result in notes:
            if kind == "lexists":
                self.exists.append((raw, bool(result)))
                continue
            norm = os.path.normpath(raw)
            if result != norm or not raw.startswith("/"):
                self.resolved.append((raw, str(result)))
                continue
            parts = norm.split("/")[1:]
            cur = "/"
            for i, part in enumerate(parts):
                ent = self.dirs.get(cur)
                if ent is None:
                    try:
                        st = os.lstat(cur)
                    except OSError:
                        self.resolved.append((raw, str(result)))
                        break
                    racy = st.st_mtime_ns >= started_ns - RACY_NS
                    ent = self.dirs[cur] = [None if racy else (st.st_dev, st.st_ino, st.st_mtime_ns), []]
                child = os.path.join(cur, part)
                if child not in ent[1]:
                    ent[1].append(child)
                if i == len(parts) - 1:
                    break
                try:
                    st = os.lstat(child)
                except OSError:
                    break  # missing: it cannot appear without its parent changing
                if not _stat.S_ISDIR(st.st_mode):
                    break
                cur = child

    def valid(self, sigs: list[Any]) -> bool:
        """Still the policy loading would give now? ``sigs``: the files' signatures now."""
        import time

        if [s for _f, s, _c in self.files] != sigs:
            return False
        now = time.time_ns()
        for i, (path, sig, content) in enumerate(self.files):
            if content is not None:
                if _read_bytes(path) != content:
                    return False
                if sig is not None and sig[3] < now - RACY_NS:
                    self.files[i] = (path, sig, None)
        if not paths_hold(self.dirs):
            return False
        for raw, real in self.resolved:
            if os.path.realpath(raw) != real:
                return False
        return all(os.path.lexists(p) == e for p, e in self.exists)


_CACHE: dict[tuple[Any, ...], _Cached] = {}
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
    if hit is not None and hit.valid(sigs):
        out = hit.eff._fresh(session_dir)
        out.cached_by = hit
        return out
    # contents of files changed within the timestamp granularity are read *before*
    # loading: a later change then shows up as a difference
    started = time.time_ns()
    recorded: list[tuple[str, Any, bytes | None]] = []
    for f, sig in zip(files, sigs, strict=True):
        racy = sig is not None and sig[3] >= started - RACY_NS
        recorded.append((f, sig, _read_bytes(f) if racy else None))
    with _config.noting() as notes:
        eff = load(project, session_dir, cli)
    eff.matcher()  # shared by the copies
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    entry = _CACHE[key] = _Cached(eff, recorded, notes, started)
    out = eff._fresh(session_dir)
    out.cached_by = entry
    return out


def clear_cache() -> None:
    """Forget cached policies and scans (tests)."""
    from . import secrets

    _CACHE.clear()
    _FILES.clear()
    _CLI_KEYS.clear()
    secrets._SCANS.clear()
