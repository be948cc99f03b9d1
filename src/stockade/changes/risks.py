"""The risk summary of a change set: what deserves a second look before a person
approves it (``stockade diff --risks``, ``ChangeSet.risks()``, ``status --json``, the
export bundle).

Deterministic rules on the change set and the content of both sides, no network.
Content is read beneath the project and the session's layers (``_safefs``: never
through a symlink), bounded per file (:data:`TEXT_CAP` for secrets and file heads,
:data:`MANIFEST_CAP` for manifests and lock files). Layer content is untrusted: it
is only matched and parsed, and a reason never quotes a secret it found.

The rules (ids are stable; README "Risk summary" lists them with their thresholds):

==================  ========  ===============================================================
held-back           high      what ``apply`` holds back unless named (:mod:`.held`'s reasons)
setuid              high      a file with its setuid or setgid bit set
executable          medium    new or changed executable files; low: a script (shebang) or ELF
                              binary without an execute bit
mode-exec           medium    a file whose mode changed to executable
ci-config           high      CI pipeline definitions (GitHub Actions, GitLab CI, Jenkins...)
build-hook          medium    build and automation files (Makefile, setup.py, Dockerfile...),
                              changed ``scripts`` in package.json/composer.json, build tables
                              of pyproject.toml; high for install-time hooks and build backends
dependencies        medium    dependency manifests and lock files, new packages named; high:
                              a new source (index, registry, git/URL/path); low: only
                              versions changed or packages removed; an installed dependency
                              tree (node_modules/, .venv/, vendor/ ...) is one finding, and
                              only held-back, setuid and symlinks leading out look inside it
mass-deletion       high      >= 20 files deleted, or >= 50 % of a directory's files (>= 3)
large-binary        medium    a new or changed binary file of >= 1 MiB
secret              high      a credential in the new content (private key, cloud and
                              service tokens); medium: a file named like a secret by the
                              policy's secret patterns
symlink             low       a new or changed symlink; high when it leads out of the project
==================  ========  ===============================================================
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _tokens
from ..redact import terminal_safe
from ..session.idrange import with_sandbox_ids
from . import manifests
from ._safefs import Root, Roots
from .held import held_back, symlinks_leading_out
from .model import Change, Changes, Kind, count

if TYPE_CHECKING:
    from ..policy.secrets import Matcher, PatternRule

SEVERITIES: tuple[str, ...] = ("high", "medium", "low")

# rule id -> one line on what it flags (the README's table says the same)
RULES: dict[str, str] = {
    "held-back": "held back by `stockade apply` unless named (host-code-execution vectors, git metadata, "
                 "stockade policy files, symlinks leading out)",
    "setuid": "a file with its setuid or setgid bit set",
    "executable": "new or changed executable files, scripts with a shebang, ELF binaries",
    "mode-exec": "a file whose mode changed to executable",
    "ci-config": "CI pipeline definitions",
    "build-hook": "build and automation files, package scripts, build hooks",
    "dependencies": "dependency manifests and lock files (new packages named)",
    "mass-deletion": "many files deleted, or most of a directory",
    "large-binary": "large binary files",
    "secret": "credentials in the new content, files named like secrets",
    "symlink": "new or changed symlinks (where they point)",
}
_RULE_ORDER = {r: i for i, r in enumerate(RULES)}
_SEV_ORDER = {s: i for i, s in enumerate(SEVERITIES)}

TEXT_CAP = 1 << 20  # bytes read of a file for secrets, shebangs and binary detection
MANIFEST_CAP = 16 << 20  # bytes read of a manifest or lock file (lock files grow large)
LARGE_BINARY = 1 << 20  # a binary of at least this size is "large"
MASS_DELETE_FILES = 20  # this many deleted files (not directories) in the selection
DIR_DELETE_SHARE = 0.5  # or this share of a directory's files (recursively, in the project)
DIR_DELETE_MIN = 3  # ... when at least this many of them are deleted
BINARY_PROBE = 8000  # what git reads to decide "binary"
_CONDITIONAL_READ = 65536  # what the policy's scan reads of a conditional secret file (.npmrc)


@dataclass(frozen=True)
class Risk:
    """One finding: a rule, the paths it is about (project-relative), why, how bad."""

    rule: str
    paths: tuple[str, ...]
    reason: str
    severity: str  # "high" | "medium" | "low"

    def to_json(self) -> dict[str, object]:
        return {"rule": self.rule, "severity": self.severity, "paths": list(self.paths), "reason": self.reason}

    def sort_key(self) -> tuple[int, int, tuple[bytes, ...], str]:
        return (_SEV_ORDER[self.severity], _RULE_ORDER[self.rule], tuple(os.fsencode(p) for p in self.paths),
                self.reason)


def counts(risks: Iterable[Risk]) -> dict[str, int]:
    """``{"high": n, "medium": n, "low": n}``."""
    out = dict.fromkeys(SEVERITIES, 0)
    for r in risks:
        out[r.severity] += 1
    return out


# ---- reading both sides, bounded, never through a symlink ----------------------------------------


def _read(root: Root, rel: str, cap: int) -> tuple[bytes, bool] | None:
    """(up to ``cap`` bytes of regular file ``rel`` under ``root``, whether there was more);
    None when it cannot be read as a regular file."""
    try:
        fd = root.open_read(rel)
    except OSError:
        return None
    try:
        chunks: list[bytes] = []
        got = 0
        while got <= cap and (b := os.read(fd, min(1 << 20, cap + 1 - got))):
            chunks.append(b)
            got += len(b)
    except OSError:
        return None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return data[:cap], len(data) > cap


class _Sides(Roots):
    def new(self, c: Change, cap: int) -> tuple[bytes, bool] | None:
        if c.new_mode is None or not stat.S_ISREG(c.new_mode):
            return None
        return _read(self.layer(c.layer), c.path, cap)

    def old(self, c: Change, cap: int) -> tuple[bytes, bool] | None:
        if c.old_mode is None or not stat.S_ISREG(c.old_mode):
            return None
        return _read(self.host, c.path, cap)

    def new_link(self, c: Change) -> str | None:
        try:
            return self.layer(c.layer).readlink(c.path)
        except OSError:
            return None


def _is_reg(mode: int | None) -> bool:
    return mode is not None and stat.S_ISREG(mode)


def _writes_file(c: Change) -> bool:
    """A regular file whose new content the apply would write."""
    return c.kind is not Kind.REFUSED and _is_reg(c.new_mode)


def _verb(c: Change) -> str:
    if c.kind is Kind.DELETED:
        return "deleted"
    if c.kind is Kind.ADDED or (not _is_reg(c.old_mode) and _is_reg(c.new_mode)):
        return "added"
    return "modified"


def _mode(m: int | None) -> str:
    return "-" if m is None else f"{stat.S_IMODE(m):o}"


def _names(items: Iterable[str], limit: int = 8, sep: str = ", ") -> str:
    xs = list(items)
    shown = sep.join(xs[:limit])
    return shown + (f" (+{len(xs) - limit} more)" if len(xs) > limit else "")


def _spec(s: str) -> str:
    return s or "(any version)"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


# ---- per-file facts from one bounded read of the new content ---------------------------------------


@dataclass
class _Facts:
    head: bytes  # the first bytes (shebang, ELF magic)
    binary: bool
    secrets: list[tuple[str, int]]  # (label, line) of credentials new in this content


# token formats that are too noisy in files to flag: a placeholder URL is the common case
# placeholders, not credentials: ``://user:${PASS}@``, ``://user:<password>@``, ``://u:password@``
_URL_PASSWORD_PLACEHOLDER = re.compile(
    r"://[^/\s:@]+:(?:[$%{<*\[]|(?:pass|password|passwd|pwd|secret|token|changeme|x+|\*+)@)", re.I)
_SECRET_LABELS = {
    "github-token": "a GitHub token",
    "aws-access-key-id": "an AWS access key id",
    "api-key": "an API key (sk-...)",
    "stripe-key": "a Stripe key",
    "slack-token": "a Slack token",
    "gitlab-token": "a GitLab token",
    "google-api-key": "a Google API key",
    "npm-token": "an npm token",
    "pypi-token": "a PyPI token",
    "huggingface-token": "a Hugging Face token",
    "private-key": "a private key",
    "jwt": "a JSON web token",
    "url-password": "a password in a URL",
    "aws-secret-access-key": "an AWS secret access key",
}
# beside the token formats of ``_tokens`` (shared with the audit redactor): the AWS
# secret key, recognisable only by the name it is assigned to
_EXTRA_SECRETS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("aws-secret-access-key", re.compile(r"(?i)aws_?secret_?access_?key\s*[\"']?\s*[=:]\s*[\"']?[A-Za-z0-9/+]{40}\b")),
)
_EXTRA_NEEDLES = ("aws_secret", "AWS_SECRET", "aws_Secret", "secret_access_key", "SecretAccessKey", "secretaccesskey")


def _looks_random(s: str) -> bool:
    """A generated key mixes digits with upper- and lower-case letters; words do not."""
    return any(c.isdigit() for c in s) and any(c.isupper() for c in s) and any(c.islower() for c in s)


def _secret_hits(text: str) -> list[tuple[str, int, str]]:
    """(label, line, the matched text) of every credential in ``text`` (the text is only
    compared with the old side's, never shown)."""
    if not _tokens.may_hold_secret(text) and not any(n in text for n in _EXTRA_NEEDLES):
        return []
    out: list[tuple[str, int, str]] = []
    for label, rx in (*_tokens.patterns(), *_EXTRA_SECRETS):
        for m in rx.finditer(text):
            if label == "url-password" and _URL_PASSWORD_PLACEHOLDER.search(m.group(0)):
                continue
            if label == "api-key" and not _looks_random(m.group(0)[3:]):
                continue  # sk-spinner-double-bounce (a CSS class), not a key
            out.append((label, text.count("\n", 0, m.start()) + 1, m.group(0)))
    return out


def _facts(sides: _Sides, c: Change) -> _Facts | None:
    got = sides.new(c, TEXT_CAP)
    if got is None:
        return None
    data, _more = got
    hits = _secret_hits(data.decode("utf-8", "replace"))
    if hits and _is_reg(c.old_mode):
        old = sides.old(c, TEXT_CAP)
        if old is not None:
            before = {h[2] for h in _secret_hits(old[0].decode("utf-8", "replace"))}
            hits = [h for h in hits if h[2] not in before]  # there already: not written by this change
    return _Facts(data[:4], b"\0" in data[:BINARY_PROBE], [(label, line) for label, line, _ in hits])


# ---- the rules ------------------------------------------------------------------------------------


class _Assess:
    def __init__(self, cs: Changes, sel: tuple[Change, ...]) -> None:
        self.cs = cs
        self.all = tuple(c for c in sel if c.kind is not Kind.REFUSED)
        # installed dependency trees (node_modules/, .venv/ ...) are one finding each; the
        # per-file rules look at the project's own files
        self.trees: dict[str, list[Change]] = {}
        own: list[Change] = []
        for c in self.all:
            root = dependency_tree(c.path)
            if root is None:
                own.append(c)
            else:
                self.trees.setdefault(root, []).append(c)
        self.sel = tuple(own)
        self.sides = _Sides(cs.project, cs.session.lower_stack())
        self.out: list[Risk] = []
        self.facts: dict[str, _Facts] = {}

    def add(self, rule: str, paths: Iterable[str], reason: str, severity: str) -> None:
        ps = tuple(sorted(set(paths), key=os.fsencode))
        if ps:
            self.out.append(Risk(rule, ps, reason, severity))

    def run(self) -> list[Risk]:
        try:
            unread: list[str] = []
            for c in self.sel:
                if _writes_file(c):
                    f = _facts(self.sides, c)
                    if f is None:
                        unread.append(c.path)
                    else:
                        self.facts[c.path] = f
            if unread:  # never a silent pass: say what could not be checked
                self.add("secret", unread, f"{len(unread)} file(s) could not be read, so they were not checked "
                         "for credentials, shebangs or binary content", "medium")
            self.held()
            self.setuid()
            self.executable()
            self.ci_config()
            self.build_hooks()
            self.dependencies()
            self.dependency_trees()
            self.mass_deletion()
            self.large_binary()
            self.secrets()
            self.symlinks()
        finally:
            self.sides.close()
        return sorted(self.out, key=Risk.sort_key)

    # held-back: held.py's decisions and reasons, grouped by reason
    def held(self) -> None:
        by_why: dict[str, list[str]] = {}
        for path, why in held_back(self.cs, self.all).items():
            by_why.setdefault(why, []).append(path)
        for why, paths in by_why.items():
            self.add("held-back", paths, f"`stockade apply` holds it back unless named: {why}", "high")

    def setuid(self) -> None:
        for c in self.all:
            if not _writes_file(c) or c.new_mode is None:
                continue
            bits = [n for b, n in ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid")) if c.new_mode & b]
            if bits:
                self.add("setuid", [c.path], f"{' and '.join(bits)} file ({_verb(c)}, mode {_mode(c.new_mode)}): "
                         "it runs with its owner's or group's privileges", "high")

    def executable(self) -> None:
        new_x: list[str] = []
        changed_x: list[str] = []
        made_x: list[tuple[str, str]] = []
        scripts: list[str] = []
        for c in self.sel:
            if not _writes_file(c) or c.new_mode is None:
                continue
            x = bool(c.new_mode & 0o111)
            was_x = _is_reg(c.old_mode) and bool((c.old_mode or 0) & 0o111)
            if x and _is_reg(c.old_mode) and not was_x:
                made_x.append((c.path, f"{_mode(c.old_mode)} -> {_mode(c.new_mode)}"))
            elif x:
                (changed_x if was_x else new_x).append(c.path)
            else:
                f = self.facts.get(c.path)
                if f is not None and (f.head.startswith(b"#!") or f.head == b"\x7fELF"):
                    scripts.append(c.path)
        if new_x:
            self.add("executable", new_x, f"{len(new_x)} new executable file(s)", "medium")
        if changed_x:
            self.add("executable", changed_x, f"{len(changed_x)} executable file(s) changed", "medium")
        if scripts:
            self.add("executable", scripts, f"{len(scripts)} script(s) with a shebang or ELF binary(ies) "
                     "without an execute bit (run with an interpreter, or after a chmod)", "low")
        if made_x:
            what = made_x[0][1] if len(made_x) == 1 else _names((f"{p}: {m}" for p, m in made_x), sep="; ")
            self.add("mode-exec", [p for p, _ in made_x], f"mode changed to executable ({what})", "medium")

    def ci_config(self) -> None:
        by_what: dict[str, list[Change]] = {}
        for c in self.sel:
            if c.is_dir:
                continue
            what = ci_system(c.path)
            if what is not None:
                by_what.setdefault(what, []).append(c)
        for what, cs in by_what.items():
            self.add("ci-config", [c.path for c in cs],
                     f"{what} {_verbs(cs)}: it runs on the CI with the CI's secrets and permissions", "high")

    def build_hooks(self) -> None:
        for c in self.sel:
            if c.is_dir:
                continue
            base = c.path.rsplit("/", 1)[-1]
            if base in ("package.json", "composer.json"):
                self._scripts(c, base)
            elif base == "pyproject.toml":
                self._pyproject(c)
            elif (what := build_file(c.path)) is not None:
                runs = "" if c.new_mode is None else ": it runs at the next build"
                self.add("build-hook", [c.path], f"{what} {_verb(c)}{runs}", "medium")

    def _both(self, c: Change, cap: int) -> tuple[bytes | None, bytes | None] | str:
        """(old, new) content, None for an absent side; a string: why it cannot be read."""
        sides: list[bytes | None] = []
        for got, mode in ((self.sides.old(c, cap), c.old_mode), (self.sides.new(c, cap), c.new_mode)):
            if mode is None or not _is_reg(mode):
                sides.append(None)
            elif got is None:
                return "cannot be read"
            elif got[1]:
                return f"larger than {_mib(cap)}: not parsed"
            else:
                sides.append(got[0])
        return sides[0], sides[1]

    def _scripts(self, c: Change, base: str) -> None:
        both = self._both(c, MANIFEST_CAP)
        if isinstance(both, str):
            self.add("build-hook", [c.path], f"{base} {_verb(c)}, its scripts unknown ({both})", "medium")
            return
        try:
            d = manifests.scripts_delta(base, *both)
        except (ValueError, UnicodeDecodeError):
            self.add("build-hook", [c.path], f"{base} {_verb(c)} and is not valid JSON: its scripts unknown", "medium")
            return
        if not d:
            return
        parts = [f"{label}: {_names(xs)}" for label, xs in (("added", d.added), ("changed", d.changed),
                                                            ("removed", d.removed)) if xs]
        reason = f"{base} scripts {'; '.join(parts)}"
        if d.automatic:
            reason += f" ({_names(d.automatic)} run by the package manager itself at install)"
        self.add("build-hook", [c.path], reason, "high" if d.automatic else "medium")

    def _pyproject(self, c: Change) -> None:
        both = self._both(c, MANIFEST_CAP)
        if isinstance(both, str):
            self.add("build-hook", [c.path], f"pyproject.toml {_verb(c)}, its build tables unknown ({both})", "medium")
            return
        try:
            hooks = manifests.pyproject_hooks(*both)
        except (ValueError, UnicodeDecodeError):
            self.add("build-hook", [c.path], f"pyproject.toml {_verb(c)} and is not valid TOML: its build tables "
                     "unknown", "medium")
            return
        if hooks:
            self.add("build-hook", [c.path], f"pyproject.toml build tables changed: {'; '.join(w for w, _ in hooks)}",
                     "high" if any(h for _, h in hooks) else "medium")

    def dependencies(self) -> None:
        for c in self.sel:
            if c.is_dir:
                continue
            parser = manifests.manifest_parser(c.path)
            if parser is None:
                continue
            base = c.path.rsplit("/", 1)[-1]
            if c.new_mode is None:
                self.add("dependencies", [c.path], f"dependency manifest {base} deleted", "low")
                continue
            if not callable(parser):
                self.add("dependencies", [c.path], f"dependency manifest {base} {_verb(c)} (not parsed: review it "
                         "by hand)", "medium")
                continue
            both = self._both(c, MANIFEST_CAP)
            if isinstance(both, str):
                self.add("dependencies", [c.path], f"dependency manifest {base} {_verb(c)} ({both})", "medium")
                continue
            old, new = both
            try:
                d = manifests.delta(parser(old) if old is not None else {}, parser(new) if new is not None else {})
            except (ValueError, UnicodeDecodeError):  # JSONDecodeError, TOMLDecodeError, configparser errors
                self.add("dependencies", [c.path], f"dependency manifest {base} {_verb(c)} and cannot be parsed",
                         "medium")
                continue
            if not d:
                continue
            parts = []
            if d.added:
                parts.append(f"new package(s) in {base}: {_names(d.added)}")
            if d.sources:
                parts.append(f"new source(s): {_names(f'{w} ({what})' for w, what in d.sources.items())}")
            if d.changed:
                parts.append(f"changed: {_names(f'{k} {_spec(o)} -> {_spec(n)}' for k, (o, n) in d.changed.items())}")
            if d.removed:
                parts.append(f"removed: {_names(d.removed)}")
            sev = "high" if d.sources else "medium" if d.added else "low"
            self.add("dependencies", [c.path], "; ".join(parts), sev)

    def dependency_trees(self) -> None:
        for root, cs in self.trees.items():
            n = count(cs)
            what = "added" if any(c.path == root and c.kind is Kind.ADDED for c in cs) else "changed"
            self.add("dependencies", [root], f"installed dependency tree {root}/ {what} ({n.phrase()}): "
                     "third-party code, not reviewed file by file here", "medium")

    def mass_deletion(self) -> None:
        """Directories (the project included) that lose most of their files, the topmost
        one reported; and many deleted files in all, unless those risks cover them all."""
        deleted = [c for c in self.sel if c.kind is Kind.DELETED and c.old_mode is not None
                   and not stat.S_ISDIR(c.old_mode)]
        if not deleted:
            return
        under: dict[str, int] = {}
        for c in deleted:
            parts = c.path.split("/")[:-1]
            for i in range(0, len(parts) + 1):
                d = "/".join(parts[:i])
                under[d] = under.get(d, 0) + 1
        covered: set[str] = set()  # deleted files a directory's risk already names
        for d in sorted(under, key=lambda p: (p.count("/") if p else -1, os.fsencode(p))):
            n = under[d]
            if n < DIR_DELETE_MIN:
                continue
            inside = [c for c in deleted if not d or c.path.startswith(d + "/")]
            if all(c.path in covered for c in inside):
                continue
            limit = int(n / DIR_DELETE_SHARE)  # more files than this and the share is below the threshold
            total = _count_files(self.sides, d, limit + 1)
            if total and n / total >= DIR_DELETE_SHARE:
                d, total = self._narrowest(d, n, under, total)
                covered.update(c.path for c in inside)
                where = f"directory {d}/" if d else "the project"
                self.add("mass-deletion", _roots(inside, self.sel),
                         f"{n} of the {total} files of {where} deleted ({round(100 * n / total)} %; threshold: "
                         f"{round(100 * DIR_DELETE_SHARE)} % of a directory, at least {DIR_DELETE_MIN} files)", "high")
        if len(deleted) >= MASS_DELETE_FILES and len(covered) < len(deleted):
            self.add("mass-deletion", _roots(deleted, self.sel),
                     f"{len(deleted)} files deleted (threshold: {MASS_DELETE_FILES})", "high")

    def _narrowest(self, d: str, n: int, under: dict[str, int], total: int) -> tuple[str, int]:
        """The deepest directory below ``d`` that holds all ``n`` of its deletions (``olddir/``,
        4 of 4, says more than "the project", 4 of 6), with its file count."""
        while True:
            pre = d + "/" if d else ""
            child = next((c for c, k in under.items() if k == n and c.startswith(pre) and c != d
                          and "/" not in c[len(pre):]), None)
            if child is None:
                return d, total
            d, total = child, _count_files(self.sides, child, total + 1)

    def large_binary(self) -> None:
        for c in self.sel:
            if not _writes_file(c) or c.size < LARGE_BINARY:
                continue
            f = self.facts.get(c.path)
            if c.binary or (f is not None and f.binary):
                self.add("large-binary", [c.path], f"binary file {_verb(c)}, {_mib(c.size)} (threshold "
                         f"{_mib(LARGE_BINARY)}): its content cannot be reviewed as text", "medium")

    def secrets(self) -> None:
        matcher = _secret_matcher(self.cs)
        for c in self.sel:
            if c.new_mode is None:
                continue
            f = self.facts.get(c.path)
            if f is not None and f.secrets:
                found: dict[str, list[int]] = {}
                for label, line in f.secrets:
                    found.setdefault(label, []).append(line)
                what = "; ".join(f"{_SECRET_LABELS.get(lb, lb)} on line(s) {_names(str(n) for n in lines)}"
                                 for lb, lines in found.items())
                self.add("secret", [c.path], f"credential written into the project: {what} (redacted)", "high")
            if c.is_dir:
                continue
            rule = _secret_name(matcher, self.cs, c.path)
            if rule is None:
                continue
            if rule.conditional is not None:  # .npmrc, .pypirc: a secret only when they hold a credential
                got = self.sides.new(c, _CONDITIONAL_READ)
                if got is not None and not rule.conditional.search(got[0].decode("utf-8", "replace")):
                    continue
            self.add("secret", [c.path], f"file named like a secret ({_verb(c)}; secret pattern {rule.pattern!r}): "
                     "the policy hides such files from sandboxes; check what it holds", "medium")

    def symlinks(self) -> None:
        links = [c for c in self.all if c.new_mode is not None and stat.S_ISLNK(c.new_mode)]
        if not links:
            return
        out = symlinks_leading_out(self.cs, links)
        own = {c.path for c in self.sel}
        leading_out: list[tuple[Change, str]] = []
        inside: list[tuple[Change, str]] = []
        for c in links:
            target = self.sides.new_link(c)
            shown = "(unreadable)" if target is None else manifests.clean_url(target)
            if c.path in out:
                leading_out.append((c, shown))
            elif c.path in own:  # a dependency tree's own links (node_modules/.bin) are its finding's
                inside.append((c, shown))
        for group, sev, tail in ((leading_out, "high", ", which leads out of the project"), (inside, "low", "")):
            if len(group) == 1:
                c, shown = group[0]
                self.add("symlink", [c.path], f"symlink {_verb(c)}: -> {shown}{tail}", sev)
            elif group:
                what = "lead out of the project" if tail else "added or changed"
                self.add("symlink", [c.path for c, _ in group],
                         f"{len(group)} symlinks {what}: {_names((f'{c.path} -> {t}' for c, t in group), sep='; ')}", sev)


def _verbs(cs: list[Change]) -> str:
    n: dict[str, int] = {}
    for c in cs:
        n[_verb(c)] = n.get(_verb(c), 0) + 1
    if len(cs) == 1:
        return _verb(cs[0])
    return "changed (" + ", ".join(f"{k} {v}" for k, v in sorted(n.items())) + ")"


def _roots(deleted: list[Change], sel: tuple[Change, ...]) -> list[str]:
    """The deleted paths, a wholly deleted directory standing for what was below it."""
    gone_dirs = {c.path for c in sel if c.kind is Kind.DELETED and c.old_mode is not None
                 and stat.S_ISDIR(c.old_mode)}
    out = set()
    for c in deleted:
        parts = c.path.split("/")
        top = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in gone_dirs), c.path)
        out.add(top)
    return sorted(out, key=os.fsencode)


