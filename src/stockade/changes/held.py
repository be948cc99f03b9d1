"""What ``apply`` holds back unless a pathspec names it literally, and why.

Apply acts on the host with content the sandbox controlled. Three kinds of entry
would let that content act beyond the change itself, so they wait for a person:

* host-code-execution vectors: git's repository (hooks, config), shell rc files,
  ``.envrc``, editor task files, ``*.pth`` ... (by path, ``held_back_reason``);
* stockade's own policy files: a sandbox that writes ``.stockade.toml`` (or the
  ``[tool.stockade]`` table of ``pyproject.toml``) would widen its own next run;
* symlinks that resolve outside the project (``esc -> /tmp/x``, ``../../etc``):
  the next host program that follows them leaves the project.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._safefs import Root

if TYPE_CHECKING:
    from .model import Change, ChangeSet

# ---- by path: host-code-execution vectors ---------------------------------------------------

HELD_BACK_PATTERNS: tuple[str, ...] = (
    ".git",  # the repository itself: hooks, config, index, packed refs...
    ".gitmodules",
    ".envrc",
    ".direnv",
    ".vscode/tasks.json",
    ".vscode/settings.json",
    ".vscode/launch.json",
    ".idea/workspace.xml",
    ".idea/runConfigurations",
    ".devcontainer",
    ".pre-commit-config.yaml",
    ".husky",
    "lefthook.yml",
    ".lefthook.yml",
    ".npmrc",
    ".yarnrc",
    ".yarnrc.yml",
)
# basenames held back wherever they are (the project may be a home directory)
HELD_BACK_NAMES: frozenset[str] = frozenset(
    {
        ".bashrc", ".bash_profile", ".bash_logout", ".bash_login", ".profile",
        ".zshrc", ".zshenv", ".zprofile", ".zlogin", ".zlogout", ".cshrc", ".tcshrc",
        ".kshrc", ".mkshrc", ".inputrc", ".envrc", "sitecustomize.py", "usercustomize.py",
    }
)

_HELD_BACK_SET = frozenset(HELD_BACK_PATTERNS)
assert all(p.count("/") <= 1 for p in HELD_BACK_PATTERNS)  # held_back_reason looks 2 deep


def held_back_reason(path: str) -> str | None:
    """The host-code-execution pattern ``path`` falls under, or None."""
    parts = path.split("/", 2)
    if parts[0] in _HELD_BACK_SET:
        return parts[0]
    if "/.git/" in f"/{path}/":
        return ".git"  # a repository anywhere (a clone in vendor/): git run there runs its hooks and config
    if len(parts) > 1 and (two := f"{parts[0]}/{parts[1]}") in _HELD_BACK_SET:
        return two
    base = parts[-1] if len(parts) < 3 else path.rsplit("/", 1)[-1]
    if base in HELD_BACK_NAMES:
        return base
    if base.endswith(".pth"):
        return "*.pth (runs at every Python start)"
    return None


def _vector_why(pattern: str) -> str:
    if pattern == ".git":
        return "git repository: its hooks and config run at the next host git command"
    return f"runs code on the host ({pattern})"


# ---- stockade's own policy files ----------------------------------------------------------------

# Every file the policy loader reads as workspace policy (policy/config.py,
# ``workspace_sources``: ``<project>/.stockade.toml``, else ``[tool.stockade]`` in
# ``<project>/pyproject.toml``), with the TOML table in it that is policy (() = the
# whole file). tests/unit/test_changes_held.py traces the files the loader opens and
# fails when it reads one this table lacks. Held back at any depth: a subdirectory
# can be the project of a later run.
WORKSPACE_POLICY_FILES: dict[str, tuple[str, ...]] = {
    ".stockade.toml": (),
    "pyproject.toml": ("tool", "stockade"),
}

POLICY_WHY = "stockade policy file: it sets what the next sandboxed run may do"
_UNKNOWN = object()  # a side whose policy table cannot be read (not a file, not TOML, too big)
_MAX_POLICY_BYTES = 16 << 20


def _table(data: bytes, table: tuple[str, ...]) -> Any:
    try:
        node: Any = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return _UNKNOWN
    for key in table:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


class _Sides:
    """Reads a change's old (project) and new (layer) content, never through a symlink."""

    def __init__(self, cs: ChangeSet) -> None:
        self.cs = cs
        self.stack = cs.session.lower_stack()
        self._host: Root | None = None
        self._layers: dict[int, Root] = {}

    def host(self) -> Root:
        if self._host is None:
            self._host = Root(self.cs.project)
        return self._host

    def layer(self, i: int) -> Root:
        r = self._layers.get(i)
        if r is None:
            r = self._layers[i] = Root(self.stack[i])
        return r

    def close(self) -> None:
        for r in [self._host, *self._layers.values()]:
            if r is not None:
                r.close()

    @staticmethod
    def _read_table(root: Root, rel: str, table: tuple[str, ...]) -> Any:
        chunks: list[bytes] = []
        got = 0
        try:
            fd = root.open_read(rel)
            try:
                while got <= _MAX_POLICY_BYTES and (b := os.read(fd, 1 << 20)):  # to the end: never a prefix
                    chunks.append(b)
                    got += len(b)
            finally:
                os.close(fd)
        except OSError:
            return _UNKNOWN
        return _UNKNOWN if got > _MAX_POLICY_BYTES else _table(b"".join(chunks), table)

    def old_table(self, c: Change, table: tuple[str, ...]) -> Any:
        if c.old_mode is None:
            return None
        if not stat.S_ISREG(c.old_mode):
            return _UNKNOWN
        return self._read_table(self.host(), c.path, table)

    def new_table(self, c: Change, table: tuple[str, ...]) -> Any:
        if c.new_mode is None:
            return None
        if not stat.S_ISREG(c.new_mode):
            return _UNKNOWN
        return self._read_table(self.layer(c.layer), c.path, table)


