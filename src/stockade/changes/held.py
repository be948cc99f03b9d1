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

from ..session.idrange import with_sandbox_ids
from ._safefs import Root

if TYPE_CHECKING:
    from .model import Change, Changes

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
        return GIT_CODE_WHY
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
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):  # nested too deeply: not readable either
        return _UNKNOWN
    for key in table:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


class _Sides:
    """Reads a change's old (project) and new (layer) content, never through a symlink."""

    def __init__(self, cs: Changes) -> None:
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


@with_sandbox_ids(retry=True)
def symlinks_leading_out(cs: Changes, changes: list[Change] | tuple[Change, ...]) -> dict[str, str]:
    """The symlinks among ``changes`` that resolve outside the project in either view (the
    test ``held_back`` applies): path -> why. For the risk summary, which flags them even
    where another reason holds them back first."""
    sides = _Sides(cs)
    try:
        links = _Links(sides, {c.path: c for c in cs.changes})
        out = {}
        for c in changes:
            try:
                why = _symlink_why(links, c)
            except OSError:
                why = "symlink that cannot be read"
            if why:
                out[c.path] = why
        return out
    finally:
        sides.close()


# ---- git metadata: what --include-git takes, and groups that only work whole ----------------------
#
# A repository's metadata is data (objects, refs, index, logs, HEAD, worktrees/ admin
# dirs) except for the parts git runs as code: hooks and config (core.fsmonitor,
# core.pager, aliases, filters ...). ``--include-git`` takes the data and never the
# code; those stay held back until named literally (wall (b) of issue #12), and so does
# objects/info/alternates (it points git at object stores outside the repository).
# A ``.git`` FILE ("gitdir: <dir>", a worktree or a separate git dir) works only with
# the directory it names: it and its worktree's new files are one group, held back
# while any needed part of that directory is.

GIT_CODE_WHY = "git repository: its hooks and config run at the next host git command"  # even with --include-git
GIT_DATA_WHY = ("git repository metadata: applied as one group by `stockade apply --include-git` "
                "(never hooks or config)")
_DATA_TOPS = frozenset({"objects", "refs", "logs"})


def git_split(path: str) -> tuple[str, str] | None:
    """(the repository's ``.git`` path, the path inside it) for a path at or under the
    first ``.git`` component of ``path``, else None: ``a/.git/refs/x`` -> (``a/.git``, ``refs/x``)."""
    parts = path.split("/")
    if ".git" not in parts:
        return None
    i = parts.index(".git")
    return "/".join(parts[:i + 1]), "/".join(parts[i + 1:])


def git_runs_code(inner: str) -> bool:
    """Whether the path ``inner`` inside a git dir is one git runs as code (or that leads
    it outside): hooks, config, config.worktree, alternates, at any level (a submodule's
    modules/<name>/, a worktrees/<name>/ admin dir); a ref or log named ``hooks`` is data."""
    parts = inner.split("/")
    if not inner or (parts[0] in _DATA_TOPS and inner != "objects/info/alternates"):
        return False
    return "hooks" in parts or parts[-1] in ("config", "config.worktree", "alternates")


def _gitdir_target(sides: _Sides, c: Change) -> str | None:
    """The project-relative directory a new ``.git`` file points at, or None when it is
    not a gitdir pointer, unreadable, or points outside the project."""
    if c.new_mode is None or not stat.S_ISREG(c.new_mode) or c.path.rsplit("/", 1)[-1] != ".git":
        return None
    try:
        fd = sides.layer(c.layer).open_read(c.path)
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None
    line = data.decode("utf-8", "replace").splitlines()[0] if data else ""
    if not line.startswith("gitdir:"):
        return None
    target = line[len("gitdir:"):].strip()
    base = os.path.dirname(c.path)
    proj = os.fspath(sides.cs.project).rstrip("/")
    full = os.path.normpath(target if target.startswith("/") else os.path.join(proj, base, target))
    if not full.startswith(proj + "/"):
        return None
    return full[len(proj) + 1:]


def _needed_under(cs: Changes, target: str) -> list[Change]:
    """The changes at or under ``target`` a git command needs there (not hooks/config)."""
    from .model import Kind

    pre = target + "/"
    out = []
    for c in cs.changes:
        if c.kind is Kind.REFUSED or not (c.path == target or c.path.startswith(pre)):
            continue
        split = git_split(c.path)
        if split is not None and git_runs_code(split[1]):
            continue
        out.append(c)
    return out


