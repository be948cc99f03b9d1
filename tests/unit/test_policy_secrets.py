"""Sensitive patterns, the scan, and its incremental cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pathspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stockade import policy
from stockade.policy import CliPolicy
from stockade.policy.config import Origin
from stockade.policy.secrets import (
    DEFAULT_ALLOW,
    DEFAULT_PATTERNS,
    Matcher,
    PatternRule,
    SecretScanner,
)


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    home = tmp_path / "home"
    proj = tmp_path / "proj"
    proj.mkdir()
    home.mkdir()
    sess = tmp_path / "session"
    sess.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    return {"home": home, "proj": proj, "sess": sess, "state": tmp_path / "state"}


def _touch(root: Path, *rels: str, content: str = "x") -> None:
    for rel in rels:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)


def _default_matcher() -> Matcher:
    o = Origin("default")
    return Matcher([PatternRule(p, "deny", o) for p in DEFAULT_PATTERNS],
                   [PatternRule(p, "allow", o) for p in DEFAULT_ALLOW])


@pytest.mark.parametrize(
    ("rel", "masked"),
    [
        (".env", True), ("app/.env", True), (".env.local", True), (".env.production", True),
        (".env.example", False), ("sub/.env.sample", False), ("server.pem", True), ("tls/server.KEY", True),
        ("config/credentials.json", True), ("AWS_CREDENTIALS", True), ("my_secret.txt", True),
        ("id_rsa", True), ("keys/id_rsa.pub", False), ("id_ed25519", True), ("cert.p12", True),
        (".netrc", True), ("README.md", False), ("src/main.py", False), ("environment.py", False),
        ("key.py", False), ("monkey", False), (".envrc", False), ("docs/env.md", False),
    ],
)
def test_default_patterns_files(rel: str, masked: bool) -> None:
    m = _default_matcher()
    rule, _ = m.decide(rel, False)
    assert (rule is not None) == masked
    assert m.candidate(rel, False) or not masked


@pytest.mark.parametrize("rel", [".aws", ".ssh", "home/.gnupg", "secrets", "x/my-secrets"])
def test_default_patterns_dirs(rel: str) -> None:
    assert _default_matcher().decide(rel, True)[0] is not None


def test_dir_pattern_does_not_match_a_file_of_that_name() -> None:
    assert _default_matcher().decide(".ssh", False)[0] is None


def test_scan_finds_masks_and_skips_masked_dirs(env: dict[str, Path]) -> None:
    p = env["proj"]
    _touch(p, ".env", ".env.example", "src/app.py", "src/.env.local", "deploy/key.pem", ".ssh/id_rsa",
           ".ssh/known_hosts", "node_modules/x/index.js", "docs/id_rsa.pub")
    os.symlink(".env", p / "link-to-env")
    os.symlink("/etc/hostname", p / ".env.dev")
    eff = policy.load(p, env["sess"], CliPolicy())
    got = {(str(m.path.relative_to(p)), m.is_dir, m.is_symlink, m.rule) for m in eff.masked(p)}
    assert got == {
        (".env", False, False, ".env"),
        (".env.dev", False, True, ".env.*"),
        (".ssh", True, False, ".ssh/"),
        ("deploy/key.pem", False, False, "*.pem"),
        ("src/.env.local", False, False, ".env.*"),
    }


def test_npmrc_masked_only_with_a_token(env: dict[str, Path]) -> None:
    p = env["proj"]
    _touch(p, "a/.npmrc", content="registry=https://r.example/\n")
    _touch(p, "b/.npmrc", content="//r.example/:_authToken=npm_abc\n")
    _touch(p, "c/.pypirc", content="[pypi]\nusername = __token__\npassword = pypi-xyz\n")
    _touch(p, "d/.pypirc", content="[distutils]\nindex-servers = pypi\n")
    eff = policy.load(p, env["sess"], CliPolicy())
    assert sorted(str(m.path.relative_to(p)) for m in eff.masked(p)) == ["b/.npmrc", "c/.pypirc"]
    # a token added later is seen although the directory did not change
    (p / "a" / ".npmrc").write_text("_auth=Zm9vOmJhcg==\n")
    eff2 = policy.load(p, env["sess"], CliPolicy())
    assert "a/.npmrc" in [str(m.path.relative_to(p)) for m in eff2.masked(p)]


def test_config_patterns_and_allow_layers(env: dict[str, Path]) -> None:
    p = env["proj"]
    _touch(p, "infra/prod.tfstate", "test/fixtures/fake.key", "other.key", ".env")
    (p / ".stockade.toml").write_text(
        '[secrets]\npatterns = ["*.tfstate"]\nallow = ["test/fixtures/*.key"]\n'
    )
    eff = policy.load(p, env["sess"], CliPolicy(mask_patterns=("*.md",)))
    got = sorted(str(m.path.relative_to(p)) for m in eff.masked(p))
    assert got == [".env", "infra/prod.tfstate", "other.key"]
    # a workspace allow does not exempt a later (CLI) deny pattern: deny wins
    eff2 = policy.load(p, env["sess"], CliPolicy(mask_patterns=("fixtures/",)))
    assert "test/fixtures" in [str(m.path.relative_to(p)) for m in eff2.masked(p)]
    # session exact-path allow lifts a default pattern for that one file
    (env["sess"] / "policy.json").write_text(f'{{"paths": [{{"path": "{p / ".env"}"}}]}}')
    eff3 = policy.load(p, env["sess"], CliPolicy())
    assert ".env" not in [str(m.path.relative_to(p)) for m in eff3.masked(p)]
    assert eff3.why(p / ".env").visible and eff3.why(p / ".env").source == "session"


def test_defaults_off(env: dict[str, Path]) -> None:
    _touch(env["proj"], ".env")
    (env["proj"] / ".stockade.toml").write_text("[secrets]\ndefaults = false\n")
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert eff.masked(env["proj"]) == []
    assert any("built-in secret patterns are disabled" in w for w in eff.warnings)


def test_cache_is_incremental_and_correct(env: dict[str, Path]) -> None:
    p = env["proj"]
    for i in range(30):
        _touch(p, f"d{i}/f.py", f"d{i}/sub/g.py")
    _touch(p, "d3/.env")
    eff = policy.load(p, env["sess"], CliPolicy())
    assert [str(m.path.relative_to(p)) for m in eff.masked(p)] == ["d3/.env"]
    first = eff.scan_stats[str(p)]
    assert first["reused"] == 0 and first["listed"] == 61
    cache_files = list((env["state"] / "cache").glob("secrets-*.json"))
    assert len(cache_files) == 1  # one per tree and rule set, shared by the sessions
    # make every directory look old so the racy window does not force re-listing
    old = 1_000_000_000
    for d, _, _ in os.walk(p):
        os.utime(d, ns=(old, old))
    eff = policy.load(p, env["sess"], CliPolicy())
    eff.masked(p)
    eff = policy.load(p, env["sess"], CliPolicy())
    assert [str(m.path.relative_to(p)) for m in eff.masked(p)] == ["d3/.env"]
    assert eff.scan_stats[str(p)]["listed"] == 0 and eff.scan_stats[str(p)]["reused"] == 61
    # host-side change between runs: a new secret deep in the tree, one removed
    _touch(p, "d17/sub/id_rsa")
    (p / "d3" / ".env").unlink()
    eff = policy.load(p, env["sess"], CliPolicy())
    assert [str(m.path.relative_to(p)) for m in eff.masked(p)] == ["d17/sub/id_rsa"]
    assert eff.scan_stats[str(p)]["listed"] == 2
    # a policy change invalidates the cache
    eff = policy.load(p, env["sess"], CliPolicy(mask_patterns=("f.py",)))
    assert len(eff.masked(p)) == 31
    assert eff.scan_stats[str(p)]["reused"] == 0


def test_corrupt_cache_is_ignored(env: dict[str, Path]) -> None:
    p = env["proj"]
    _touch(p, "a/.env")
    policy.load(p, env["sess"], CliPolicy()).masked(p)
    for f in (env["state"] / "cache").glob("secrets-*.json"):
        f.write_text("{not json")
    policy.clear_cache()  # as in a new process: only the disk cache
    assert [m.path for m in policy.load(p, env["sess"], CliPolicy()).masked(p)] == [p / "a" / ".env"]


# ------------------------------------------------------------------- properties

_name = st.sampled_from(["a", "b", ".env", "x.pem", "id_rsa", "id_rsa.pub", "Secret", "keys", "lib", ".env.example"])
_rel = st.lists(_name, min_size=1, max_size=4).map("/".join)
_pattern = st.sampled_from(
    ["*.pem", ".env", ".env.*", "keys/", "a/*.pem", "/b", "**/lib/*.pem", "id_rsa*", "*secret*", "a/**/x.pem", "b/a"]
)


@settings(max_examples=500, deadline=None)
@given(_pattern, _rel, st.booleans())
def test_matcher_agrees_with_pathspec(pattern: str, rel: str, is_dir: bool) -> None:
    """One deny pattern: our combined regex decides as pathspec's gitignore matcher does."""
    m = Matcher([PatternRule(pattern, "deny", Origin("workspace"))], [])
    spec = pathspec.GitIgnoreSpec.from_lines([pattern])
    key = rel + "/" if is_dir else rel
    expect = spec.match_file(key.lower()) or spec.match_file(key)
    if not expect:  # case-insensitive: try the pattern lowered too
        expect = pathspec.GitIgnoreSpec.from_lines([pattern.lower()]).match_file(key.lower())
    assert (m.decide(rel, is_dir)[0] is not None) == expect
    parts = rel.split("/")
    if not any(m.decide("/".join(parts[:i]), True)[0] for i in range(1, len(parts))):
        assert m.candidate(rel, is_dir) == expect  # exact when no ancestor is masked


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_pattern, st.sampled_from(["deny", "allow"]), st.sampled_from(["default", "global", "session"])), max_size=6), _rel)
def test_allow_exempts_only_same_or_earlier_denies(rules: list[tuple[str, str, str]], rel: str) -> None:
    prs = [PatternRule(p, a, Origin(lay)) for p, a, lay in rules]
    m = Matcher([r for r in prs if r.action == "deny"], [r for r in prs if r.action == "allow"])

    def hit(pat: str) -> bool:
        return bool(pathspec.GitIgnoreSpec.from_lines([pat.lower()]).match_file(rel.lower()))

    expect = any(
        r.action == "deny" and hit(r.pattern)
        and not any(a.action == "allow" and a.origin.index >= r.origin.index and hit(a.pattern) for a in prs)
        for r in prs
    )
    assert (m.decide(rel, False)[0] is not None) == expect


