"""Policy tiers: parse, validate and locate every setting of every layer.

Layers, lowest precedence first::

    default    built in (secret patterns, env lists, sensitive home dirs)
    global     $XDG_CONFIG_HOME/stockade/config.toml (~/.config/stockade/config.toml)
    workspace  <project>/.stockade.toml, else [tool.stockade] in <project>/pyproject.toml
    session    <session dir>/policy.json (written by `stockade allow/deny`)
    cli        flags of `stockade run` / `explain`

Every value parsed keeps an :class:`Origin` (layer, file, line) so `policy show` and
`policy why` can say where a rule came from.  Bad input raises :class:`PolicyError`
naming the file, the line and the key; unknown keys list the valid ones.
"""

from __future__ import annotations

import _thread
import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PolicyError

LAYERS: tuple[str, ...] = ("default", "global", "workspace", "session", "cli")
LAYER_INDEX: dict[str, int] = {name: i for i, name in enumerate(LAYERS)}

ACCESS_VALUES = ("ro", "rw", "deny")
MASK_MODES = ("absent", "empty")
INHERIT_VALUES = ("all", "core", "none")
SESSION_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Origin:
    """Where a value came from: the layer, and the file and line when there is one."""

    layer: str
    file: str | None = None
    line: int | None = None

    @property
    def index(self) -> int:
        return LAYER_INDEX[self.layer]

    def __str__(self) -> str:
        if self.file is None:
            return self.layer
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{self.layer} ({where})"

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "file": self.file, "line": self.line}


@dataclass(frozen=True)
class PathEntry:
    path: str  # absolute, normalized host path
    access: str  # ro | rw | deny
    origin: Origin


@dataclass(frozen=True)
class Item:
    """One string value of a list setting, with its origin."""

    value: str
    origin: Origin


@dataclass(frozen=True)
class HostEntry:
    """One host pattern of a tier as written (``@preset`` not yet expanded)."""

    raw: str
    action: str  # allow | deny
    origin: Origin
    key: str  # where it was given: "network.allow[2]", "hosts[0].host", "--allow-host"


@dataclass(frozen=True)
class CommandEntry:
    argv: tuple[str, ...]
    origin: Origin


@dataclass
class Layer:
    """The settings one tier states. ``None`` means "not set here"."""

    name: str
    file: str | None = None
    read_only: tuple[bool, Origin] | None = None
    mask_mode: tuple[str, Origin] | None = None
    paths: list[PathEntry] = field(default_factory=list)
    secret_defaults: tuple[bool, Origin] | None = None
    secret_patterns: list[Item] = field(default_factory=list)
    secret_allow: list[Item] = field(default_factory=list)
    env_allow: list[Item] = field(default_factory=list)
    env_block: list[Item] = field(default_factory=list)
    env_set: dict[str, tuple[str, Origin]] = field(default_factory=dict)
    env_inherit: tuple[str, Origin] | None = None
    env_filter_values: tuple[bool, Origin] | None = None
    exec_allow: tuple[list[Item], Origin] | None = None
    commands_deny: list[CommandEntry] = field(default_factory=list)
    etc_extra: list[Item] = field(default_factory=list)
    limits: dict[str, tuple[int | float | None, str, Origin]] = field(default_factory=dict)  # name -> (value, as written, origin)
    # [network] (and a session's "hosts"): policy/network.py builds the run's NetPolicy from them
    net_mode: tuple[str, Origin] | None = None
    net_rules: list[HostEntry] = field(default_factory=list)
    net_forward: list[tuple[int, Origin]] = field(default_factory=list)
    net_resolver: tuple[tuple[str, int], Origin] | None = None
    net_presets: dict[str, tuple[tuple[str, ...], Origin]] = field(default_factory=dict)
    # [snapshots], [prewarm], [live]: living sandboxes (stockade.live); seconds, None = never
    snapshots_auto: tuple[bool, Origin] | None = None
    snapshots_max_auto: tuple[int, Origin] | None = None
    snapshots_retention: tuple[float | None, Origin] | None = None
    prewarm_enabled: tuple[bool, Origin] | None = None
    prewarm_ttl: tuple[float, Origin] | None = None
    live_idle_timeout: tuple[float | None, Origin] | None = None
    # [mcp]: `stockade mcp` (stockade.mcp): apply through the server, each stream's cap in bytes
    mcp_allow_apply: tuple[bool, Origin] | None = None
    mcp_max_output: tuple[int, Origin] | None = None
    # [sessions] (global config only): how long sessions without unapplied changes stay
    sessions_keep: tuple[float | None, Origin] | None = None
    # [audit] observe: log what each run's command tried (`run --observe`)
    audit_observe: tuple[bool, Origin] | None = None
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- schema

