"""Dependency manifests and lock files, and the build hooks in manifests: what changed
between a file's old and new content, for the risk summary (:mod:`.risks`).

Pure functions on bytes (no file system, no network): the risk summary reads both
sides safely and bounded, and hands them here. Formats parsed for real, with the
standard library only (``json``, ``tomllib``, ``configparser``, line parsers):
requirements files, ``pyproject.toml``, ``setup.cfg``, ``Pipfile``/``Pipfile.lock``,
``poetry.lock``, ``uv.lock``, ``package.json``, ``package-lock.json``/
``npm-shrinkwrap.json``, ``yarn.lock``, ``Cargo.toml``/``Cargo.lock``, ``go.mod``/``go.sum``,
``Gemfile``/``Gemfile.lock``, ``composer.json``/``composer.lock``. Others (``pnpm-lock.yaml``,
``pom.xml``, ...) are recognised by name and reported as changed.

A parsed manifest is a mapping ``key -> spec``: a package's normalised name and its
version or constraint, or a *source* (``source:<where>``: an index, a registry host,
a git/URL/path dependency), which says where code comes from besides the default
registry.
"""

from __future__ import annotations

import configparser
import fnmatch
import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SOURCE = "source:"  # key prefix of a package source (index, registry, git/URL/path dependency)

# ---- helpers -------------------------------------------------------------------------------------