_tree = st.lists(_rel, min_size=1, max_size=25, unique=True)


def _build(root: Path, rels: list[str]) -> None:
    for rel in rels:
        target = root / rel
        try:
            if any(parent.is_file() for parent in list(target.parents)[: len(Path(rel).parts) - 1]):
                continue
            if target.is_dir():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("x")
        except (NotADirectoryError, FileExistsError, IsADirectoryError):
            continue


def _brute_force(root: Path, m: Matcher) -> set[str]:
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for name in list(dirnames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if m.decide(rel, True)[0] is not None:
                out.add(rel)
                dirnames.remove(name)
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if m.decide(rel, False)[0] is not None:
                out.add(rel)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_tree, _tree)
def test_scan_and_cached_rescan_match_brute_force(tmp_path: Path, first: list[str], second: list[str]) -> None:
    root = tmp_path / "t"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    _build(root, first)
    m = _default_matcher()
    hits, cache = SecretScanner(m).scan(root)
    assert {h.rel for h in hits} == _brute_force(root, m)
    # mutate: remove some, add others; the cached rescan must equal a fresh brute force
    for rel in first[::2]:
        target = root / rel
        if target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
    _build(root, second)
    hits2, _ = SecretScanner(m).scan(root, cache)
    assert {h.rel for h in hits2} == _brute_force(root, m)