def _count_files(sides: _Sides, rel: str, stop: int) -> int:
    """Non-directory entries below project directory ``rel`` (no symlink followed); stops
    counting at ``stop`` (the share is below the threshold past it)."""
    n = 0
    todo = [rel]
    while todo and n < stop:
        d = todo.pop()
        try:
            for de in sides.host.scandir(d):
                if de.is_dir(follow_symlinks=False):
                    todo.append(f"{d}/{de.name}" if d else de.name)
                else:
                    n += 1
        except OSError:
            continue
    return n


# ---- CI systems and build files, by path ----------------------------------------------------------

_CI_DIRS: tuple[tuple[str, str], ...] = (
    (".github/workflows/", "GitHub Actions workflow"),
    (".github/actions/", "GitHub Actions local action"),
    (".gitlab/ci/", "GitLab CI include"),
    (".circleci/", "CircleCI config"),
    (".buildkite/", "Buildkite pipeline"),
    (".woodpecker/", "Woodpecker CI pipeline"),
    (".tekton/", "Tekton pipeline"),
    (".azure-pipelines/", "Azure Pipelines definition"),
    (".forgejo/workflows/", "Forgejo Actions workflow"),
    (".gitea/workflows/", "Gitea Actions workflow"),
    (".semaphore/", "Semaphore CI pipeline"),
    (".teamcity/", "TeamCity settings"),
)
_CI_FILES: dict[str, str] = {
    ".gitlab-ci.yml": "GitLab CI pipeline",
    ".gitlab-ci.yaml": "GitLab CI pipeline",
    "Jenkinsfile": "Jenkins pipeline",
    ".travis.yml": "Travis CI config",
    "azure-pipelines.yml": "Azure Pipelines definition",
    "azure-pipelines.yaml": "Azure Pipelines definition",
    "bitbucket-pipelines.yml": "Bitbucket Pipelines definition",
    ".drone.yml": "Drone CI pipeline",
    ".woodpecker.yml": "Woodpecker CI pipeline",
    "appveyor.yml": "AppVeyor CI config",
    ".appveyor.yml": "AppVeyor CI config",
    "cloudbuild.yaml": "Google Cloud Build config",
    "cloudbuild.yml": "Google Cloud Build config",
    "buildspec.yml": "AWS CodeBuild buildspec",
    "codemagic.yaml": "Codemagic workflow",
    ".cirrus.yml": "Cirrus CI config",
    "bitrise.yml": "Bitrise workflow",
    ".github/dependabot.yml": "Dependabot config",
    ".github/CODEOWNERS": "code owners file (who must approve)",
    "CODEOWNERS": "code owners file (who must approve)",
    ".pre-commit-config.yaml": "pre-commit hook config (also run by pre-commit.ci)",
}


