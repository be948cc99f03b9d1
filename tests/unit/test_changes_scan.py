"""Scanner and model on hand-built and real-overlay upper layers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stockade.changes.model import Kind
from stockade.changes.scan import scan
from stockade.cli.changes import summary_line
from stockade.errors import UsageError
from tests.unit.test_changes_support import Builder, builder, overlay_shell

__all__ = ["builder"]


def kinds(b: Builder) -> dict[str, str]:
    return {c.path: c.letter for c in scan(b.session).changes}


def test_empty_session_has_no_changes(builder: Builder) -> None:
    assert scan(builder.session).changes == ()
    assert summary_line(builder.session) is None


def test_added_modified_deleted(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"keep": "k\n", "mod": "old\n", "gone": "g\n"})
    b.up("new", "n\n")
    b.up("mod", "new\n")
    b.whiteout("gone")
    cs = scan(b.session)
    assert kinds(b) == {"new": "A", "mod": "M", "gone": "D"}
    c = cs.get("new")
    assert c is not None and c.kind is Kind.ADDED and c.size == 2 and not c.binary
    assert c.old_mode is None and stat.S_ISREG(c.new_mode or 0)
    line = summary_line(b.session)
    assert line == (
        f"stockade: session {b.session.id} — 1 added, 1 modified, 1 deleted; "
        f"review: stockade diff {b.session.id}"
    )


def test_copy_up_without_change_and_mtime_only_are_not_changes(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "same\n", "d/b": "x" * 10000})
    b.copy_up("a")
    b.copy_up("d/b")
    os.utime(b.upper / "a", (1, 1))
    assert scan(b.session).changes == ()
    assert summary_line(b.session) is None


def test_same_size_different_content_is_modified(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "x" * 100000 + "A"})
    b.up("a", "x" * 100000 + "B")
    assert kinds(b) == {"a": "M"}


def test_mode_change_is_a_change(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"run.sh": "echo\n"})
    (b.project / "run.sh").chmod(0o644)
    b.copy_up("run.sh").chmod(0o755)
    (c,) = scan(b.session).changes
    assert c.kind is Kind.MODIFIED and stat.S_IMODE(c.old_mode or 0) == 0o644
    assert stat.S_IMODE(c.new_mode or 0) == 0o755


def test_whiteout_of_directory_deletes_its_tree(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"d/a": "1", "d/s/b": "2", "other": "o"})
    b.whiteout("d")
    assert kinds(b) == {"d": "D", "d/a": "D", "d/s": "D", "d/s/b": "D"}
    assert scan(b.session).counts().deleted == 2  # directories are not counted when files are


@pytest.mark.parametrize("ns", ["user", "trusted"])
def test_opaque_dir_deletes_lower_contents(tmp_path: Path, state_dir: Path, ns: str) -> None:
    if ns == "trusted" and os.geteuid() != 0:
        pytest.skip("trusted.* xattrs need CAP_SYS_ADMIN")
    b = Builder(tmp_path, {"d/a": "1", "d/b": "2", "d/s/c": "3"})
    b.opaque_dir("d", ns=ns)
    b.up("d/a", "1")  # same content re-created: not a change
    b.up("d/n", "new")
    assert kinds(b) == {"d/b": "D", "d/n": "A", "d/s": "D", "d/s/c": "D"}


def test_symlinks_are_captured_as_symlinks(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"t": "t"})
    os.symlink("t", b.project / "l")
    b.symlink("l", "elsewhere")
    b.symlink("new", "/etc/passwd")
    cs = scan(b.session)
    assert kinds(b) == {"l": "M", "new": "A"}
    new = cs.get("new")
    assert new is not None and stat.S_ISLNK(new.new_mode or 0) and new.size == len("/etc/passwd")
    # re-pointing a symlink at the same target is not a change
    os.unlink(b.upper / "l")
    b.symlink("l", "t")
    assert kinds(b) == {"new": "A"}


def test_type_changes(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"f2d": "f", "d2f/x": "x", "f2s": "s"})
    b.opaque_dir("f2d")
    b.up("f2d/in", "in")
    b.up("d2f", "now a file")
    b.symlink("f2s", "target")
    cs = scan(b.session)
    assert kinds(b) == {"f2d": "T", "f2d/in": "A", "d2f": "T", "d2f/x": "D", "f2s": "T"}
    d2f = cs.get("d2f")
    assert d2f is not None and d2f.old_type == "dir" and d2f.new_type == "file"


def test_fifos_sockets_devices_are_refused(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path)
    os.mkfifo(b.upper / "fifo")
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(b.upper / "sock"))
    s.close()
    if os.geteuid() == 0:
        os.mknod(b.upper / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    cs = scan(b.session)
    refused = {c.path for c in cs.changes if c.kind is Kind.REFUSED}
    assert {"fifo", "sock"} <= refused
    assert all(c.reason for c in cs.changes)
    assert cs.counts().refused == len(refused)
    assert cs.diff() == ""


def test_redirect_and_metacopy_are_refused(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"d/a": "1"})
    d = b.upper / "moved"
    d.mkdir()
    os.setxattr(d, "user.overlay.redirect", b"/d")
    with pytest.raises(UsageError, match="redirect"):
        scan(b.session)
    os.rmdir(d)
    f = b.up("d/a", "")
    os.setxattr(f, "user.overlay.metacopy", b"")
    with pytest.raises(UsageError, match="metacopy"):
        scan(b.session)


def test_frozen_layers_merge_topmost_wins(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "a0", "b": "b0", "d/x": "x0"})
    l1 = b.session.layers_dir / "001-one"
    l1.mkdir(parents=True)  # layers/ is made with the first snapshot
    b.up("a", "a1", layer=l1)
    b.up("only1", "o", layer=l1)
    b.whiteout("b", layer=l1)
    b.up("d/y", "y1", layer=l1)
    # upper: a back to the original, b re-created, d made opaque
    b.up("a", "a0")
    b.up("b", "b2")
    b.opaque_dir("d")
    b.up("d/z", "z2")
    cs = scan(b.session)
    assert {c.path: c.letter for c in cs.changes} == {"b": "M", "only1": "A", "d/x": "D", "d/z": "A"}
    only1 = cs.get("only1")
    assert only1 is not None and only1.layer == 0


def test_lower_layer_whiteout_under_upper_dir_hides_project(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"d/x": "x"})
    l1 = b.session.layers_dir / "001-one"
    l1.mkdir(parents=True)
    b.whiteout("d", layer=l1)
    (b.upper / "d").mkdir()  # a plain dir above the whiteout: overlay hides the project's d/x
    b.up("d/new", "n")
    assert kinds(b) == {"d/x": "D", "d/new": "A"}


def test_project_symlinked_dir_is_not_followed(tmp_path: Path, state_dir: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("TOP SECRET\n")
    b = Builder(tmp_path)
    os.symlink(str(outside), b.project / "lib")
    b.up("lib/secret", "mine\n")  # hand-built: a dir in upper where the project has a symlink
    cs = scan(b.session)
    assert {c.path: c.letter for c in cs.changes} == {"lib": "T", "lib/secret": "A"}
    assert "TOP SECRET" not in cs.diff()


def test_masked_secret_paths_are_refused_and_never_diffed(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {".env": "PASSWORD=hunter2\n"})
    mask = b.session.dir / "masks" / "abc"
    mask.mkdir(parents=True)
    os.mknod(mask / ".env", stat.S_IFCHR, 0)
    b.up(".env", "FAKE=1\n")
    cs = scan(b.session)
    (c,) = cs.changes
    assert c.kind is Kind.REFUSED and "masked" in c.reason
    assert "hunter2" not in cs.diff()


def test_binary_detection(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path)
    b.up("bin", b"\x00\x01\x02")
    b.up("txt", "plain\n")
    cs = scan(b.session)
    assert [c.binary for c in cs.changes] == [True, False]


def test_scan_cost_does_not_touch_untouched_project_paths(tmp_path: Path, state_dir: Path) -> None:
    """The scanner must never list project directories the session did not touch."""
    b = Builder(tmp_path, {"a": "a"})
    big = b.project / "big"
    big.mkdir()
    big.chmod(0)  # any listing or lookup inside would fail for a non-root user; for root we
    # check by making it unreadable and verifying nothing under it is reported
    b.up("n", "n")
    try:
        assert kinds(b) == {"n": "A"}
    finally:
        big.chmod(0o755)


def test_real_overlay_matches_scan(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n", "b": "b\n", "c": "c\n", "d/x": "x\n", "d/y": "y\n", "e/z": "z\n"})
    overlay_shell(
        b.session,
        "cat a > /dev/null; touch b; echo more >> c; rm -r d; mkdir d; echo x > d/x; "
        "rm e/z; echo n > new; chmod 600 a; ln -s a sym; mkdir -p p/q && echo deep > p/q/r",
    )
    assert kinds(b) == {
        "a": "M", "c": "M", "d/y": "D", "e/z": "D", "new": "A", "sym": "A",
        "p": "A", "p/q": "A", "p/q/r": "A",
    }
    assert scan(b.session).counts().phrase() == "3 added, 2 modified, 2 deleted"  # dirs with files: not counted