def clean_url(s: str) -> str:
    """``s`` without the credentials of any URL in it (``https://user:tok@h`` -> ``https://***@h``)."""
    return re.sub(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@", r"\1***@", s)


def _pep503(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_PEP508 = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$", re.S)
_DIRECT = re.compile(r"(://|^\s*@|\bgit\+|^file:|^\.{0,2}/)")


def _requirement(line: str, out: dict[str, str]) -> None:
    """One PEP 508 requirement (``name[extras] spec ; marker`` or ``name @ url``) into ``out``."""
    line = line.strip()
    if not line:
        return
    if "://" in line.split("@", 1)[0] or line.startswith(("git+", "file:", "./", "../", "/")):
        egg = re.search(r"[#&]egg=([A-Za-z0-9._-]+)", line)  # a bare URL or path
        key = _pep508_or(egg.group(1) if egg else None, line)
        out[key] = clean_url(line)
        out[SOURCE + clean_url(line)] = key
        return
    m = _PEP508.match(line)
    if m is None:
        return
    name, spec = _pep503(m.group(1)), m.group(3).strip()
    if spec.startswith("@"):  # a direct reference: name @ url
        out[SOURCE + clean_url(spec[1:].split(";", 1)[0].strip())] = name
    out[name] = _join(out.get(name), clean_url(spec))


def _pep508_or(name: str | None, fallback: str) -> str:
    return _pep503(name) if name else clean_url(fallback)


def _join(old: str | None, spec: str) -> str:
    """The specs of a package named twice (two groups): both, sorted, deterministic."""
    if old is None or old == spec:
        return spec
    return " | ".join(sorted({*old.split(" | "), spec}))


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _toml(data: bytes) -> dict[str, Any]:
    try:
        return tomllib.loads(data.decode("utf-8"))
    except RecursionError:  # nested past the interpreter's stack: untrusted input, not a manifest
        raise ValueError("nested too deeply") from None


def _json(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _dig(node: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(k)
    return node


def _versions(out: dict[str, str], name: str, version: str) -> None:
    """Lock files may hold one package at several versions: keep them all, sorted."""
    prev = out.get(name)
    vs = set(prev.split(", ")) if prev else set()
    vs.add(version)
    out[name] = ", ".join(sorted(vs))


# ---- parsers: bytes -> {key: spec} (ValueError and friends when unreadable) ----------------------


_REQ_OPTIONS = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--trusted-host",
                "-r", "--requirement", "-c", "--constraint")


def parse_requirements(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    logical: list[str] = []
    buf = ""
    for raw in _text(data).splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    if buf:
        logical.append(buf)
    for line in logical:
        s = line.strip()
        if not s:
            continue
        if s.startswith("-"):
            m = re.match(r"^(-{1,2}[A-Za-z][A-Za-z-]*)(?:=|\s+|$)(.*)$", s)
            opt, val = (m.group(1), m.group(2).strip()) if m else (s, "")
            if opt in ("-e", "--editable"):
                _requirement(val, out)
                if SOURCE + clean_url(val) not in out:
                    out[SOURCE + clean_url(val)] = "editable"
            elif opt in _REQ_OPTIONS:
                out[SOURCE + f"{opt} {clean_url(val)}"] = opt
            continue
        _requirement(s, out)
    return out


def _pep508_list(items: Any, out: dict[str, str]) -> None:
    if isinstance(items, list):
        for it in items:
            if isinstance(it, str):
                _requirement(it, out)


def _poetry_deps(table: Any, out: dict[str, str]) -> None:
    if not isinstance(table, dict):
        return
    for name, spec in table.items():
        if name == "python":
            continue
        key = _pep503(str(name))
        if isinstance(spec, dict):
            for src in ("git", "url", "path"):
                if isinstance(spec.get(src), str):
                    out[SOURCE + clean_url(spec[src])] = key
            text = str(spec.get("version", "") or next((clean_url(str(spec[s])) for s in ("git", "url", "path")
                                                        if s in spec), ""))
        elif isinstance(spec, list):
            text = "multiple constraints"
        else:
            text = str(spec)
        out[key] = _join(out.get(key), text)


def parse_pyproject(data: bytes) -> dict[str, str]:
    doc = _toml(data)
    out: dict[str, str] = {}
    _pep508_list(_dig(doc, "project", "dependencies"), out)
    for table in (_dig(doc, "project", "optional-dependencies"), doc.get("dependency-groups")):
        if isinstance(table, dict):
            for items in table.values():
                _pep508_list(items, out)
    _pep508_list(_dig(doc, "build-system", "requires"), out)
    _poetry_deps(_dig(doc, "tool", "poetry", "dependencies"), out)
    _poetry_deps(_dig(doc, "tool", "poetry", "dev-dependencies"), out)
    groups = _dig(doc, "tool", "poetry", "group")
    if isinstance(groups, dict):
        for g in groups.values():
            _poetry_deps(_dig(g, "dependencies"), out)
    pdm = _dig(doc, "tool", "pdm", "dev-dependencies")
    if isinstance(pdm, dict):
        for items in pdm.values():
            _pep508_list(items, out)
    for src in (_dig(doc, "tool", "poetry", "source"), _dig(doc, "tool", "uv", "index"), _dig(doc, "tool", "pdm", "source")):
        if isinstance(src, list):
            for s in src:
                if isinstance(s, dict) and isinstance(s.get("url"), str):
                    out[SOURCE + clean_url(s["url"])] = str(s.get("name", "index"))
    uv_sources = _dig(doc, "tool", "uv", "sources")
    if isinstance(uv_sources, dict):
        for name, spec in uv_sources.items():
            for s in (spec if isinstance(spec, list) else [spec]):
                if isinstance(s, dict):
                    where = next((clean_url(str(s[k])) for k in ("git", "url", "path", "index") if k in s), None)
                    if where:
                        out[SOURCE + where] = _pep503(str(name))
    return out


def parse_setup_cfg(data: bytes) -> dict[str, str]:
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read_string(_text(data))
    except configparser.Error as e:
        raise ValueError(f"not an INI file: {e.message.splitlines()[0]}") from None
    out: dict[str, str] = {}
    if cp.has_option("options", "install_requires"):
        for line in cp.get("options", "install_requires").splitlines():
            _requirement(line, out)
    if cp.has_section("options.extras_require"):
        for _k, v in cp.items("options.extras_require"):
            for line in v.splitlines():
                _requirement(line, out)
    return out


def parse_pipfile(data: bytes) -> dict[str, str]:
    doc = _toml(data)
    out: dict[str, str] = {}
    _poetry_deps(doc.get("packages"), out)
    _poetry_deps(doc.get("dev-packages"), out)
    src = doc.get("source")
    if isinstance(src, list):
        for s in src:
            if isinstance(s, dict) and isinstance(s.get("url"), str):
                out[SOURCE + clean_url(s["url"])] = str(s.get("name", "index"))
    return out


def parse_pipfile_lock(data: bytes) -> dict[str, str]:
    doc = _json(data)
    out: dict[str, str] = {}
    for sect in ("default", "develop"):
        table = doc.get(sect) if isinstance(doc, dict) else None
        if isinstance(table, dict):
            for name, spec in table.items():
                v = spec.get("version") if isinstance(spec, dict) else None
                _versions(out, _pep503(str(name)), str(v or "").lstrip("=") or "?")
                if isinstance(spec, dict):
                    for k in ("git", "file", "path"):
                        if isinstance(spec.get(k), str):
                            out[SOURCE + clean_url(spec[k])] = _pep503(str(name))
    return out


def parse_toml_lock(data: bytes) -> dict[str, str]:
    """``poetry.lock``, ``uv.lock``, ``Cargo.lock``: ``[[package]]`` with name, version, source."""
    doc = _toml(data)
    out: dict[str, str] = {}
    pkgs = doc.get("package")
    if not isinstance(pkgs, list):
        return out
    for p in pkgs:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            continue
        name = str(p["name"])
        _versions(out, name, str(p.get("version", "?")))
        src = p.get("source")
        where: str | None = None
        if isinstance(src, str) and not src.startswith("registry+https://github.com/rust-lang/crates.io-index"):
            where = src  # Cargo.lock: git+..., registry+<another registry>
        elif isinstance(src, dict):
            if src.get("type") in ("git", "url", "file", "directory") and isinstance(src.get("url"), str):
                where = str(src["url"])  # poetry.lock
            elif src.get("type") == "legacy" and isinstance(src.get("url"), str):
                where = str(src["url"])
            else:
                for k in ("git", "url", "path", "directory", "editable"):  # uv.lock
                    if isinstance(src.get(k), str):
                        where = str(src[k])
                        break
                reg = src.get("registry")
                if where is None and isinstance(reg, str) and not reg.startswith("https://pypi.org/"):
                    where = reg
        if where:
            out[SOURCE + clean_url(where)] = name
    return out


_NPM_DEP_TABLES = ("dependencies", "devDependencies", "optionalDependencies", "peerDependencies")


def _npm_source(spec: str) -> bool:
    """A package.json range that does not come from the registry by name (git, URL, file,
    GitHub shorthand, an alias to another package)."""
    s = spec.strip()
    if s.startswith(("workspace:", "catalog:")):
        return False
    return ":" in s or "/" in s


def parse_package_json(data: bytes) -> dict[str, str]:
    doc = _json(data)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    out: dict[str, str] = {}
    for t in _NPM_DEP_TABLES:
        table = doc.get(t)
        if isinstance(table, dict):
            for name, spec in table.items():
                out[str(name)] = _join(out.get(str(name)), clean_url(str(spec)))
                if _npm_source(str(spec)):
                    out[SOURCE + clean_url(str(spec))] = str(name)
    return out


def _lock_name(key: str) -> str:
    return key.rsplit("node_modules/", 1)[-1]


def _registry_host(resolved: Any) -> str | None:
    if not isinstance(resolved, str):
        return None
    m = re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://(?:[^/@]*@)?([^/]+)", resolved)
    if m is None:
        return clean_url(resolved)  # file:, git+ssh without //, ...
    host = m.group(1)
    if host in ("registry.npmjs.org", "registry.yarnpkg.com"):
        return None
    return f"{resolved.split('://', 1)[0]}://{host}"


def parse_package_lock(data: bytes) -> dict[str, str]:
    doc = _json(data)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    out: dict[str, str] = {}
    pkgs = doc.get("packages")
    if isinstance(pkgs, dict):  # lockfileVersion 2 and 3
        for key, p in pkgs.items():
            if not key or not isinstance(p, dict):
                continue
            name = str(p.get("name") or _lock_name(str(key)))
            _versions(out, name, str(p.get("version", "?")))
            if (host := _registry_host(p.get("resolved"))) is not None:
                out[SOURCE + host] = name
        return out

    todo = [doc.get("dependencies")]  # lockfileVersion 1: nested, walked without recursion
    while todo:
        deps = todo.pop()
        if not isinstance(deps, dict):
            continue
        for name, p in deps.items():
            if isinstance(p, dict):
                _versions(out, str(name), str(p.get("version", "?")))
                if (host := _registry_host(p.get("resolved"))) is not None:
                    out[SOURCE + host] = str(name)
                todo.append(p.get("dependencies"))
    return out


def _spec_name(spec: str) -> str:
    s = spec.strip().strip('"')
    at = s.rfind("@")
    return s[:at] if at > 0 else s


def parse_yarn_lock(data: bytes) -> dict[str, str]:
    """yarn.lock, classic (``version "1.2.3"``) and berry (``version: 1.2.3``)."""
    out: dict[str, str] = {}
    current: list[str] = []
    for line in _text(data).splitlines():
        if not line or line.startswith("#"):
            continue
        if not line[0].isspace():
            head = line.rstrip().removesuffix(":")
            current = sorted({_spec_name(p) for p in head.split(",") if p.strip()})
            if current == ["__metadata"]:
                current = []
            continue
        s = line.strip()
        m = re.match(r'^version:?\s+"?([^"\s]+)"?$', s)
        if m and current:
            for name in current:
                _versions(out, name, m.group(1))
            continue
        m = re.match(r'^resolved:?\s+"?([^"\s]+)"?$', s)
        if m and current and (host := _registry_host(m.group(1))) is not None:
            out[SOURCE + host] = current[0]
    return out


def _cargo_table(table: Any, out: dict[str, str]) -> None:
    if not isinstance(table, dict):
        return
    for name, spec in table.items():
        if isinstance(spec, dict):
            for k in ("git", "path", "registry"):
                if isinstance(spec.get(k), str):
                    out[SOURCE + clean_url(spec[k])] = str(name)
            text = str(spec.get("version", "") or next((clean_url(str(spec[k])) for k in ("git", "path", "registry")
                                                        if k in spec), "*"))
        else:
            text = str(spec)
        out[str(name)] = _join(out.get(str(name)), text)


def parse_cargo_toml(data: bytes) -> dict[str, str]:
    doc = _toml(data)
    out: dict[str, str] = {}
    tables = ("dependencies", "dev-dependencies", "build-dependencies")
    for t in tables:
        _cargo_table(doc.get(t), out)
    _cargo_table(_dig(doc, "workspace", "dependencies"), out)
    targets = doc.get("target")
    if isinstance(targets, dict):
        for tt in targets.values():
            for t in tables:
                _cargo_table(_dig(tt, t), out)
    return out


def parse_go_mod(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    block: str | None = None
    for raw in _text(data).splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        if block is not None:
            if line == ")":
                block = None
                continue
            _go_directive(block, line, out)
            continue
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if rest == "(":
            block = word
            continue
        _go_directive(word, rest, out)
    return out


def _go_directive(word: str, rest: str, out: dict[str, str]) -> None:
    parts = rest.split()
    if word == "require" and len(parts) >= 2:
        out[parts[0]] = parts[1]
    elif word == "replace" and "=>" in rest:
        left, right = (s.strip() for s in rest.split("=>", 1))
        out[SOURCE + clean_url(right)] = f"replace {left.split()[0]}"


def parse_go_sum(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _text(data).splitlines():
        parts = line.split()
        if len(parts) >= 3:
            _versions(out, parts[0], parts[1].removesuffix("/go.mod"))
    return out


_GEM = re.compile(r"""^\s*gem\s*\(?\s*["']([^"']+)["']\s*(.*)$""")
_GEM_SOURCE = re.compile(r"""^\s*source\s*\(?\s*["']([^"']+)["']""")
_GEM_OPT = re.compile(r"""\b(git|github|path|source)\s*(?::|=>)\s*["']([^"']+)["']""")


def parse_gemfile(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _text(data).splitlines():
        line = line.split("#", 1)[0]
        m = _GEM.match(line)
        if m:
            name, rest = m.group(1), m.group(2)
            vers = re.findall(r"""["']([^"']*\d[^"']*)["']""", rest.split(":", 1)[0] if ":" in rest else rest)
            out[name] = _join(out.get(name), ", ".join(vers) or "*")
            for _k, where in _GEM_OPT.findall(rest):
                out[SOURCE + clean_url(where)] = name
            continue
        s = _GEM_SOURCE.match(line)
        if s and s.group(1) != "https://rubygems.org":
            out[SOURCE + clean_url(s.group(1))] = "source"
    return out


def parse_gemfile_lock(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    section = ""
    for line in _text(data).splitlines():
        if line and not line[0].isspace():
            section = line.strip()
            continue
        m = re.match(r"^    ([^ (]+) \(([^)]+)\)$", line)  # exactly four spaces: a spec, not its deps
        if m and section in ("GEM", "GIT", "PATH"):
            _versions(out, m.group(1), m.group(2))
            continue
        r = re.match(r"^  remote: (\S+)$", line)
        if r and r.group(1).rstrip("/") != "https://rubygems.org":
            out[SOURCE + clean_url(r.group(1))] = section.lower()
    return out


def parse_composer_json(data: bytes) -> dict[str, str]:
    doc = _json(data)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    out: dict[str, str] = {}
    for t in ("require", "require-dev"):
        table = doc.get(t)
        if isinstance(table, dict):
            for name, spec in table.items():
                out[str(name)] = str(spec)
    repos = doc.get("repositories")
    for r in (repos.values() if isinstance(repos, dict) else repos if isinstance(repos, list) else []):
        if isinstance(r, dict) and isinstance(r.get("url"), str):
            out[SOURCE + clean_url(r["url"])] = str(r.get("type", "repository"))
    return out


def parse_composer_lock(data: bytes) -> dict[str, str]:
    doc = _json(data)
    out: dict[str, str] = {}
    for t in ("packages", "packages-dev"):
        lst = doc.get(t) if isinstance(doc, dict) else None
        if isinstance(lst, list):
            for p in lst:
                if isinstance(p, dict) and isinstance(p.get("name"), str):
                    _versions(out, p["name"], str(p.get("version", "?")))
    return out


# ---- which files ---------------------------------------------------------------------------------

Parser = Callable[[bytes], dict[str, str]]

# basename -> parser
_BY_NAME: dict[str, Parser] = {
    "pyproject.toml": parse_pyproject,
    "setup.cfg": parse_setup_cfg,
    "Pipfile": parse_pipfile,
    "Pipfile.lock": parse_pipfile_lock,
    "poetry.lock": parse_toml_lock,
    "uv.lock": parse_toml_lock,
    "pdm.lock": parse_toml_lock,
    "Cargo.lock": parse_toml_lock,
    "Cargo.toml": parse_cargo_toml,
    "package.json": parse_package_json,
    "package-lock.json": parse_package_lock,
    "npm-shrinkwrap.json": parse_package_lock,
    "yarn.lock": parse_yarn_lock,
    "go.mod": parse_go_mod,
    "go.sum": parse_go_sum,
    "Gemfile": parse_gemfile,
    "gems.rb": parse_gemfile,
    "Gemfile.lock": parse_gemfile_lock,
    "gems.locked": parse_gemfile_lock,
    "composer.json": parse_composer_json,
    "composer.lock": parse_composer_lock,
}
# recognised, reported as changed without parsing (no stdlib parser, or rarely worth one)
OTHER_MANIFESTS: frozenset[str] = frozenset({
    "pnpm-lock.yaml", "pnpm-workspace.yaml", "bun.lockb", "bun.lock", "deno.json", "deno.jsonc", "deno.lock",
    "go.work", "go.work.sum", "environment.yml", "environment.yaml", "conda-lock.yml", "pixi.toml", "pixi.lock",
    "pom.xml", "build.gradle", "build.gradle.kts", "gradle.lockfile", "libs.versions.toml", "packages.config",
    "packages.lock.json", "Directory.Packages.props", "paket.dependencies", "paket.lock",
    "mix.exs", "mix.lock", "Package.swift", "Package.resolved", "Podfile", "Podfile.lock", "Cartfile",
    "Cartfile.resolved", "pubspec.yaml", "pubspec.lock", "rebar.config", "rebar.lock", "stack.yaml",
    "cabal.project", "cabal.project.freeze", "flake.lock", "vcpkg.json", "conanfile.txt", "conanfile.py",
    "renv.lock", "DESCRIPTION", "Project.toml", "Manifest.toml", "requirements.yml",
})
_OTHER_GLOBS = ("*.csproj", "*.fsproj", "*.vbproj", "*.cabal", "*.gemspec", "*.nuspec", "*.rockspec")


def _is_requirements(path: str) -> bool:
    parts = path.split("/")
    base = parts[-1]
    if base.endswith((".txt", ".in")) and ("requirements" in base or base.startswith("constraints")):
        return True
    return len(parts) > 1 and parts[-2] in ("requirements", "requirements.d") and base.endswith((".txt", ".in"))


def manifest_parser(path: str) -> Parser | bool | None:
    """The parser of the manifest at ``path``; True: a manifest we only detect; None: none."""
    base = path.rsplit("/", 1)[-1]
    if base in _BY_NAME:
        return _BY_NAME[base]
    if _is_requirements(path):
        return parse_requirements
    if base in OTHER_MANIFESTS or any(fnmatch.fnmatchcase(base, g) for g in _OTHER_GLOBS):
        return True
    return None


# ---- the delta -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delta:
    """What changed between two parsed manifests."""

    added: dict[str, str] = field(default_factory=dict)  # name -> spec (new packages)
    changed: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (old spec, new spec)
    removed: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # new sources: where -> for what

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed or self.sources)


def delta(old: dict[str, str], new: dict[str, str]) -> Delta:
    def pkgs(d: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in d.items() if not k.startswith(SOURCE)}

    o, n = pkgs(old), pkgs(new)
    return Delta(
        added={k: n[k] for k in sorted(n.keys() - o.keys())},
        changed={k: (o[k], n[k]) for k in sorted(n.keys() & o.keys()) if o[k] != n[k]},
        removed={k: o[k] for k in sorted(o.keys() - n.keys())},
        sources={k[len(SOURCE):]: new[k] for k in sorted(new.keys() - old.keys()) if k.startswith(SOURCE)},
    )


# ---- build hooks in manifests ----------------------------------------------------------------------

# npm runs these itself (install, publish, pack); a change runs on the next `npm install`
NPM_LIFECYCLE: frozenset[str] = frozenset({
    "preinstall", "install", "postinstall", "prepublish", "preprepare", "prepare", "postprepare",
    "prepublishOnly", "prepack", "postpack", "dependencies",
})
# composer runs these on install/update
COMPOSER_AUTO_PREFIXES = ("pre-install", "post-install", "pre-update", "post-update", "post-autoload",
                          "pre-autoload", "post-root-package-install", "post-create-project", "pre-package",
                          "post-package")


@dataclass(frozen=True)
class ScriptsDelta:
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    automatic: tuple[str, ...]  # among added/changed: run by the package manager itself

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def _scripts(data: bytes | None) -> dict[str, str]:
    if data is None:
        return {}
    doc = _json(data)
    s = doc.get("scripts") if isinstance(doc, dict) else None
    if not isinstance(s, dict):
        return {}
    return {str(k): json.dumps(v, sort_keys=True) for k, v in s.items()}


def scripts_delta(base: str, old: bytes | None, new: bytes | None) -> ScriptsDelta:
    """The ``scripts`` of ``package.json`` / ``composer.json``, old vs new (ValueError: not JSON)."""
    o, n = _scripts(old), _scripts(new)
    added = tuple(sorted(n.keys() - o.keys()))
    changed = tuple(sorted(k for k in n.keys() & o.keys() if n[k] != o[k]))
    removed = tuple(sorted(o.keys() - n.keys()))
    if base == "composer.json":
        auto = tuple(k for k in (*added, *changed) if k.startswith(COMPOSER_AUTO_PREFIXES))
    else:
        auto = tuple(k for k in (*added, *changed) if k in NPM_LIFECYCLE)
    return ScriptsDelta(added, changed, removed, tuple(sorted(auto)))


# pyproject.toml tables that make a build (or an install) run code, and what each is
PYPROJECT_HOOKS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    # (table path, what it is, high: runs arbitrary code at the next build/install)
    (("build-system",), "[build-system] (the build backend and its requirements)", True),
    (("tool", "setuptools", "cmdclass"), "[tool.setuptools.cmdclass] (custom build commands)", True),
    (("tool", "hatch", "build"), "[tool.hatch.build] (build targets and hooks)", True),
    (("tool", "hatch", "metadata", "hooks"), "[tool.hatch.metadata.hooks] (metadata hooks)", True),
    (("tool", "pdm", "build"), "[tool.pdm.build] (build scripts)", True),
    (("tool", "poetry", "build"), "[tool.poetry.build] (build script)", True),
    (("tool", "scikit-build"), "[tool.scikit-build] (CMake build)", True),
    (("tool", "maturin"), "[tool.maturin] (Rust extension build)", True),
    (("tool", "setuptools", "ext-modules"), "[tool.setuptools.ext-modules] (compiled extensions)", False),
    (("project", "scripts"), "[project.scripts] (commands installed on PATH)", False),
    (("project", "gui-scripts"), "[project.gui-scripts] (commands installed on PATH)", False),
    (("project", "entry-points"), "[project.entry-points] (plugins loaded by other tools)", False),
    (("tool", "poetry", "scripts"), "[tool.poetry.scripts] (commands installed on PATH)", False),
    (("tool", "poetry", "plugins"), "[tool.poetry.plugins] (plugins loaded by other tools)", False),
)


def pyproject_hooks(old: bytes | None, new: bytes | None) -> list[tuple[str, bool]]:
    """The build-hook tables of ``pyproject.toml`` that differ (what, high), in table order.
    ValueError/TOMLDecodeError/UnicodeDecodeError when a side is not TOML."""
    o = _toml(old) if old is not None else {}
    n = _toml(new) if new is not None else {}
    return [(what, high) for keys, what, high in PYPROJECT_HOOKS if _dig(o, *keys) != _dig(n, *keys)]