def ci_system(path: str) -> str | None:
    """What CI system's configuration ``path`` is, or None."""
    for pre, what in _CI_DIRS:
        if path.startswith(pre):
            return what
    if path in _CI_FILES:
        return _CI_FILES[path]
    base = path.rsplit("/", 1)[-1]
    if base == "Jenkinsfile" or base.endswith(".jenkinsfile"):
        return "Jenkins pipeline"
    if base in (".gitlab-ci.yml", ".gitlab-ci.yaml") or (base.endswith((".gitlab-ci.yml", ".gitlab-ci.yaml"))):
        return "GitLab CI pipeline"
    return None


_BUILD_FILES: dict[str, str] = {
    "Makefile": "Makefile", "makefile": "Makefile", "GNUmakefile": "Makefile",
    "setup.py": "setup.py (runs at every build and install from source)",
    "noxfile.py": "nox sessions", "tox.ini": "tox environments",
    "justfile": "justfile", "Justfile": "justfile", ".justfile": "justfile",
    "Taskfile.yml": "Taskfile", "Taskfile.yaml": "Taskfile", "Rakefile": "Rakefile", "Earthfile": "Earthfile",
    "build.rs": "Cargo build script (runs at every cargo build)",
    "Dockerfile": "Dockerfile", "Containerfile": "Containerfile",
    "docker-compose.yml": "Compose file", "docker-compose.yaml": "Compose file",
    "compose.yml": "Compose file", "compose.yaml": "Compose file",
    "CMakeLists.txt": "CMake build", "meson.build": "Meson build", "BUILD.bazel": "Bazel build", "WORKSPACE": "Bazel workspace",
    "build.gradle": "Gradle build script", "build.gradle.kts": "Gradle build script",
    "settings.gradle": "Gradle settings", "settings.gradle.kts": "Gradle settings",
    "gradlew": "Gradle wrapper script", "mvnw": "Maven wrapper script",
    "gradle-wrapper.properties": "Gradle wrapper (the distribution it downloads and runs)",
    "maven-wrapper.properties": "Maven wrapper (the distribution it downloads and runs)",
    "pom.xml": "Maven build", "build.xml": "Ant build", "build.sbt": "sbt build",
    "Vagrantfile": "Vagrantfile", "Procfile": "Procfile",
}


