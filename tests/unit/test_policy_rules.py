"""Path rules across layers: deny wins, exact later allow lifts, provenance in why()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade import policy
from stockade.errors import PolicyError
from stockade.policy import CliPolicy
from stockade.policy.config import LAYERS, Origin, PathEntry
from stockade.policy.rules import is_under, resolve_paths


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    home = tmp_path / "home"
    proj = home / "src" / "proj"
    proj.mkdir(parents=True)
    (home / ".config" / "stockade").mkdir(parents=True)
    (tmp_path / "opt" / "data" / "private").mkdir(parents=True)
    sess = tmp_path / "session"
    sess.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    return {"home": home, "proj": proj, "global": home / ".config" / "stockade" / "config.toml",
            "sess": sess, "opt": tmp_path / "opt"}


def _session(sess: Path, *entries: tuple[str, str]) -> None:
    (sess / "policy.json").write_text(json.dumps(
        {"schema_version": 1, "paths": [{"path": p, "access": a} for p, a in entries]}, indent=1))


def test_session_deny_beats_global_allow(env: dict[str, Path]) -> None:
    data = env["opt"] / "data"
    env["global"].write_text(f'[[paths]]\npath = "{data}"\naccess = "rw"\n')
    assert [g.host_path for g in policy.load(env["proj"], env["sess"], CliPolicy()).grants] == [data]
    _session(env["sess"], (str(data), "deny"))
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert eff.grants == []
    d = eff.why(data / "file.txt")
    assert d.access == "denied" and d.source == "session"
    assert d.rule is not None and d.rule.origin.file == str(env["sess"] / "policy.json")
    assert [r.source for r in d.overridden] == ["global"]
    shown = [r for r in eff.rules() if r.kind == "path" and r.target == str(data)]
    assert {(r.source, r.active) for r in shown} == {("global", False), ("session", True)}


def test_global_deny_survives_earlier_and_same_layer_allows(env: dict[str, Path]) -> None:
    data = env["opt"] / "data"
    env["global"].write_text(f'[[paths]]\npath = "{data}"\naccess = "deny"\n')
    # CLI allow of a *subpath* does not lift a deny of its parent
    eff = policy.load(env["proj"], env["sess"], CliPolicy(allow_paths=((str(data / "private"), True),)))
    assert eff.grants == []
    assert any("has no effect" in w and str(data) in w for w in eff.warnings)
    assert eff.why(data / "private" / "x").access == "denied"


def test_later_exact_allow_lifts_deny(env: dict[str, Path]) -> None:
    data = env["opt"] / "data"
    env["global"].write_text(f'[[paths]]\npath = "{data}"\naccess = "deny"\n')
    eff = policy.load(env["proj"], env["sess"], CliPolicy(allow_paths=((str(data), False),)))
    assert [(g.host_path, g.writable, g.source) for g in eff.grants] == [(data, False, "cli")]
    assert eff.why(data / "x").access == "ro"


def test_deny_inside_grant_becomes_mask(env: dict[str, Path]) -> None:
    data = env["opt"] / "data"
    (data / "private" / "f").write_text("s")
    (data / "pub").write_text("p")
    _session(env["sess"], (str(data), "rw"), (str(data / "private"), "deny"))
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert [(g.host_path, g.writable) for g in eff.grants] == [(data, True)]
    masks = eff.masked(data)
    assert [(m.path, m.is_dir, m.source) for m in masks] == [(data / "private", True, "session")]
    assert eff.why(data / "pub").access == "rw"


def test_default_denies_home_secrets_and_state(env: dict[str, Path], tmp_path: Path) -> None:
    eff = policy.load(env["proj"], None, CliPolicy())
    d = eff.why(env["home"] / ".ssh" / "id_rsa")
    assert d.access == "denied" and d.source == "default"
    assert eff.why(tmp_path / "state" / "sessions").access == "denied"
    other = env["home"] / "src" / "other"
    assert eff.why(other).access == "absent" and not eff.why(other).visible
    assert "parent of the project" in eff.why(env["home"] / "src").reason


def test_project_inside_denied_tree_is_refused(env: dict[str, Path]) -> None:
    env["global"].write_text(f'[[paths]]\npath = "{env["home"] / "src"}"\naccess = "deny"\n')
    with pytest.raises(policy.PolicyError, match=r"is inside .*denied by global"):
        policy.load(env["proj"], None, CliPolicy())
    assert policy.load(env["proj"], None, CliPolicy(), strict=False).project_deny is not None
    # deny wins: allowing the project itself does not lift the deny of its parent...
    with pytest.raises(policy.PolicyError):
        policy.load(env["proj"], None, CliPolicy(allow_paths=((str(env["proj"]), False),)))
    # ...allowing exactly the denied path in a later layer does
    ok = policy.load(env["proj"], None, CliPolicy(allow_paths=((str(env["home"] / "src"), False),)))
    assert ok.project_deny is None


def test_missing_grant_warns_and_is_skipped(env: dict[str, Path]) -> None:
    """In a config file (shared, may name optional dirs) a missing path is a warning; on
    the command line it is refused (test_policy_config)."""
    (env["proj"] / ".stockade.toml").write_text('[[paths]]\npath = "/nonexistent/zzz"\naccess = "ro"\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    assert eff.grants == []
    assert any("no such path" in w for w in eff.warnings)


def test_outside_masks_cover_visible_system_and_etc_denies_only(env: dict[str, Path], tmp_path: Path) -> None:
    """A deny `why` reports must be hidden inside: system dirs and curated /etc entries
    get a mask; the home and other trees are not visible anyway; /proc and /dev are refused."""
    import os

    usr_file = os.path.realpath("/usr/bin/env")
    denies = [usr_file, "/usr/share", "/usr/share/doc", "/etc/ssl", "/etc/shadow", str(env["home"] / ".x"), "/opt/nothing-here"]
    eff = policy.load(env["proj"], None, CliPolicy(deny_paths=tuple(denies)))
    masks = {str(m.path): m.is_dir for m in eff.outside_masks()}
    # /usr/share/doc is inside /usr/share (masked whole); /etc/shadow is not shown; the rest is not visible
    assert masks == {usr_file: False, "/usr/share": True, "/etc/ssl": True}
    for p in denies:
        assert eff.why(p).access == "denied"
    assert "hidden inside: an empty read-only file" in eff.why(usr_file).reason
    for bad in ("/proc/cpuinfo", "/dev/null"):
        with pytest.raises(PolicyError, match=f"deny {bad} .*cannot be honoured"):
            policy.load(env["proj"], None, CliPolicy(deny_paths=(bad,)))
    policy.load(env["proj"], None, CliPolicy(deny_paths=("/dev/shm/x",)))  # the sandbox's own, private


def test_why_reports_curated_etc_entries_as_visible(env: dict[str, Path]) -> None:
    eff = policy.load(env["proj"], None, CliPolicy())
    assert eff.why("/etc/ssl").access == "ro" and eff.why("/etc/passwd").access == "ro"
    assert eff.why("/etc/shadow").access == "absent"


def test_read_only_why_names_layer(env: dict[str, Path]) -> None:
    (env["proj"] / ".stockade.toml").write_text("\nread_only = true\n")
    d = policy.load(env["proj"], None, CliPolicy()).why(env["proj"] / "a.txt")
    assert d.access == "ro" and d.source == "workspace" and d.rule is not None and d.rule.origin.line == 2


def test_commands_deny(env: dict[str, Path]) -> None:
    (env["proj"] / ".stockade.toml").write_text('[commands]\ndeny = ["git push", ["npm", "publish"]]\n')
    eff = policy.load(env["proj"], None, CliPolicy(commands_deny=("rm -rf /",)))
    assert eff.commands_deny == [["git", "push"], ["npm", "publish"], ["rm", "-rf", "/"]]
    r = eff.check_command(["/usr/bin/git", "push", "--force"])
    assert r is not None and "git push" in r and ".stockade.toml:2" in r
    assert eff.check_command(["git", "pull"]) is None
    assert eff.check_command(["git"]) is None
    assert eff.check_command(["npm", "publish"]) is not None
    assert eff.check_command(["rm", "-rf", "/"]) is not None and "cli" in (eff.check_command(["rm", "-rf", "/"]) or "")
    assert eff.check_command([]) is None


def test_exec_allow_and_etc_extra(env: dict[str, Path]) -> None:
    env["global"].write_text('[exec]\nallow = ["/usr/bin"]\n[etc]\nextra = ["gitconfig", "/etc/ssl"]\n')
    (env["proj"] / ".stockade.toml").write_text('[exec]\nallow = ["/usr", "bin"]\n[etc]\nextra = ["/etc/gitconfig"]\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    assert eff.exec_allow == ["/usr", str(env["proj"] / "bin")]  # later layer replaces
    assert eff.etc_extra == ["/etc/gitconfig", "/etc/ssl"]  # union
    assert policy.load(env["proj"], None, CliPolicy(exec_allow=("/opt",))).exec_allow == ["/opt"]


# ---------------------------------------------------------------- property: layer merging

_TREE = ["/a", "/a/b", "/a/b/c", "/a/d", "/e"]
_entry = st.tuples(st.sampled_from(_TREE), st.sampled_from(["ro", "rw", "deny"]), st.sampled_from(LAYERS[1:]))


def _consistent(entries: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Drop entries a single file could not hold (allow and deny of one path in one layer)."""
    out: list[tuple[str, str, str]] = []
    for p, a, lay in entries:
        if any(q == p and l2 == lay and (b == "deny") != (a == "deny") for q, b, l2 in out):
            continue
        out.append((p, a, lay))
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(_entry, max_size=10), st.sampled_from([*_TREE, "/a/b/c/x", "/z"]))
def test_deny_wins_property(raw: list[tuple[str, str, str]], probe: str) -> None:
    entries = _consistent(raw)
    idx = {n: i for i, n in enumerate(LAYERS)}
    res = resolve_paths(PathEntry(p, a, Origin(lay)) for p, a, lay in entries)

    def lifted(dpath: str, dlayer: str) -> bool:
        return any(p == dpath and a != "deny" and idx[lay] > idx[dlayer] for p, a, lay in entries)

    # oracle: denied iff some deny covering the probe is not lifted by a later exact allow
    denied = any(a == "deny" and is_under(probe, p) and not lifted(p, lay) for p, a, lay in entries)
    assert (res.deny_covering(probe) is not None) == denied
    # an allow in force is never covered by a deny in force
    for path in res.allows:
        assert res.deny_covering(path) is None
    # an allow in force of a path: its access is the latest layer's allow of that path
    for path, top in res.allows.items():
        latest = max(idx[lay] for p, a, lay in entries if p == path and a != "deny")
        assert top.origin.index == latest
    # every deny is in force or recorded as beaten; every allow is in force, beaten, or a
    # lower-layer duplicate (same access) of the allow in force
    res_entries = [PathEntry(p, a, Origin(lay)) for p, a, lay in entries]
    res = resolve_paths(res_entries)
    beaten = {id(x) for x, _ in res.void}
    for e in res_entries:
        if e.access == "deny":
            assert (id(e) in beaten) != any(d is e for d in res.denies)
        else:
            top = res.allows.get(e.path)
            assert top is e or id(e) in beaten or (top is not None and top.access == e.access)