# A schema node is: a type (bool, str), a tuple of allowed strings, a list of one
# node (array), a dict of key -> node (table), or the marker MAP_STR (str -> str table)
# or STR_OR_ARGV (a command: "git push" or ["git", "push"]).
MAP_STR = "map-of-strings"
MAP_STR_LIST = "map-of-string-arrays"  # [network.presets]: name = ["host", ...]
STR_OR_ARGV = "string-or-argv"
SCALAR = "string-or-number"  # a limit: "512M", 256, 1.5, "none"
DURATION = "duration"  # "30s", "15m", "24h", a number of seconds (checked further when read)

SCHEMA: dict[str, Any] = {
    "read_only": bool,
    "mask_mode": MASK_MODES,
    "paths": [{"path": str, "access": ACCESS_VALUES, "added_at": str}],
    "secrets": {"defaults": bool, "patterns": [str], "allow": [str]},
    "env": {
        "inherit": INHERIT_VALUES,
        "allow": [str],
        "block": [str],
        "set": MAP_STR,
        "filter_values": bool,
    },
    "exec": {"allow": [str]},
    "commands": {"deny": [STR_OR_ARGV]},
    "etc": {"extra": [str]},
    # the README's `limits = { memory = "512M", pids = 256 }` (or a [limits] table)
    "limits": {n: SCALAR for n in ("memory", "cpus", "pids", "timeout", "cpu_time", "max_file_size", "nofile",
                                    "disk", "disk_floor")},
    "network": {
        "mode": ("none", "allow", "host"),
        "allow": [str],
        "deny": [str],
        "forward": [SCALAR],  # 5432 or "5432"
        "resolver": str,
        "presets": MAP_STR_LIST,
    },
    # living sandboxes: checked further (ranges, durations) by _live_from_source
    "snapshots": {"auto_on_start": bool, "max_auto": int, "retention": DURATION},
    "prewarm": {"enabled": bool, "ttl": DURATION},
    "live": {"idle_timeout": DURATION},
    # `stockade mcp`: checked further by _mcp_from_source
    "mcp": {"allow_apply": bool, "max_output": SCALAR},
    # session retention (changes/retention.py): the global config only, checked by _sessions_from_source
    "sessions": {"keep": DURATION},
    "audit": {"observe": bool},
}
# a session's host rules (`stockade allow --host`, `deny --host`)
SESSION_SCHEMA: dict[str, Any] = {"schema_version": int, **SCHEMA,
                                  "hosts": [{"host": str, "action": ("allow", "deny"), "added_at": str}]}
REQUIRED_IN_TABLE: dict[str, tuple[str, ...]] = {"paths": ("path",), "hosts": ("host", "action")}

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_PATTERN_RE = re.compile(r"^[A-Za-z0-9_*?\[\]!-]+$")


def _type_name(node: Any) -> str:
    if node is bool:
        return "true or false"
    if node is str:
        return "a string"
    if node is int:
        return "an integer"
    if isinstance(node, tuple):
        return "one of " + ", ".join(repr(v) for v in node)
    if isinstance(node, list):
        return "an array of " + _type_name(node[0]).removeprefix("a ").removeprefix("an ") + "s"
    if node == MAP_STR:
        return "a table of strings"
    if node == MAP_STR_LIST:
        return "a table of arrays of strings"
    if node == STR_OR_ARGV:
        return "a string or an array of strings"
    if node == SCALAR:
        return "a string or a number"
    if node == DURATION:
        return 'a duration ("30s", "15m", "24h") or a number of seconds'
    return "a table"


# --------------------------------------------------------------------------- locating