def build_file(path: str) -> str | None:
    """What build or automation file ``path`` is (package.json and pyproject.toml apart), or None."""
    base = path.rsplit("/", 1)[-1]
    if base in _BUILD_FILES:
        return _BUILD_FILES[base]
    if path in (".cargo/config", ".cargo/config.toml") or path.endswith(("/.cargo/config", "/.cargo/config.toml")):
        return "Cargo config (can set the runner and rustc wrapper)"
    if base.endswith(".mk"):
        return "make include file"
    if base.startswith(("Dockerfile.", "Containerfile.")) or base.endswith((".Dockerfile", ".dockerfile")):
        return "Dockerfile"
    return None


# directories package managers install third-party code into (one component; or two)
DEPENDENCY_DIRS: frozenset[str] = frozenset({
    "node_modules", "bower_components", "jspm_packages", ".venv", "venv", "site-packages", "dist-packages",
    "__pypackages__", ".tox", ".nox", ".eggs", "vendor", "Pods", ".pnpm-store",
})
DEPENDENCY_PAIRS: frozenset[tuple[str, str]] = frozenset({(".yarn", "cache"), (".yarn", "unplugged"),
                                                          (".cargo", "registry"), (".bundle", "ruby")})


def dependency_tree(path: str) -> str | None:
    """The installed dependency tree ``path`` is in (or is): ``a/node_modules``, else None."""
    parts = path.split("/")
    for i, p in enumerate(parts):
        if p in DEPENDENCY_DIRS:
            return "/".join(parts[:i + 1])
        if i + 1 < len(parts) and (p, parts[i + 1]) in DEPENDENCY_PAIRS:
            return "/".join(parts[:i + 2])
    return None