@settings(max_examples=200, deadline=None)
@given(st.lists(_entry, max_size=8))
def test_adding_a_deny_never_makes_anything_visible(raw: list[tuple[str, str, str]]) -> None:
    entries = _consistent(raw)
    before = resolve_paths(PathEntry(p, a, Origin(lay)) for p, a, lay in entries)
    extra = _consistent([*entries, ("/a/b", "deny", "cli")])
    after = resolve_paths(PathEntry(p, a, Origin(lay)) for p, a, lay in extra)
    for probe in [*_TREE, "/a/b/c/x"]:
        if before.deny_covering(probe) is not None:
            assert after.deny_covering(probe) is not None
    assert set(after.allows) <= set(before.allows)


def test_why_describes_the_sandboxes_own_proc_and_dev(env: dict[str, Path]) -> None:
    """`why` said "outside the project and every grant: not visible" for /dev/null."""
    eff = policy.load(env["proj"], None, CliPolicy())
    expect = {
        "/dev/null": "rw", "/dev/pts": "rw", "/dev/sda": "absent", "/dev/shm/x": "absent",
        "/proc/cpuinfo": "ro", "/proc/sys/kernel/hostname": "ro", "/proc/kcore": "masked", "/proc/12345": "absent",
    }
    assert {p: eff.why(p).access for p in expect} == expect
