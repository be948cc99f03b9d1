"""What apply holds back unless named (policy files, symlinks leading out), and that
every review output says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stockade
from stockade.changes.held import POLICY_WHY as POLICY
from stockade.changes.held import WORKSPACE_POLICY_FILES
from stockade.changes.scan import scan
from stockade.errors import UsageError
from tests.unit.test_changes_support import Builder, tree_snapshot

WIDEN = '[[paths]]\npath = "/root"\naccess = "rw"\n'
PYPROJECT = '[project]\nname = "demo"\nversion = "1"\n\n[tool.stockade]\nread_only = false\n'


# ---- the loader's files: the list cannot drift ------------------------------------------------


def _opened_by_loader(project: Path) -> set[str]:
    """Project files the workspace tier of the policy loader opens (traced, not assumed)."""
    from stockade import policy

    seen: list[str] = []
    active = [True]

    def hook(event: str, args: tuple[object, ...]) -> None:
        if active[0] and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
            seen.append(os.fsdecode(args[0]))  # type: ignore[arg-type]

    sys.addaudithook(hook)  # audit hooks cannot be removed: this one goes quiet after the call
    try:
        policy.read_layers(project, None, policy.CliPolicy())
    finally:
        active[0] = False
    pre = str(project) + "/"
    return {p[len(pre):] for p in seen if p.startswith(pre)}


def test_every_workspace_file_the_loader_reads_is_held_back(tmp_path: Path, state_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    empty = tmp_path / "empty"
    empty.mkdir()
    both = tmp_path / "both"
    both.mkdir()
    (both / ".stockade.toml").write_text("read_only = false\n")
    (both / "pyproject.toml").write_text(PYPROJECT)
    only_py = tmp_path / "only_py"
    only_py.mkdir()
    (only_py / "pyproject.toml").write_text(PYPROJECT)
    read: set[str] = set()
    for p in (empty, both, only_py):
        read |= _opened_by_loader(p)
    assert read, "the trace saw no workspace file: the test would prove nothing"
    assert read <= set(WORKSPACE_POLICY_FILES), f"the loader reads {read - set(WORKSPACE_POLICY_FILES)} " \
        "as workspace policy; add it to stockade.changes.held.WORKSPACE_POLICY_FILES"
    # and each one really is held back when a sandbox writes it
    for name in read:
        b = Builder(tmp_path / f"h-{name}", {"keep": "k\n"})
        b.up(name, WIDEN if name != "pyproject.toml" else PYPROJECT.replace("false", "true"))
        b.up("keep", "changed\n")
        res = scan(b.session).apply()
        assert res.held_back == (name,) and "policy" in res.why_held[name]
        assert not (b.project / name).exists()


# ---- policy files --------------------------------------------------------------------------------


def test_stockade_toml_written_deleted_or_nested_is_held_back(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"sub/.stockade.toml": "read_only = true\n", "a": "a\n"})
    b.up(".stockade.toml", WIDEN)
    b.whiteout("sub/.stockade.toml")  # deleting a policy can widen the next run too
    b.up("a", "b\n")
    before = tree_snapshot(b.project)
    res = scan(b.session).apply(dry_run=True)
    assert set(res.held_back) == {".stockade.toml", "sub/.stockade.toml"}
    assert all("stockade policy file" in w for w in res.why_held.values())
    assert tree_snapshot(b.project) == before
    res = scan(b.session).apply()
    assert res.applied == ("a",)
    assert not (b.project / ".stockade.toml").exists() and (b.project / "sub/.stockade.toml").exists()
    with pytest.raises(UsageError, match=r"2 held back: \.stockade\.toml, sub/\.stockade\.toml \(stockade policy file"):
        scan(b.session).apply()
    scan(b.session).apply([".stockade.toml"])  # named: applied
    assert (b.project / ".stockade.toml").read_text() == WIDEN


def test_pyproject_is_held_back_only_when_its_stockade_table_changes(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"pyproject.toml": PYPROJECT, "lib/pyproject.toml": '[project]\nname = "lib"\n',
                           "gone/pyproject.toml": "[tool.stockade]\nread_only = true\n",
                           "plain/pyproject.toml": '[project]\nname = "p"\n'})
    # an ordinary edit, and a reformatting of the same table: not policy changes
    b.up("pyproject.toml", PYPROJECT.replace('version = "1"', 'version = "2"').replace(
        "read_only = false", "read_only   =   false  # same"))
    b.up("lib/pyproject.toml", '[project]\nname = "lib"\n\n[tool.stockade]\n[[tool.stockade.paths]]\n'
         'path = "/root"\naccess = "rw"\n')  # a table appears
    b.whiteout("gone/pyproject.toml")  # a table disappears with its file
    b.whiteout("plain/pyproject.toml")  # no table on either side
    b.up("new/pyproject.toml", '[project]\nname = "n"\n')  # a new file without a table
    b.up("bad/pyproject.toml", "[tool.stockade\n")  # cannot be read: held back
    held = scan(b.session).held_back()
    assert set(held) == {"lib/pyproject.toml", "gone/pyproject.toml", "bad/pyproject.toml"}
    assert "[tool.stockade] table changed" in held["lib/pyproject.toml"]
    res = scan(b.session).apply()
    assert "pyproject.toml" in res.applied and "new/pyproject.toml" in res.applied
    assert "plain/pyproject.toml" in res.applied
    assert 'version = "2"' in (b.project / "pyproject.toml").read_text()
    assert "tool.stockade" not in (b.project / "lib/pyproject.toml").read_text()
    assert (b.project / "gone/pyproject.toml").exists()


def test_global_config_inside_a_home_project_is_held_back(tmp_path: Path, state_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    b = Builder(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(b.project / ".config"))
    b.up(".config/stockade/config.toml", WIDEN)
    held = scan(b.session).held_back()
    assert "global config" in held[".config/stockade/config.toml"]


# ---- symlinks ------------------------------------------------------------------------------------


def test_symlinks_resolving_outside_are_held_back(tmp_path: Path, state_dir: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    b = Builder(tmp_path, {"src/x.py": "x\n", "d/f": "f\n"})
    os.symlink(str(outside), b.project / "hostout")  # the host's own link leading out
    proj = str(b.project.resolve())
    out_links = {
        "esc": "/tmp/x",
        "rel": "../../etc/passwd",
        "sub/deep": "../../../outside",
        "dirlink": str(outside),
        "chain1": "chain2",  # inside by itself, but chain2 leads out
        "chain2": "/etc",
        "viahost": "hostout/../x",  # .. of the host's symlink's target, not lexical
        "loop1": "loop2",
        "loop2": "loop1",
        "absproj_up": proj + "/../outside",
    }
    in_links = {
        "lnk": "src/x.py",
        "d/up": "../src/x.py",
        "abs_in": proj + "/src/x.py",
        "dangling": "nope/not/here",
        "dirin": "d",
        "dot": ".",
    }
    for rel, target in {**out_links, **in_links}.items():
        b.symlink(rel, target)
    held = scan(b.session).held_back()
    assert set(held) == set(out_links), held
    for rel in out_links:
        assert held[rel] == f"symlink that resolves outside the project (-> {out_links[rel]})"
    res = scan(b.session).apply()
    assert set(in_links) <= set(res.applied)
    assert not any((b.project / p).is_symlink() for p in out_links if "/" not in p)
    assert os.readlink(b.project / "lnk") == "src/x.py"
    res = scan(b.session).apply(["esc", "rel"])  # named: applied, as symlinks
    assert os.readlink(b.project / "esc") == "/tmp/x" and os.readlink(b.project / "rel") == "../../etc/passwd"


def test_symlink_through_a_new_link_in_the_change_set(tmp_path: Path, state_dir: Path) -> None:
    """A link that looks inside but passes through another new link that leads out."""
    b = Builder(tmp_path, {"d/x": "x\n"})
    b.symlink("hop", "/usr")
    b.symlink("a", "hop/bin")
    b.symlink("d/ok", "x")
    held = scan(b.session).held_back()
    assert set(held) == {"hop", "a"}


def test_held_back_is_decided_again_under_the_lock(tmp_path: Path, state_dir: Path) -> None:
    """A run between the review's scan and the apply re-points a link: the apply sees it."""
    b = Builder(tmp_path)
    b.symlink("l", "inside")
    b.up("other", "o\n")
    cs = scan(b.session)
    assert cs.held_back() == {}
    os.unlink(b.upper / "l")
    os.symlink("/etc", b.upper / "l")
    res = cs.apply()
    assert res.applied == ("other",) and "resolves outside" in res.why_held["l"]
    assert not (b.project / "l").is_symlink()