# ---- secret names: the policy's secret patterns -------------------------------------------------


def _secret_matcher(cs: Changes) -> Matcher:
    """The project's secret-path matcher (its effective policy's patterns: default, global,
    workspace and session tiers); the default patterns when the policy cannot be read."""
    from ..errors import StockadeError
    from ..policy.config import Origin
    from ..policy.secrets import DEFAULT_ALLOW, DEFAULT_PATTERNS, Matcher, PatternRule

    try:
        from ..policy.effective import load

        return load(cs.project, cs.session.dir, strict=False).matcher()
    except (StockadeError, OSError):
        o = Origin("default")
        return Matcher([PatternRule(p, "deny", o) for p in DEFAULT_PATTERNS],
                       [PatternRule(p, "allow", o) for p in DEFAULT_ALLOW])


def _secret_name(matcher: Matcher, cs: Changes, path: str) -> PatternRule | None:
    """The secret pattern that names ``path`` (or a directory above it), or None."""
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        rel = "/".join(parts[:i])
        is_dir = i < len(parts)
        if matcher.candidate(rel, is_dir):
            rule, _ = matcher.decide(rel, is_dir, os.path.join(os.fspath(cs.project), rel))
            if rule is not None:
                return rule
    return None


# ---- the entry points -------------------------------------------------------------------------------