def _policy_why(sides: _Sides, c: Change, global_rel: str | None,
                aliases: dict[str, tuple[str, tuple[str, ...]]]) -> str | None:
    if global_rel is not None and c.path == global_rel:
        return "stockade's global config file: it sets what every sandboxed run may do"
    name = c.path.rsplit("/", 1)[-1]
    table = WORKSPACE_POLICY_FILES.get(name)
    via = ""
    if table is None:
        if c.path not in aliases:
            return None
        link, table = aliases[c.path]
        via = f" (read through the symlink {link})"
    if not table:
        return POLICY_WHY + via
    if c.is_dir and c.new_mode is not None and c.old_mode is not None:
        return None  # a directory named like it, only its mode changed: the loader reads no directory
    old, new = sides.old_table(c, table), sides.new_table(c, table)
    if old is _UNKNOWN or new is _UNKNOWN or old != new:
        return f"its [{'.'.join(table)}] table changed: {POLICY_WHY}{via}"
    return None


def _policy_aliases(links: _Links, changes: tuple[Change, ...]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Changed files the loader would read through a symlinked policy file (a project's
    ``pyproject.toml -> config/pyproject.toml``): target -> (the link, its policy table).
    Looked for in the project root and in every directory holding a change (a later run's
    project can be any of them), in both views."""
    dirs = {""}
    for c in changes:
        parts = c.path.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for d in sorted(dirs):
        for name, table in WORKSPACE_POLICY_FILES.items():
            link = f"{d}/{name}" if d else name
            try:
                targets, _ = links._targets(link)
                for t in targets:
                    links.steps = 0
                    for head in links.resolve(link.split("/")[:-1], t, 1):
                        out["/".join(head)] = (link, table)
            except _Escape:
                continue  # outside the project (or unreadable): not a file the sandbox wrote
    return out


def _global_rel(project: Path) -> str | None:
    """The global config file's path in the project, when the project holds it (a home)."""
    from ..policy.config import global_config_path

    g = os.path.normpath(os.path.abspath(global_config_path()))
    p = os.fspath(project)
    return g[len(p) + 1:] if g.startswith(p.rstrip("/") + "/") else None


# ---- symlinks that resolve outside the project ------------------------------------------------

_MAX_LINKS = 40  # what the kernel follows before ELOOP
_MAX_STEPS = 4096  # a bound on the walk over both views; past it: treat as outside


class _Escape(Exception):
    pass


class _Links:
    """Resolves a symlink's target component by component, as the kernel would, in both
    views a host program may meet after the apply: the project as it is now, and the
    session's merged view (what the apply writes). A component that is a symlink in
    either view is followed; one that is not a symlink in some view is also walked
    through as is. Any path out of the project in any of them is an escape."""

    def __init__(self, sides: _Sides, by_path: dict[str, Change]) -> None:
        self.sides = sides
        self.by_path = by_path
        self.steps = 0
        self.project = [p for p in os.fspath(sides.cs.project).split("/") if p]

    def _targets(self, rel: str) -> tuple[list[str], bool]:
        """(symlink targets at ``rel`` in the two views, whether some view has no symlink there)."""
        out: list[str] = []
        plain = False
        try:
            hst = self.sides.host().lstat(rel)
            if hst is not None and stat.S_ISLNK(hst.st_mode):
                out.append(self.sides.host().readlink(rel))
            else:
                plain = True
            c = self.by_path.get(rel)
            if c is None:
                return out, plain
            if c.new_mode is not None and stat.S_ISLNK(c.new_mode):
                t = self.sides.layer(c.layer).readlink(rel)
                if t not in out:
                    out.append(t)
            else:
                plain = True
        except OSError:
            raise _Escape from None  # cannot tell where it leads (an unreadable directory): hold it back
        return out, plain

    def resolve(self, base: list[str], target: str, depth: int) -> list[list[str]]:
        """Every place ``target`` (read in directory ``base``) can lead; _Escape if any is outside."""
        if depth > _MAX_LINKS:
            raise _Escape
        parts = [p for p in target.split("/") if p not in ("", ".")]
        if target.startswith("/"):
            if len(parts) < len(self.project) or parts[:len(self.project)] != self.project:
                raise _Escape
            base, parts = [], parts[len(self.project):]
        heads = [list(base)]
        for name in parts:
            nxt: list[list[str]] = []
            for h in heads:
                self.steps += 1
                if self.steps > _MAX_STEPS:
                    raise _Escape
                if name == "..":
                    if not h:
                        raise _Escape
                    nxt.append(h[:-1])
                    continue
                rel = "/".join([*h, name])
                targets, plain = self._targets(rel)
                if plain:
                    nxt.append([*h, name])
                for t in targets:
                    nxt.extend(self.resolve(h, t, depth + 1))
            heads = [list(x) for x in {tuple(x) for x in nxt}]
        return heads


def _symlink_why(links: _Links, c: Change) -> str | None:
    if c.new_mode is None or not stat.S_ISLNK(c.new_mode):
        return None
    target = links.sides.layer(c.layer).readlink(c.path)
    base = c.path.split("/")[:-1]
    links.steps = 0  # the bound is per link
    try:
        links.resolve(base, target, 1)
    except _Escape:
        return f"symlink that resolves outside the project (-> {target})"
    return None


# ---- all of it ------------------------------------------------------------------------------------


def held_back(cs: ChangeSet, changes: list[Change] | tuple[Change, ...] | None = None) -> dict[str, str]:
    """path -> why it is held back, for ``changes`` (default: all) of ``cs``."""
    from .model import Kind

    todo = cs.changes if changes is None else changes
    out: dict[str, str] = {}
    sides = _Sides(cs)
    try:
        links = _Links(sides, {c.path: c for c in cs.changes})
        global_rel = _global_rel(cs.project)
        aliases = _policy_aliases(links, cs.changes)
        for c in todo:
            if c.kind is Kind.REFUSED:
                continue
            pattern = held_back_reason(c.path)
            why = (_vector_why(pattern) if pattern else None) or _policy_why(sides, c, global_rel, aliases) \
                or _symlink_why(links, c)
            if why:
                out[c.path] = why
    finally:
        sides.close()
    return out