class Locator:
    """Finds the line of a key (or of a value inside an array) in TOML or JSON text.

    tomllib and json give no positions for keys; this scanner is good enough for
    error messages and provenance: it understands table headers, arrays of tables
    and dotted keys.
    """

    _HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")
    _KEY = re.compile(r"""^\s*((?:"[^"]*"|'[^']*'|[A-Za-z0-9_-]+)(?:\s*\.\s*(?:"[^"]*"|'[^']*'|[A-Za-z0-9_-]+))*)\s*=""")

    def __init__(self, text: str, fmt: str, prefix: tuple[str, ...] = ()) -> None:
        self.lines = text.splitlines()
        self.fmt = fmt
        self.prefix = prefix
        self._index: dict[tuple[str | int, ...], int] = {}
        if fmt == "toml":
            self._index_toml()

    @staticmethod
    def _split_dotted(s: str) -> list[str]:
        parts = re.findall(r"""("[^"]*"|'[^']*'|[^.\s]+)""", s)
        return [p.strip("\"'") for p in parts]

    def _index_toml(self) -> None:
        table: list[str | int] = []
        aot_counts: dict[tuple[str, ...], int] = {}
        depth = 0  # bracket depth of a multi-line array value
        for no, raw in enumerate(self.lines, 1):
            if depth > 0:
                depth += self._balance(raw)
                continue
            m = self._HEADER.match(raw)
            if m:
                names = self._split_dotted(m.group(2))
                if m.group(1) == "[[":
                    key = tuple(names)
                    aot_counts[key] = aot_counts.get(key, -1) + 1
                    table = [*names, aot_counts[key]]
                else:
                    table = list(names)
                self._index.setdefault(tuple(table), no)
                if m.group(1) == "[[":
                    self._index.setdefault(tuple(names), no)
                continue
            k = self._KEY.match(raw)
            if k:
                depth = max(0, self._balance(raw[k.end():]))
                full = tuple([*table, *self._split_dotted(k.group(1))])
                self._index.setdefault(full, no)
                for i in range(len(table) + 1, len(full)):
                    self._index.setdefault(full[:i], no)

    _STRING = re.compile(r""""(?:[^"\\]|\\.)*"|'[^']*'""")

    @classmethod
    def _balance(cls, text: str) -> int:
        """Net count of opening brackets in ``text``, ignoring strings and comments."""
        code = cls._STRING.sub("", text).split("#")[0]
        return code.count("[") + code.count("{") - code.count("]") - code.count("}")

    def line(self, path: Sequence[str | int], value: str | None = None) -> int | None:
        full = (*self.prefix, *path)
        if self.fmt == "toml":
            found: int | None = None
            for cut in range(len(full), 0, -1):
                if full[:cut] in self._index:
                    found = self._index[full[:cut]]
                    break
        else:
            found = self._json_line(full)
        if value is not None and found is not None:
            needle_d, needle_s = json.dumps(value), f"'{value}'"
            for no in range(found, min(found + 2000, len(self.lines)) + 1):
                text = self.lines[no - 1]
                if needle_d in text or needle_s in text:
                    return no
        return found

    def _json_line(self, full: Sequence[str | int]) -> int | None:
        pos = 0
        text = "\n".join(self.lines)
        last: int | None = None
        for part in full:
            if isinstance(part, int):
                continue
            i = text.find(json.dumps(part), pos)
            if i < 0:
                break
            pos = i + 1
            last = text.count("\n", 0, i) + 1
        return last


def _err(file: str, line: int | None, key: str, msg: str) -> PolicyError:
    where = f"{file}:{line}" if line else file
    return PolicyError(f"{where}: {key}: {msg}" if key else f"{where}: {msg}")