def test_never_held_keeps_held_back_paths_even_named(tmp_path: Path, state_dir: Path) -> None:
    """``never_held`` (the MCP apply tool's, for an untrusted caller): naming a held-back path,
    or passing it in ``only``, never applies it, and ``include_git`` is refused."""
    from stockade.changes.apply import apply_changes

    b = Builder(tmp_path, {"a": "a\n"})
    b.up(".stockade.toml", WIDEN)
    b.up(".envrc", "export X=1\n")
    b.up("a", "b\n")
    cs = scan(b.session)
    with pytest.raises(UsageError, match="include_git cannot be combined with never_held"):
        apply_changes(cs, include_git=True, never_held=True)
    with pytest.raises(UsageError, match=r"2 held back: .*a person applies these after review: "
                                         rf"`stockade apply -s {b.session.id} PATH\.\.\.` or `stockade review"):
        cs.apply([".stockade.toml", ".envrc"], never_held=True)
    with pytest.raises(UsageError, match="held back"):
        apply_changes(cs, only=[c for c in cs.changes if c.path == ".envrc"], never_held=True)
    res = cs.apply([".stockade.toml", ".envrc", "a"], never_held=True)
    assert res.applied == ("a",) and set(res.held_back) == {".stockade.toml", ".envrc"}
    assert not (b.project / ".stockade.toml").exists() and not (b.project / ".envrc").exists()
    assert (b.project / "a").read_text() == "b\n"