def _pointers(sides: _Sides) -> dict[str, str | None]:
    """Each changed ``.git`` file of the change set -> the directory it points at (None:
    not a pointer into the project)."""
    return {c.path: _gitdir_target(sides, c) for c in sides.cs.changes
            if c.path.rsplit("/", 1)[-1] == ".git" and c.new_mode is not None and stat.S_ISREG(c.new_mode)}


def _pointer_why(ptr: str, target: str | None, missing: list[str]) -> str:
    if target is None:
        return "a .git file that does not point into the project (gitdir: outside it, or unreadable)"
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    return (f"git worktree group: {ptr} points at {target}, whose {len(missing)} path(s) ({shown}) "
            f"are held back; applied as a whole by `stockade apply --include-git`")


def dangling_gitdirs(cs: Changes, applying: set[str]) -> dict[str, str]:
    """The ``.git`` files in ``applying`` that would point at a git dir the apply leaves
    incomplete (some needed path there not applied, or the target absent): path -> why.
    Apply runs it on its final choice, after pathspecs released what they name."""
    out: dict[str, str] = {}
    sides = _Sides(cs)
    try:
        for ptr, target in _pointers(sides).items():
            if ptr not in applying:
                continue
            if target is None:
                out[ptr] = _pointer_why(ptr, None, [])
                continue
            missing = [c.path for c in _needed_under(cs, target) if c.path not in applying]
            if missing:
                out[ptr] = _pointer_why(ptr, target, missing)
            elif not any(c.path == target for c in cs.changes) and sides.host().lstat(target) is None:
                out[ptr] = f"a .git file pointing at {target}, which exists neither on the host nor in the session"
    finally:
        sides.close()
    return out


def _groups(sides: _Sides, held: dict[str, str]) -> dict[str, str]:
    """Paths held back with a ``.git`` file whose target has held-back paths: the file,
    and when its directory is new (a ``git worktree add`` in the sandbox), every change
    under that directory, so the host never gets a worktree without its git dir."""
    cs = sides.cs
    out: dict[str, str] = {}
    new_dirs = {c.path for c in cs.changes if c.old_mode is None and c.new_mode is not None and stat.S_ISDIR(c.new_mode)}
    for ptr, target in _pointers(sides).items():
        missing = [] if target is None else [c.path for c in _needed_under(cs, target) if c.path in held]
        if target is not None and not missing:
            continue  # its git dir goes whole (or is on the host already): not a group
        why = _pointer_why(ptr, target, missing)
        out[ptr] = why
        wt = ptr.rsplit("/", 1)[0] if "/" in ptr else ""
        if wt and wt in new_dirs:
            pre = wt + "/"
            for c in cs.changes:
                if (c.path == wt or c.path.startswith(pre)) and c.path not in out:
                    out[c.path] = held.get(c.path) or why
    return out


# ---- all of it ------------------------------------------------------------------------------------


@with_sandbox_ids(retry=True)
def held_back(cs: Changes, changes: list[Change] | tuple[Change, ...] | None = None,
              include_git: bool = False) -> dict[str, str]:
    """path -> why it is held back, for ``changes`` (default: all) of ``cs``.

    ``include_git``: git metadata that is data (see ``git_runs_code``) is not held back;
    hooks, config and the rest still are."""
    from .model import Kind

    todo = cs.changes if changes is None else changes
    sides = _Sides(cs)
    try:
        links = _Links(sides, {c.path: c for c in cs.changes})
        global_rel = _global_rel(cs.project)
        aliases = _policy_aliases(links, cs.changes)
        every: dict[str, str] = {}  # over the whole change set: a group spans more than ``todo``
        for c in cs.changes:
            if c.kind is Kind.REFUSED:
                continue
            pattern = held_back_reason(c.path)
            why = None
            if pattern == ".git" and (split := git_split(c.path)) is not None:
                if git_runs_code(split[1]):
                    why = GIT_CODE_WHY
                elif not include_git:
                    why = GIT_DATA_WHY
            elif pattern:
                why = _vector_why(pattern)
            why = why or _policy_why(sides, c, global_rel, aliases) or _symlink_why(links, c)
            if why:
                every[c.path] = why
        every.update(_groups(sides, every))
    finally:
        sides.close()
    wanted = {c.path for c in todo if c.kind is not Kind.REFUSED}
    return {p: w for p, w in every.items() if p in wanted}