def _dotted(path: Sequence[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


# --------------------------------------------------------------------------- validation


def validate(data: Any, schema: Mapping[str, Any], file: str, loc: Locator) -> None:
    """Check ``data`` against ``schema``; raise PolicyError naming file, line and key."""

    def fail(path: list[str | int], msg: str, value: str | None = None) -> PolicyError:
        return _err(file, loc.line(path, value), _dotted(path), msg)

    def walk(node: Any, value: Any, path: list[str | int]) -> None:
        if isinstance(node, dict):
            if not isinstance(value, dict):
                raise fail(path, f"expected {_type_name(node)}, got {type(value).__name__}")
            for k, v in value.items():
                if k not in node:
                    valid = ", ".join(sorted(node))
                    raise fail([*path, k], f"unknown key; valid keys here: {valid}")
                walk(node[k], v, [*path, k])
            last = path[-2] if len(path) >= 2 and isinstance(path[-1], int) else None
            for req in REQUIRED_IN_TABLE.get(str(last), ()):
                if req not in value:
                    raise fail(path, f"missing required key {req!r}")
        elif isinstance(node, list):
            if not isinstance(value, list):
                raise fail(path, f"expected {_type_name(node)}, got {type(value).__name__}")
            for i, v in enumerate(value):
                walk(node[0], v, [*path, i])
        elif isinstance(node, tuple):
            if value not in node:
                raise fail(path, f"invalid value {value!r}; expected {_type_name(node)}")
        elif node == MAP_STR:
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise fail(path, f"expected {_type_name(node)}")
        elif node == MAP_STR_LIST:
            if not isinstance(value, dict):
                raise fail(path, f"expected {_type_name(node)}")
            for k, v in value.items():
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    raise fail([*path, k], "expected an array of strings")
        elif node == STR_OR_ARGV:
            ok = isinstance(value, str) or (
                isinstance(value, list) and value and all(isinstance(v, str) for v in value)
            )
            if not ok:
                raise fail(path, f"expected {_type_name(node)}, got {value!r}")
        elif node in (SCALAR, DURATION):
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise fail(path, f"expected {_type_name(node)}, got {value!r}")
        elif node is bool:
            if not isinstance(value, bool):
                raise fail(path, f"expected true or false, got {value!r}")
        elif node is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise fail(path, f"expected an integer, got {value!r}")
        elif node is str:
            if not isinstance(value, str):
                raise fail(path, f"expected a string, got {value!r}")
            if "\0" in value:
                raise fail(path, "contains a NUL byte")

    walk(schema, data, [])


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Source:
    layer: str
    file: Path
    data: dict[str, Any]
    locator: Locator


def _line_of_toml_error(e: tomllib.TOMLDecodeError) -> int | None:
    m = re.search(r"line (\d+)", str(e))
    return int(m.group(1)) if m else None


def _guess_key_at(lines: list[str], line: int | None) -> str:
    if not line or line > len(lines):
        return ""
    m = re.match(r"^\s*([A-Za-z0-9_.\"'-]+)\s*=", lines[line - 1])
    if m:
        return m.group(1)
    m = re.match(r"^\s*\[\[?([^\]]+)\]", lines[line - 1])
    return f"[{m.group(1)}]" if m else ""


def read_toml(layer: str, file: Path, *, table: tuple[str, ...] = ()) -> Source | None:
    """Parse a TOML tier; ``table`` selects a sub-table (``("tool", "stockade")``)."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PolicyError(f"{file}: cannot read policy file: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad_line = raw[: e.start].count(b"\n") + 1
        raise PolicyError(f"{file}:{bad_line}: not valid UTF-8") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        err_line = _line_of_toml_error(e)
        key = _guess_key_at(text.splitlines(), err_line)
        msg = str(e).split(" (at ")[0]
        where = f"{file}:{err_line}" if err_line else str(file)
        raise PolicyError(f"{where}: malformed TOML{' near key ' + key if key else ''}: {msg}") from None
    data: Any = doc
    for part in table:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    loc = Locator(text, "toml", table)
    if not isinstance(data, dict):
        raise _err(str(file), loc.line([]), ".".join(table), "expected a table")
    validate(data, SCHEMA, str(file), loc)
    return Source(layer, file, data, loc)


def read_json(layer: str, file: Path) -> Source | None:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"{file}: cannot read policy file: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        keys = re.findall(r'"([^"\\]+)"\s*:', text[: e.pos])  # the last key before the error
        key = keys[-1] if keys else ""
        raise PolicyError(
            f"{file}:{e.lineno}: malformed JSON{' near key ' + key if key else ''}: {e.msg} (column {e.colno})"
        ) from None
    loc = Locator(text, "json")
    if not isinstance(data, dict):
        raise _err(str(file), 1, "", "expected a JSON object")
    validate(data, SESSION_SCHEMA, str(file), loc)
    version = data.get("schema_version", SESSION_SCHEMA_VERSION)
    if version > SESSION_SCHEMA_VERSION:
        raise _err(
            str(file), loc.line(["schema_version"]), "schema_version",
            f"version {version} is newer than this stockade understands ({SESSION_SCHEMA_VERSION})",
        )
    return Source(layer, file, data, loc)


def global_config_path() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg else Path(os.path.expanduser("~")) / ".config"
    return base / "stockade" / "config.toml"


def session_policy_path(session_dir: Path) -> Path:
    return session_dir / "policy.json"


def workspace_sources(project: Path) -> tuple[Source | None, list[str]]:
    warnings: list[str] = []
    own = read_toml("workspace", project / ".stockade.toml")
    pyproject = project / "pyproject.toml"
    if own is not None:
        if pyproject.is_file():
            try:
                has_table = "stockade" in tomllib.loads(pyproject.read_text("utf-8")).get("tool", {})
            except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
                has_table = False
            if has_table:
                warnings.append(
                    f"{pyproject}: [tool.stockade] is ignored because {own.file} exists; keep one"
                )
        return own, warnings
    return read_toml("workspace", pyproject, table=("tool", "stockade")), warnings


# --------------------------------------------------------------------------- to a Layer


def _norm_path(raw: str, *, layer: str, base: Path | None, file: str, line: int | None, key: str) -> str:
    p = os.path.expanduser(raw)
    if not os.path.isabs(p):
        if base is None:
            raise _err(file, line, key, f"path {raw!r} must be absolute (or start with ~/)")
        p = os.path.join(base, p)
    if p.startswith("~"):
        raise _err(file, line, key, f"cannot expand {raw!r}: no such user")
    return realpath(p)


# --------------------------------------------------------------------------- noted file-system facts
#
# Loading a policy resolves paths (realpath) and tests existence (lexists). While a
# ``noting()`` block is active on this thread, each such fact is recorded, so that
# ``stockade.policy.load_cached`` can later tell whether a cached policy still holds.

_notes = _thread._local()


class noting:
    """Record, on this thread, every path fact consulted inside the block."""

    def __enter__(self) -> list[tuple[str, str, object]]:
        self.prev = getattr(_notes, "log", None)
        log: list[tuple[str, str, object]] = []
        _notes.log = log
        return log

    def __exit__(self, *exc: object) -> None:
        _notes.log = self.prev


def _noted(kind: str, p: str, r: Any) -> Any:
    log = getattr(_notes, "log", None)
    if log is not None:
        log.append((kind, p, r))
    return r


def realpath(p: str) -> str:
    """``os.path.realpath``, noted."""
    r: str = _noted("realpath", p, os.path.realpath(p))
    return r


def lexists(p: str) -> bool:
    """``os.path.lexists``, noted."""
    r: bool = _noted("lexists", p, os.path.lexists(p))
    return r


def split_command(raw: str | list[str]) -> tuple[str, ...]:
    import shlex

    if isinstance(raw, list):
        return tuple(raw)
    try:
        return tuple(shlex.split(raw))
    except ValueError as e:
        raise PolicyError(f"command {raw!r}: {e}") from None


def layer_from_source(src: Source, *, project: Path, cwd: Path | None = None) -> Layer:
    """Turn a validated tier into a Layer with origins. Relative paths: workspace and
    session tiers resolve against the project; the global tier must use absolute paths."""
    file = str(src.file)
    d = src.data
    lay = Layer(src.layer, file)

    def origin(path: Sequence[str | int], value: str | None = None) -> Origin:
        return Origin(src.layer, file, src.locator.line(path, value))

    base: Path | None = None if src.layer == "global" else project
    if "read_only" in d:
        lay.read_only = (d["read_only"], origin(["read_only"]))
    if "mask_mode" in d:
        lay.mask_mode = (d["mask_mode"], origin(["mask_mode"]))
    seen: dict[str, tuple[str, Origin]] = {}
    for i, ent in enumerate(d.get("paths", [])):
        o = origin(["paths", i])
        p = _norm_path(ent["path"], layer=src.layer, base=base, file=file, line=o.line, key=f"paths[{i}].path")
        access = ent.get("access", "ro")
        if p in seen and (seen[p][0] == "deny") != (access == "deny"):
            raise _err(
                file, o.line, f"paths[{i}]",
                f"{p} is both allowed and denied in this file (other entry at line {seen[p][1].line}); keep one",
            )
        seen[p] = (access, o)
        lay.paths.append(PathEntry(p, access, o))
    sec = d.get("secrets", {})
    if "defaults" in sec:
        lay.secret_defaults = (sec["defaults"], origin(["secrets", "defaults"]))
    for key, target in (("patterns", lay.secret_patterns), ("allow", lay.secret_allow)):
        for i, pat in enumerate(sec.get(key, [])):
            o = origin(["secrets", key, i], pat)
            _check_pattern(pat, file, o.line, f"secrets.{key}[{i}]")
            target.append(Item(pat, o))
    env = d.get("env", {})
    for key, target in (("allow", lay.env_allow), ("block", lay.env_block)):
        for i, pat in enumerate(env.get(key, [])):
            o = origin(["env", key, i], pat)
            if not _ENV_PATTERN_RE.match(pat):
                raise _err(file, o.line, f"env.{key}[{i}]", f"{pat!r} is not a variable name or glob")
            target.append(Item(pat, o))
    for name, val in env.get("set", {}).items():
        o = origin(["env", "set", name])
        if not _ENV_NAME_RE.match(name):
            raise _err(file, o.line, f"env.set.{name}", "not a valid environment variable name")
        lay.env_set[name] = (val, o)
    if "inherit" in env:
        lay.env_inherit = (env["inherit"], origin(["env", "inherit"]))
    if "filter_values" in env:
        lay.env_filter_values = (env["filter_values"], origin(["env", "filter_values"]))
    ex = d.get("exec", {})
    if "allow" in ex:
        items: list[Item] = []
        for i, raw in enumerate(ex["allow"]):
            o = origin(["exec", "allow", i], raw)
            items.append(Item(_norm_path(raw, layer=src.layer, base=base, file=file, line=o.line, key=f"exec.allow[{i}]"), o))
        lay.exec_allow = (items, origin(["exec", "allow"]))
    for i, raw in enumerate(d.get("commands", {}).get("deny", [])):
        o = origin(["commands", "deny", i], raw if isinstance(raw, str) else raw[0])
        argv = split_command(raw)
        if not argv:
            raise _err(file, o.line, f"commands.deny[{i}]", "empty command")
        lay.commands_deny.append(CommandEntry(argv, o))
    for i, raw in enumerate(d.get("etc", {}).get("extra", [])):
        o = origin(["etc", "extra", i], raw)
        norm = os.path.normpath(raw if raw.startswith("/") else "/etc/" + raw)
        if not norm.startswith("/etc/") or norm == "/etc":
            raise _err(file, o.line, f"etc.extra[{i}]", f"{raw!r} is not an entry under /etc")
        lay.etc_extra.append(Item(norm, o))
    for name, raw in d.get("limits", {}).items():
        from ..cgroups.parse import parse_limit

        o = origin(["limits", name])
        where = f"{file}:{o.line}" if o.line else file
        lay.limits[name] = (parse_limit(name, raw, source=where), str(raw), o)
    if "network" in d or "hosts" in d:
        _network_from_source(d, lay, file, origin)
    if "snapshots" in d or "prewarm" in d or "live" in d:
        _live_from_source(d, lay, file, origin)
    if "mcp" in d:
        _mcp_from_source(d["mcp"], lay, file, origin)
    if "sessions" in d:
        _sessions_from_source(src, lay, origin)
    if "observe" in d.get("audit", {}):
        lay.audit_observe = (d["audit"]["observe"], origin(["audit", "observe"]))
    return lay


MAX_AUTO_LIMIT = 10000  # automatic snapshots kept at most (each is a layer every run mounts)
# the defaults of [snapshots], [prewarm] and [live] (policy.Effective's when no tier sets one)
DEFAULT_MAX_AUTO = 5
DEFAULT_PREWARM_TTL = 300.0
DEFAULT_IDLE_TIMEOUT = 1800.0


def parse_seconds(raw: object, *, allow_none: bool) -> float | None:
    """A duration of the config: ``"30s"``, ``"1.5m"``, ``"24h"``, ``"2d"`` or a number of
    seconds, above zero; ``"none"`` (with ``allow_none``) -> None. Raises ValueError."""
    from ..cgroups.parse import parse_duration

    if isinstance(raw, str) and allow_none and raw.strip().lower() in ("none", "never", "unlimited", "infinity"):
        return None
    value: float | None
    if isinstance(raw, bool):
        value = None
    elif isinstance(raw, int | float):
        value = float(raw)
    elif isinstance(raw, str):
        value = parse_duration(raw)
    else:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise ValueError(raw)
    return value


def _live_from_source(d: Mapping[str, Any], lay: Layer, file: str, origin: Any) -> None:
    """[snapshots], [prewarm] and [live]: each value checked, a bad one named by file,
    line and key with the accepted form."""
    dur = 'a duration such as "30s", "15m", "24h", "2d" or a number of seconds, above zero'

    def seconds(table: str, key: str, allow_none: bool) -> tuple[float | None, Origin]:
        o = origin([table, key])
        raw = d[table][key]
        try:
            return parse_seconds(raw, allow_none=allow_none), o
        except ValueError:
            form = dur + (', or "none"' if allow_none else "")
            raise _err(file, o.line, f"{table}.{key}", f"invalid value {raw!r}: expected {form}") from None

    snap = d.get("snapshots", {})
    if "auto_on_start" in snap:
        lay.snapshots_auto = (snap["auto_on_start"], origin(["snapshots", "auto_on_start"]))
    if "max_auto" in snap:
        o = origin(["snapshots", "max_auto"])
        n = snap["max_auto"]
        if not 1 <= n <= MAX_AUTO_LIMIT:
            raise _err(file, o.line, "snapshots.max_auto",
                       f"invalid value {n!r}: expected an integer from 1 to {MAX_AUTO_LIMIT}")
        lay.snapshots_max_auto = (n, o)
    if "retention" in snap:
        lay.snapshots_retention = seconds("snapshots", "retention", True)
    pre = d.get("prewarm", {})
    if "enabled" in pre:
        lay.prewarm_enabled = (pre["enabled"], origin(["prewarm", "enabled"]))
    if "ttl" in pre:
        ttl, o = seconds("prewarm", "ttl", False)
        assert ttl is not None
        lay.prewarm_ttl = (ttl, o)
    live = d.get("live", {})
    if "idle_timeout" in live:
        lay.live_idle_timeout = seconds("live", "idle_timeout", True)


# [mcp] max_output: each stream of a tool's result is cut past this many bytes
DEFAULT_MCP_MAX_OUTPUT = 64 * 1024
MCP_MAX_OUTPUT_RANGE = (256, 64 * 1024 * 1024)


def parse_output_cap(raw: object) -> int:
    """[mcp] max_output / `stockade mcp --max-output`: a size ("64K", "1M", 4096) within
    MCP_MAX_OUTPUT_RANGE. Raises ValueError with the accepted form."""
    from ..cgroups.parse import parse_size

    lo, hi = MCP_MAX_OUTPUT_RANGE
    n: int | None = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        n = raw
    elif isinstance(raw, str):
        n = parse_size(raw.strip())
    if n is None or not lo <= n <= hi:
        raise ValueError(f"invalid value {raw!r}: expected a size such as \"64K\" or \"1M\" "
                         f"(bytes from {lo} to {hi // (1024 * 1024)}M)")
    return n


def _mcp_from_source(t: Mapping[str, Any], lay: Layer, file: str, origin: Any) -> None:
    """[mcp]: allow_apply (bool), max_output (a size); a bad value named by file, line and key.
    allow_apply lets the agent write to the project, so only the user's global config turns
    it on: a cloned repo's .stockade.toml / pyproject.toml must not open its own gate.
    max_output only narrows or widens what the agent reads back, so any tier may set it."""
    if "allow_apply" in t:
        if lay.name != "global":
            o = origin(["mcp", "allow_apply"])
            raise _err(file, o.line, "mcp.allow_apply",
                       f"[mcp] allow_apply is read from the global config only ({global_config_path()}), "
                       "not from a project's or a session's: move it there")
        lay.mcp_allow_apply = (t["allow_apply"], origin(["mcp", "allow_apply"]))
    if "max_output" in t:
        o = origin(["mcp", "max_output"])
        try:
            lay.mcp_max_output = (parse_output_cap(t["max_output"]), o)
        except ValueError as e:
            raise _err(file, o.line, "mcp.max_output", str(e)) from None
DEFAULT_SESSIONS_KEEP = 7 * 86400.0  # [sessions] keep


def _sessions_from_source(src: Source, lay: Layer, origin: Any) -> None:
    """[sessions] keep: a duration (30m, 12h, 7d, 2w, or seconds) or "never". Sessions
    are the state dir's, not one project's: only the global config sets it."""
    from ..errors import UsageError
    from ..session.age import DURATION_FORMS, parse_age

    o = origin(["sessions"])
    if src.layer != "global":
        raise _err(str(src.file), o.line, "sessions",
                   f"[sessions] is read from the global config only ({global_config_path()}), "
                   "not from a project's or a session's")
    if "keep" not in src.data["sessions"]:
        return
    raw = src.data["sessions"]["keep"]
    o = origin(["sessions", "keep"])
    if isinstance(raw, str) and raw.strip().lower() in ("never", "none"):
        lay.sessions_keep = (None, o)
        return
    if isinstance(raw, int | float) and not isinstance(raw, bool) and raw >= 0:
        lay.sessions_keep = (float(raw), o)
        return
    try:
        if not isinstance(raw, str):
            raise UsageError(str(raw))
        lay.sessions_keep = (parse_age(raw, "sessions.keep"), o)
    except UsageError:
        raise _err(str(src.file), o.line, "sessions.keep",
                   f'invalid value {raw!r}: expected {DURATION_FORMS}, a number of seconds, or "never"') from None


def sessions_keep() -> float | None:
    """``[sessions] keep`` of the global config (seconds; None: never), else the default."""
    src = read_toml("global", global_config_path())
    if src is None or "sessions" not in src.data:
        return DEFAULT_SESSIONS_KEEP
    lay = Layer(src.layer, str(src.file))
    _sessions_from_source(src, lay, lambda path, value=None: Origin(src.layer, str(src.file),
                                                                    src.locator.line(path, value)))
    return lay.sessions_keep[0] if lay.sessions_keep is not None else DEFAULT_SESSIONS_KEEP


def _network_from_source(d: Mapping[str, Any], lay: Layer, file: str, origin: Any) -> None:
    """[network] (and a session's "hosts"), checked pattern by pattern: a bad one names
    its file, line and key. Presets are expanded once every tier is read."""
    from . import network as netpol

    net = d.get("network", {})
    if "mode" in net:
        lay.net_mode = (net["mode"], origin(["network", "mode"]))
    for action in ("allow", "deny"):
        for i, raw in enumerate(net.get(action, [])):
            o = origin(["network", action, i], raw)
            key = f"network.{action}[{i}]"
            try:
                netpol.check_raw(raw)
            except netpol.PatternError as e:
                raise _err(file, o.line, key, str(e)) from None
            lay.net_rules.append(HostEntry(raw.strip(), action, o, key))
    for i, raw in enumerate(net.get("forward", [])):
        o = origin(["network", "forward", i])
        try:
            lay.net_forward.append((netpol.parse_forward(raw), o))
        except netpol.PatternError as e:
            raise _err(file, o.line, f"network.forward[{i}]", str(e)) from None
    if "resolver" in net:
        o = origin(["network", "resolver"])
        try:
            lay.net_resolver = (netpol.parse_resolver(net["resolver"]), o)
        except netpol.PatternError as e:
            raise _err(file, o.line, "network.resolver", str(e)) from None
    for name, pats in net.get("presets", {}).items():
        o = origin(["network", "presets", name])
        key = f"network.presets.{name}"
        try:
            netpol.check_preset_name(name)
            for p in pats:
                if p.strip().startswith("@"):
                    raise netpol.PatternError(f"{p!r}: a preset lists hosts, not other presets")
                netpol.parse_pattern(p)
        except netpol.PatternError as e:
            raise _err(file, o.line, key, str(e)) from None
        if not pats:
            raise _err(file, o.line, key, "an empty preset; list its hosts, e.g. [\"artifacts.example.org:443\"]")
        lay.net_presets[name.lower()] = (tuple(p.strip() for p in pats), o)
    for i, ent in enumerate(d.get("hosts", [])):
        o = origin(["hosts", i], ent["host"])
        key = f"hosts[{i}].host"
        try:
            netpol.check_raw(ent["host"])
        except netpol.PatternError as e:
            raise _err(file, o.line, key, str(e)) from None
        lay.net_rules.append(HostEntry(ent["host"].strip(), ent["action"], o, key))


def _check_pattern(pat: str, file: str, line: int | None, key: str) -> None:
    if not pat.strip():
        raise _err(file, line, key, "empty pattern")
    if pat.startswith("!"):
        raise _err(file, line, key, f"{pat!r}: negation is not supported here; put {pat[1:]!r} in secrets.allow")