def test_never_held_is_decided_again_under_the_lock(tmp_path: Path, state_dir: Path) -> None:
    """A link that was harmless at the scan is re-pointed out of the project before the
    apply: named with ``never_held``, it is held back on what would be written."""
    b = Builder(tmp_path)
    b.symlink("l", "inside")
    b.up("other", "o\n")
    cs = scan(b.session)
    assert cs.held_back() == {}
    os.unlink(b.upper / "l")
    os.symlink("/etc", b.upper / "l")
    res = cs.apply(["l", "other"], never_held=True)
    assert res.applied == ("other",) and "resolves outside" in res.why_held["l"]
    assert not (b.project / "l").is_symlink()


# ---- review output says why ---------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(stockade.__file__).parents[1]), "STOCKADE_SERVER": "0"}
    return subprocess.run([sys.executable, "-m", "stockade", *args], env=env, capture_output=True, timeout=120)


def test_review_output_names_each_held_back_path_and_why(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n"})
    b.up(".stockade.toml", WIDEN)
    b.symlink("esc", "/tmp/x")
    b.up(".git/hooks/pre-commit", "#!/bin/sh\n")
    b.up("a", "b\n")
    sid = b.session.id
    why = {".stockade.toml": "stockade policy file", "esc": "symlink that resolves outside the project (-> /tmp/x)",
           ".git/hooks/pre-commit": "git repository: its hooks and config run"}

    st = _cli("status", sid)
    assert st.returncode == 0, st.stderr
    lines = st.stdout.decode().splitlines()
    for p, w in why.items():
        assert any(ln.split()[1:2] == [p] and f"(held back: {w}" in ln for ln in lines), (p, lines)
    stj = json.loads(_cli("status", sid, "--json").stdout)
    held = {c["path"]: c.get("held_back") for c in stj["changes"]}
    assert held["a"] is None and all(w in (held[p] or "") for p, w in why.items())

    for verb in (["diff", sid], ["diff", sid, "--stat"], ["apply", sid, "--dry-run"], ["apply", sid]):
        r = _cli(*verb)
        assert r.returncode == 0, (verb, r.stderr)
        err = r.stderr.decode()
        for p, w in why.items():
            assert f"\n  {p}: {w}" in err, (verb, err)
        assert any(w in err for w in ("held back", "holds back", "would hold back"))
    assert (b.project / "a").read_text() == "b\n"
    assert not (b.project / ".stockade.toml").exists() and not (b.project / "esc").is_symlink()
    r = _cli("apply", sid)
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1, r.stderr
    assert "stockade policy file" in r.stderr.decode()


def test_pyproject_too_big_to_read_is_held_back(tmp_path: Path, state_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade.changes import held

    monkeypatch.setattr(held, "_MAX_POLICY_BYTES", 64)
    b = Builder(tmp_path, {"pyproject.toml": PYPROJECT})
    b.up("pyproject.toml", PYPROJECT + "# " + "x" * 100 + "\n")  # same table, past the read limit
    assert "table changed" in scan(b.session).held_back()["pyproject.toml"]
    monkeypatch.setattr(held, "_MAX_POLICY_BYTES", 16 << 20)
    assert scan(b.session).held_back() == {}


def test_pyproject_nested_past_the_parsers_stack_is_held_back(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"pyproject.toml": PYPROJECT, "a": "a\n"})
    b.up("pyproject.toml", PYPROJECT + "x = " + "[" * 200000 + "\n")  # tomllib: RecursionError, not a crash
    b.up("a", "b\n")
    assert "table changed" in scan(b.session).held_back()["pyproject.toml"]
    res = scan(b.session).apply()
    assert res.held_back == ("pyproject.toml",) and (b.project / "pyproject.toml").read_text() == PYPROJECT


def test_held_back_entry_in_a_new_directory_stays_when_the_directory_applies(tmp_path: Path,
                                                                              state_dir: Path) -> None:
    """A new directory normally leaves the session in one rename: never with a held-back entry in it."""
    b = Builder(tmp_path)
    b.up("sub/ok.txt", "ok\n")
    b.up("sub/.stockade.toml", WIDEN)
    b.up("sub/deeper/.git/hooks/post-checkout", "#!/bin/sh\n")
    b.symlink("sub/out", "/etc")
    res = scan(b.session).apply()
    assert "sub/ok.txt" in res.applied and (b.project / "sub/ok.txt").read_text() == "ok\n"
    assert {"sub/.stockade.toml", "sub/out"} <= set(res.held_back)
    assert not (b.project / "sub/.stockade.toml").exists() and not os.path.lexists(b.project / "sub/out")
    assert not (b.project / "sub/deeper").exists()
    assert {c.path for c in scan(b.session).changes} >= {"sub/.stockade.toml", "sub/out"}


def test_files_the_loader_reads_through_a_symlinked_policy_file_are_held_back(tmp_path: Path,
                                                                              state_dir: Path) -> None:
    b = Builder(tmp_path, {"config/project.toml": PYPROJECT, "policy/stockade.toml": "read_only = true\n",
                           "sub/cfg/p.toml": "[tool.stockade]\nread_only = true\n"})
    os.symlink("config/project.toml", b.project / "pyproject.toml")
    os.symlink("policy/stockade.toml", b.project / ".stockade.toml")
    os.symlink("cfg/p.toml", b.project / "sub/pyproject.toml")  # a nested project's
    b.new_session()
    b.up("config/project.toml", PYPROJECT.replace("false", "true"))
    b.up("policy/stockade.toml", WIDEN)
    b.up("sub/cfg/p.toml", "[tool.stockade]\nread_only = true\n[project]\nname = 'same table'\n")
    b.up("new.toml", WIDEN)  # the sandbox's own link to its own file
    b.symlink("n/.stockade.toml", "../new.toml")
    held = scan(b.session).held_back()
    assert held["config/project.toml"].endswith("(read through the symlink pyproject.toml)")
    assert "table changed" in held["config/project.toml"]
    assert held["policy/stockade.toml"] == POLICY + " (read through the symlink .stockade.toml)"
    assert held["new.toml"] == POLICY + " (read through the symlink n/.stockade.toml)"
    assert "n/.stockade.toml" in held and "sub/cfg/p.toml" not in held  # same table: an ordinary edit


def test_many_links_inside_are_all_applied(tmp_path: Path, state_dir: Path) -> None:
    """The walk's bound is per link: a node_modules/.bin of links is not held back wholesale."""
    b = Builder(tmp_path, {"lib/x.js": "x\n"})
    for i in range(3000):
        b.symlink(f"bin/t{i}", f"../lib/{'./' * 3}x.js")
    assert scan(b.session).held_back() == {}
