"""Sensitive-file patterns and the scan that finds what to mask inside a visible tree.

Patterns are gitignore-style (``pathspec``), matched case-insensitively against the
path relative to the tree (a directory is matched as ``rel/``).  A match masks the
entry; a masked directory is not descended into.  Deny wins: an allow pattern (or an
exact-path allow) exempts a match only when it comes from the same or a later layer
than the deny pattern.

The scan runs once per session and is cached on disk.  The cache records each
directory's (inode, mtime): adding, removing or renaming an entry changes its
directory's mtime, so a later run re-lists only the directories that changed and
stats the rest, which keeps a 100,000-file project cheap to re-check.  Directories
modified within ``RACY_NS`` of the previous scan are re-listed anyway (mtime
granularity), as git does for its index.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PolicyError
from ..pathsig import RACY_NS
from .config import Origin

DEFAULT_PATTERNS: tuple[str, ...] = (
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "*credentials*",
    "*secret*",
    ".aws/",
    ".ssh/",
    ".gnupg/",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "*.p12",
    "*.pfx",
    ".netrc",
    ".git-credentials",
    ".npmrc",
    ".pypirc",
)
DEFAULT_ALLOW: tuple[str, ...] = (".env.example", ".env.sample", ".env.template", "*.pub")

# Files masked only when their content holds a credential (first 64 KiB read).
CONDITIONAL: dict[str, re.Pattern[str]] = {
    ".npmrc": re.compile(r"(_authToken|_auth|_password|password)\s*=", re.I),
    ".pypirc": re.compile(r"^\s*(password|token)\s*[=:]", re.I | re.M),
}
_CONDITIONAL_READ = 65536

_UNANCHORED = "^(?:.+/)?"
CACHE_VERSION = 2


@dataclass(frozen=True)
class PatternRule:
    pattern: str
    action: str  # "deny" | "allow"
    origin: Origin

    @property
    def conditional(self) -> re.Pattern[str] | None:
        return CONDITIONAL.get(self.pattern) if self.origin.layer == "default" else None


# gitignore pattern -> regex source (None: never matches). Persisted in the state
# dir's cache so a CLI run need not import pathspec (about 15 ms) for patterns it
# has translated before.
_REGEX_CACHE: dict[str, str | None] | None = None
_REGEX_CACHE_VERSION = 1


def _regex_cache_path() -> Path:
    from ..paths import state_dir

    return Path(state_dir()) / "cache" / f"gitignore-regex-v{_REGEX_CACHE_VERSION}.json"


def _regex_cache() -> dict[str, str | None]:
    global _REGEX_CACHE
    if _REGEX_CACHE is None:
        try:
            with open(_regex_cache_path(), encoding="utf-8") as f:
                data = json.load(f)
            _REGEX_CACHE = {str(k): (v if isinstance(v, str) else None) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError):
            _REGEX_CACHE = {}
    return _REGEX_CACHE


def _translate(pattern: str) -> str | None:
    from pathspec.patterns.gitignore.spec import GitIgnoreSpecPattern

    try:
        p = GitIgnoreSpecPattern(pattern)
    except Exception as e:  # pathspec raises its own GitIgnorePatternError / ValueError
        raise PolicyError(f"secret pattern {pattern!r}: {e}") from None
    if p.include is None or p.regex is None:
        return None
    if p.include is False:
        raise PolicyError(f"secret pattern {pattern!r}: negation is not supported; use secrets.allow")
    source = p.regex.pattern
    if isinstance(source, bytes):  # pragma: no cover - str patterns give str regexes
        source = source.decode()
    return str(source).replace("(?P<ps_d>/)", "/")


def _save_regex_cache(cache: dict[str, str | None]) -> None:
    path = _regex_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError:
        pass  # only a cache


def compile_pattern(pattern: str) -> re.Pattern[str] | None:
    """The regex of one gitignore pattern (None when it can never match anything)."""
    cache = _regex_cache()
    if pattern in cache:
        source = cache[pattern]
    else:
        source = _translate(pattern)
        cache[pattern] = source
        _save_regex_cache(cache)
    if source is None:
        return None
    return re.compile(source, re.IGNORECASE)


def never_matches(pattern: str) -> str | None:
    """Why a pattern can never match a path inside a tree (None when it can)."""
    try:
        rx = compile_pattern(pattern)
    except PolicyError as e:
        return str(e)
    if rx is None:
        return "it is a comment or blank"
    if pattern.startswith("~"):
        return "'~' is not expanded in patterns; use a [[paths]] entry with access = \"deny\""
    if pattern.startswith("/") and len(pattern) > 1:
        first = pattern.lstrip("/").split("/", 1)[0]
        if first in {"home", "root", "etc", "usr", "var", "tmp", "opt", "srv", "mnt", "media"}:
            return (
                "patterns are relative to the visible tree, so this looks for "
                f"<tree>{pattern}; use a [[paths]] entry with access = \"deny\" for a host path"
            )
    if "\0" in pattern or re.search(r"(^|/)\.\.(/|$)", pattern):
        return "a path inside a tree never contains '..'"
    return None


class Matcher:
    """Decides, for one path relative to a tree, which deny rule (if any) masks it."""

    def __init__(
        self,
        deny: Iterable[PatternRule],
        allow: Iterable[PatternRule],
        exact_allow: Mapping[str, int] | None = None,
    ) -> None:
        self.deny = [r for r in deny if compile_pattern(r.pattern) is not None]
        self.allow = [r for r in allow if compile_pattern(r.pattern) is not None]
        self._deny_rx = [compile_pattern(r.pattern) for r in self.deny]
        self._allow_rx = [compile_pattern(r.pattern) for r in self.allow]
        # Unanchored patterns without a '/' in the middle (".env", "*.pem", ".ssh/") depend on
        # the last component only: match those against the name, the rest against the path.
        name_alts: list[str] = []
        path_alts: list[str] = []
        for rx in self._deny_rx:
            if rx is None:
                continue
            src = rx.pattern
            rest = src.removeprefix(_UNANCHORED)
            if rest != src and "/" not in rest.replace("[^/]", "").replace("(?:/|$)", "").removesuffix("/"):
                name_alts.append(f"(?:^{rest})")
            else:
                path_alts.append(f"(?:{src})")
        self._name_any = re.compile("|".join(name_alts), re.IGNORECASE) if name_alts else None
        self._any = re.compile("|".join(path_alts), re.IGNORECASE) if path_alts else None
        self.exact_allow: dict[str, int] = dict(exact_allow or {})
        self.fingerprint = hashlib.sha256(
            json.dumps(
                [
                    [(r.pattern, r.origin.index) for r in self.deny],
                    [(r.pattern, r.origin.index) for r in self.allow],
                    sorted(self.exact_allow.items()),
                    sorted(CONDITIONAL),
                    CACHE_VERSION,
                ]
            ).encode()
        ).hexdigest()

    def candidate(self, rel: str, is_dir: bool) -> bool:
        """Fast pre-check: does any deny pattern match? Exact when no ancestor directory of
        ``rel`` matched (the scanner never descends into a masked directory)."""
        if self._name_any is not None:
            name = rel.rpartition("/")[2]
            if self._name_any.match(name + "/" if is_dir else name) is not None:
                return True
        if self._any is None:
            return False
        return self._any.match(rel + "/" if is_dir else rel) is not None

    def decide(self, rel: str, is_dir: bool, abspath: str | None = None) -> tuple[PatternRule | None, list[PatternRule]]:
        """(deny rule in force or None, allow rules that exempted a match)."""
        key = rel + "/" if is_dir else rel
        exempted: list[PatternRule] = []
        exact_layer = self.exact_allow.get(abspath) if abspath is not None else None
        for rule, rx in zip(self.deny, self._deny_rx, strict=True):
            if rx is None or rx.match(key) is None:
                continue
            if exact_layer is not None and exact_layer >= rule.origin.index:
                continue
            exempt = [
                a
                for a, arx in zip(self.allow, self._allow_rx, strict=True)
                if arx is not None and a.origin.index >= rule.origin.index and arx.match(key)
            ]
            if exempt:
                exempted.extend(exempt)
                continue
            return rule, exempted
        return None, exempted

    def allows(self, rel: str, is_dir: bool) -> list[PatternRule]:
        key = rel + "/" if is_dir else rel
        return [a for a, arx in zip(self.allow, self._allow_rx, strict=True) if arx is not None and arx.match(key)]


def content_has_secret(path: str, rx: re.Pattern[str]) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return True  # unreadable or a symlink: keep it masked
    try:
        if not _fd_is_regular(fd):
            return False
        data = os.read(fd, _CONDITIONAL_READ)
    except OSError:
        return True
    finally:
        os.close(fd)
    return rx.search(data.decode("utf-8", "replace")) is not None


def _fd_is_regular(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


@dataclass(frozen=True)
class Hit:
    """One masked entry found by the scan."""

    rel: str
    kind: str  # "d" dir, "f" file (or other non-dir), "l" symlink
    rule: int  # index into Matcher.deny


class SecretScanner:
    """Walks a tree and returns the entries to mask; incremental with a cache dict."""

    def __init__(self, matcher: Matcher, *, skip_dirs: Iterable[str] = ()) -> None:
        self.m = matcher
        self.skip = set(skip_dirs)  # absolute dirs not to descend into (masked by path rules)
        self.errors: list[str] = []
        self.stats = {"listed": 0, "reused": 0, "entries": 0}

    def scan(self, tree: Path | str, cache: dict[str, Any] | None = None) -> tuple[list[Hit], dict[str, Any]]:
        root = str(tree)
        start = time.time_ns()
        old: dict[str, Any] = {}
        if (
            cache
            and cache.get("version") == CACHE_VERSION
            and cache.get("fingerprint") == self.m.fingerprint
            and cache.get("tree") == root
            and sorted(cache.get("skip", [])) == sorted(self.skip)
        ):
            old = cache.get("dirs", {})
            racy_before = int(cache.get("scanned_ns", 0)) - RACY_NS
        else:
            racy_before = 0
        new: dict[str, Any] = {}
        hits: list[Hit] = []
        stack = [""]
        while stack:
            rel = stack.pop()
            path = os.path.join(root, rel) if rel else root
            try:
                st = os.lstat(path)
            except OSError as e:
                if rel == "":
                    raise PolicyError(f"cannot scan {root} for secrets: {e.strerror}") from None
                continue
            ent = old.get(rel)
            if (
                ent is not None
                and ent[0] == st.st_mtime_ns
                and ent[1] == st.st_ino
                and st.st_mtime_ns < racy_before
            ):
                self.stats["reused"] += 1
                subdirs, found, cond = ent[2], ent[3], ent[4]
                found = list(found)
                # Conditional files (.npmrc) can gain a token without a directory change.
                for name, rule in cond:
                    child = f"{rel}/{name}" if rel else name
                    hit = [name, "f", rule] in found
                    now = content_has_secret(os.path.join(root, child), self._cond_rx(rule))
                    if now and not hit:
                        found.append([name, "f", rule])
                    elif hit and not now:
                        found.remove([name, "f", rule])
            else:
                self.stats["listed"] += 1
                listed = self._list(path, rel)
                if listed is None:
                    continue
                subdirs, found, cond = listed
            new[rel] = [st.st_mtime_ns, st.st_ino, subdirs, found, cond]
            for name, kind, rule in found:
                hits.append(Hit(f"{rel}/{name}" if rel else name, kind, rule))
            for name in subdirs:
                stack.append(f"{rel}/{name}" if rel else name)
        hits.sort(key=lambda h: h.rel)
        out = {
            "version": CACHE_VERSION,
            "fingerprint": self.m.fingerprint,
            "tree": root,
            "skip": sorted(self.skip),
            "scanned_ns": start,
            "dirs": new,
        }
        return hits, out

    def _cond_rx(self, rule: int) -> re.Pattern[str]:
        rx = self.m.deny[rule].conditional
        assert rx is not None
        return rx

    def _list(self, path: str, rel: str) -> tuple[list[str], list[list[Any]], list[list[Any]]] | None:
        subdirs: list[str] = []
        found: list[list[Any]] = []
        cond: list[list[Any]] = []
        m = self.m
        try:
            it = os.scandir(path)
        except OSError as e:
            self.errors.append(f"{path}: {e.strerror}")
            return None
        with it:
            for de in it:
                self.stats["entries"] += 1
                name = de.name
                child = f"{rel}/{name}" if rel else name
                try:
                    is_dir = de.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if is_dir and de.path in self.skip:
                    continue
                if m.candidate(child, is_dir):
                    rule, _ = m.decide(child, is_dir, de.path)
                    if rule is not None:
                        idx = m.deny.index(rule)
                        rx = rule.conditional
                        if rx is not None and not is_dir:
                            cond.append([name, idx])
                            if not de.is_symlink() and not content_has_secret(de.path, rx):
                                continue
                        kind = "d" if is_dir else ("l" if de.is_symlink() else "f")
                        found.append([name, kind, idx])
                        continue
                if is_dir:
                    subdirs.append(name)
        return subdirs, found, cond


def load_cache(path: Path | str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_cache(path: Path | str, data: dict[str, Any]) -> None:
    path = str(path)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


def cache_path(root: str, fingerprint: str, skip: tuple[str, ...]) -> str:
    """The on-disk scan cache of one tree under one set of rules (shared by sessions)."""
    from ..paths import state_dir

    h = hashlib.sha256("\0".join((root, fingerprint, *skip)).encode("utf-8", "surrogateescape")).hexdigest()[:20]
    return os.path.join(state_dir(), "cache", f"secrets-{h}.json")


def _same_scan(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k != "scanned_ns"} == {k: v for k, v in b.items() if k != "scanned_ns"}


# (tree, fingerprint, skip) -> (latest scan cache, whether the disk holds the same)
_SCANS: dict[tuple[str, str, tuple[str, ...]], tuple[dict[str, Any], bool]] = {}


def scan_cached(scanner: SecretScanner, root: str, *, persist: bool) -> tuple[list[Hit], str | None, dict[str, Any]]:
    """``scanner.scan(root)`` against the latest cache of this process (else the disk's).

    The newest scan stays in memory (so its racy window moves on); the disk copy is
    rewritten only when its content would change, and only with ``persist`` (a run,
    not ``explain``). Returns (hits, a warning when the disk cache cannot be written,
    the scan cache now)."""
    skip = tuple(sorted(scanner.skip))
    key = (root, scanner.m.fingerprint, skip)
    ent = _SCANS.get(key)
    cache, on_disk = ent if ent is not None else (None, False)
    path: str | None = None
    if cache is None:
        path = cache_path(*key)
        cache = load_cache(path)
        on_disk = cache is not None
    hits, new = scanner.scan(root, cache)
    if cache is None or not _same_scan(cache, new):
        on_disk = False
    err: str | None = None
    if persist and not on_disk:
        path = path or cache_path(*key)
        try:
            save_cache(path, new)
            on_disk = True
        except OSError as e:
            err = f"cannot write the secret-scan cache {path}: {e.strerror}"
    if key not in _SCANS and len(_SCANS) >= 16:
        _SCANS.clear()  # a process working on many trees: keep memory bounded
    _SCANS[key] = (new, on_disk)
    return hits, err, new
