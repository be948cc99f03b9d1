"""git-compatible diff: quoting, binary literals, and the round trip through real `git apply`."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from stockade.changes.diff import binary_literal, decode_binary_literal, quote_path
from stockade.changes.scan import scan
from tests.unit.test_changes_support import Builder, git, overlay_shell, tree_snapshot

ODD_NAMES = ["with space.txt", "ünïcode.txt", "new\nline", "tab\there", 'quo"te', "back\\slash", "-dash"]


def test_quote_path_matches_git_rules() -> None:
    assert quote_path(b"a/", b"plain.txt") == b"a/plain.txt"
    assert quote_path(b"a/", b"with space") == b"a/with space"
    assert quote_path(b"a/", b"new\nline") == b'"a/new\\nline"'
    assert quote_path(b"a/", "ü".encode()) == b'"a/\\303\\274"'
    assert quote_path(b"", b'q"b\\s') == b'"q\\"b\\\\s"'
    assert quote_path(b"", b"\x01") == b'"\\001"'


def test_binary_literal_round_trip() -> None:
    for data in (b"", b"\x00", os.urandom(1), os.urandom(52), os.urandom(53), os.urandom(5000)):
        block = binary_literal(data)
        lines = block.split(b"\n")
        assert lines[0] == b"literal %d" % len(data)
        assert all(len(ln) <= 66 for ln in lines)
        assert decode_binary_literal(lines[1:]) == data


def _edit_script() -> str:
    lines = [
        "printf 'line1\\nCHANGED\\nline3\\nline4' > t.txt",  # no trailing newline now
        "printf 'gained a newline\\n' > nonl.txt",
        "rm gone.txt",
        "rm -r dir",
        "chmod +x run.sh",
        "chmod -x was_exec.sh",
        "ln -sfn nonl.txt link",
        "rm f2d; mkdir f2d; echo in > f2d/in",
        "rm -r d2f; echo now-file > d2f",
        "rm f2s; ln -s t.txt f2s",
        "printf '\\000\\002binary\\377' > old.bin",
        "head -c 5000 /dev/urandom > new.bin",
        ": > empty",
        "rm emptied; : > emptied",
        "seq 1 200 > long.txt",
        "printf 'ok\\n' > 'with space.txt'",
        "printf 'u\\n' > 'ünïcode.txt'",
        "printf 'nl' > \"$(printf 'new\\nline')\"",
        "printf 't\\n' > \"$(printf 'tab\\there')\"",
        "printf 'q\\n' > 'quo\"te'",
        "printf 'b\\n' > 'back\\slash'",
        "rm 'old name with space'",
        "echo mod >> big.txt",
    ]
    return "; ".join(lines)


def _project(b_files: dict[str, str | bytes]) -> dict[str, str | bytes]:
    return b_files


@pytest.fixture
def rich(tmp_path: Path, state_dir: Path) -> Builder:
    files: dict[str, str | bytes] = {
        "t.txt": "line1\nline2\nline3\n",
        "nonl.txt": "no newline",
        "gone.txt": "x\n",
        "dir/sub/a": "a\n",
        "dir/b": "b\n",
        "run.sh": "echo\n",
        "was_exec.sh": "echo\n",
        "f2d": "f\n",
        "d2f/q": "q\n",
        "f2s": "s\n",
        "old.bin": b"\x00\x01bin",
        "emptied": "had content\n",
        "old name with space": "bye\n",
        "big.txt": "".join(f"line {i}\n" for i in range(1000)),
    }
    b = Builder(tmp_path, files)
    os.umask(0o022)
    for p in b.project.rglob("*"):
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    (b.project / "was_exec.sh").chmod(0o755)
    os.symlink("t.txt", b.project / "link")
    b.new_session()
    overlay_shell(b.session, _edit_script())
    return b


def test_round_trip_with_git_apply(rich: Builder, tmp_path: Path) -> None:
    pristine = tmp_path / "pristine"
    shutil.copytree(rich.project, pristine, symlinks=True)
    cs = scan(rich.session)
    patch = cs.diff_bytes()
    assert patch.startswith(b"diff --git ")
    assert b"GIT binary patch" in patch
    assert b"new file mode 120000" in patch
    assert b"old mode 100644\nnew mode 100755" in patch
    assert b'diff --git "a/new\\nline" "b/new\\nline"' in patch
    assert b"--- /dev/null\t\n+++ b/with space.txt\t\n" in patch
    (tmp_path / "p.patch").write_bytes(patch)
    git("apply", "--check", str(tmp_path / "p.patch"), cwd=pristine)
    git("apply", str(tmp_path / "p.patch"), cwd=pristine)
    res = cs.apply()
    assert res.apply_id
    assert scan(rich.session).changes == ()
    assert tree_snapshot(pristine) == tree_snapshot(rich.project)
    for name in ODD_NAMES[:-1]:
        assert (rich.project / name).exists()


def test_diff_matches_git_diff_for_text(rich: Builder, tmp_path: Path) -> None:
    """Our text hunks and headers are what git itself prints (binary bodies aside)."""
    repo = tmp_path / "repo"
    shutil.copytree(rich.project, repo, symlinks=True)
    git("init", "-q", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "base", cwd=repo)
    cs = scan(rich.session)
    sel = [c.path for c in cs.changes if c.path in ("t.txt", "nonl.txt", "big.txt", "gone.txt", "run.sh", "link")]
    ours = cs.diff_bytes(sel)
    cs.apply(sel)
    for rel in sel:
        src, dst = rich.project / rel, repo / rel
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif src.exists():
            shutil.copy2(src, dst)
    theirs = git("diff", "--full-index", "--", *sel, cwd=repo).stdout
    assert ours == theirs


def test_stat_output(rich: Builder) -> None:
    st = scan(rich.session).stat()
    assert " t.txt " in st and "Bin 0 -> 5000 bytes" in st
    assert st.rstrip().splitlines()[-1].startswith(" ") and "files changed" in st


def test_git_apply_reverse_round_trip(rich: Builder, tmp_path: Path) -> None:
    """The same patch reversed takes the applied tree back to the original."""
    original = tree_snapshot(rich.project)
    cs = scan(rich.session)
    patch = cs.diff_bytes()
    cs.apply()
    (tmp_path / "p.patch").write_bytes(patch)
    r = subprocess.run(["git", "apply", "-R", str(tmp_path / "p.patch")], cwd=rich.project, capture_output=True)
    assert r.returncode == 0, r.stderr
    after = tree_snapshot(rich.project)
    # git does not track directories' modes or empty directories; everything else must match
    assert {k: v for k, v in after.items() if not stat.S_ISDIR(v[0])} == {
        k: v for k, v in original.items() if not stat.S_ISDIR(v[0])
    }


def test_a_side_that_grew_past_the_limit_since_the_scan_is_not_read_whole(tmp_path: Path, state_dir: Path) -> None:
    """The review page reads a file's two sides up to its limit, judged by the size the scan
    saw; a living sandbox can grow the file meanwhile (a sparse 8 GiB in an instant): the
    read stops past the limit and the side counts as too large, never read into memory."""
    from stockade.changes import _safefs
    from stockade.changes.diff import read_sides

    b = Builder(tmp_path, {"big.txt": "small\n"})
    b.new_session()
    b.up("big.txt", "small, changed\n")
    (c,) = scan(b.session).changes
    with open(b.upper / "big.txt", "r+b") as f:
        f.truncate(8 << 30)  # sparse: no disk used
    asked: list[int | None] = []
    read = _safefs.Root.read_bytes

    def spy(self: _safefs.Root, rel: str, limit: int | None = None) -> bytes:
        asked.append(limit)
        return read(self, rel, limit)

    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as m:
        m.setattr(_safefs.Root, "read_bytes", spy)
        old, new = read_sides(scan(b.session), c, 1 << 20)
    assert old == b"small\n" and new is None
    assert asked and all(a is not None and a <= (1 << 20) + 1 for a in asked), asked