@with_sandbox_ids(retry=True)
def assess(changes: Changes, *, paths: list[str] | None = None) -> list[Risk]:
    """The risks of ``changes`` (a :class:`~stockade.changes.scan.ChangeSet`), or of the
    changes matching the pathspecs ``paths``: most severe first, then by rule and path."""
    sel = changes.select(paths) if paths else changes.changes
    return _Assess(changes, sel).run()


def format_risks(risks: list[Risk], *, max_paths: int = 10) -> str:
    """Plain text, one block per risk::

        high    secret        credential written into the project: a private key on line(s) 1 (redacted)
                              keys/deploy.pem
    """
    from .diff import quote_path

    lines: list[str] = []
    width = max((len(r) for r in RULES), default=12)
    for r in risks:
        # a reason quotes what the sandbox wrote (a symlink's target, a script's name):
        # escaped, it cannot forge a line or drive the terminal (--json keeps it exact)
        lines.append(f"{r.severity:<7} {r.rule:<{width}}  {terminal_safe(r.reason)}")
        pad = " " * (8 + width + 2)
        for p in r.paths[:max_paths]:
            lines.append(pad + quote_path(b"", os.fsencode(p)).decode("utf-8", "backslashreplace"))
        if len(r.paths) > max_paths:
            lines.append(pad + f"... and {len(r.paths) - max_paths} more")
    return "".join(line + "\n" for line in lines)


def summary(risks: list[Risk]) -> str:
    """``3 risks: 1 high, 2 medium`` (``no risks`` when none)."""
    if not risks:
        return "no risks"
    n = counts(risks)
    return f"{len(risks)} risk(s): " + ", ".join(f"{v} {k}" for k, v in n.items() if v)
