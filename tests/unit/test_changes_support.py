"""Helpers for the change-set tests: synthetic sessions, hand-built layers, real overlays.

(Also a few self-checks of the helpers, so pytest collecting this file is useful.)
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.session import store
from stockade.session.store import Session
from tests.conftest import MUST_WORK, need, tree_snapshot

__all__ = [
    "MUST_WORK",
    "Builder",
    "git",
    "need",
    "overlay_available",
    "overlay_shell",
    "tree_snapshot",
]


class Builder:
    """A project plus a session whose layers the test fills by hand."""

    def __init__(self, base: Path, files: dict[str, bytes | str] | None = None) -> None:
        self.base = base
        self.project = base / "proj"
        self.project.mkdir(parents=True)
        for rel, data in (files or {}).items():
            self.put(self.project, rel, data)
        self.session: Session = store.create(self.project.resolve())

    def new_session(self) -> Session:
        """A fresh session (after the test changed the project itself)."""
        self.session = store.create(self.project.resolve())
        return self.session

    # generic writers
    @staticmethod
    def put(root: Path, rel: str, data: bytes | str, mode: int | None = None) -> Path:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            data = data.encode()
        p.write_bytes(data)
        if mode is not None:
            p.chmod(mode)
        return p

    @property
    def upper(self) -> Path:
        return self.session.upper

    def up(self, rel: str, data: bytes | str, mode: int | None = None, layer: Path | None = None) -> Path:
        root = layer or self.upper
        self._parents(root, rel)
        return self.put(root, rel, data, mode)

    def _parents(self, root: Path, rel: str) -> None:
        """Create the layer's parent dirs with the project's modes (what copy-up does)."""
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            d = root / sub
            if not d.exists():
                d.mkdir()
                src = self.project / sub
                if src.is_dir() and not src.is_symlink():
                    d.chmod(stat.S_IMODE(src.stat().st_mode))

    def whiteout(self, rel: str, layer: Path | None = None) -> None:
        root = layer or self.upper
        self._parents(root, rel)
        os.mknod(root / rel, stat.S_IFCHR | 0o000, 0)

    def opaque_dir(self, rel: str, layer: Path | None = None, ns: str = "user") -> Path:
        root = layer or self.upper
        self._parents(root, rel)
        d = root / rel
        d.mkdir(exist_ok=True)
        os.setxattr(d, f"{ns}.overlay.opaque", b"y")
        return d

    def symlink(self, rel: str, target: str, layer: Path | None = None) -> None:
        root = layer or self.upper
        self._parents(root, rel)
        os.symlink(target, root / rel)

    def copy_up(self, rel: str) -> Path:
        """An unchanged copy-up: same bytes, same mode, new mtime."""
        src = self.project / rel
        self._parents(self.upper, rel)
        dst = self.upper / rel
        shutil.copy2(src, dst)
        os.utime(dst)
        return dst


def git(*args: str, cwd: Path, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {
        **os.environ,
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": str(cwd),
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    r = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, input=input)
    if check and r.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {r.stderr.decode(errors='replace')}")
    return r


_OVERLAY: dict[bool, bool] = {}


def overlay_available(userns: bool) -> bool:
    if userns not in _OVERLAY:
        ok = False
        if shutil.which("unshare"):
            import tempfile

            with tempfile.TemporaryDirectory() as t:
                for d in ("lo", "up", "wk", "mnt"):
                    os.mkdir(os.path.join(t, d))
                opts = f"lowerdir={t}/lo,upperdir={t}/up,workdir={t}/wk" + (",userxattr" if userns else "")
                cmd = ["unshare", "-Urm" if userns else "-m", "mount", "-t", "overlay", "overlay", "-o", opts, f"{t}/mnt"]
                ok = subprocess.run(cmd, capture_output=True).returncode == 0
        _OVERLAY[userns] = ok
    return _OVERLAY[userns]


def overlay_shell(session: Session, script: str, *, userns: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run ``script`` (sh) in the session's real overlay, mounted at the project's path.

    ``userns=True`` mirrors the unprivileged sandbox (user namespace, ``userxattr``);
    ``userns=False`` mirrors real root (``trusted.*`` xattrs).
    """
    need(overlay_available(userns), "overlayfs mounts are not available here")
    layers = [str(p) for p in reversed(session.layers())]
    lower = ":".join([*layers, str(session.project)])
    opts = f"lowerdir={lower},upperdir={session.upper},workdir={session.work}"
    if userns:
        opts += ",userxattr"
    inner = f'mount -t overlay overlay -o "{opts}" "{session.project}" && cd "{session.project}" && {script}'
    r = subprocess.run(["unshare", "-Urm" if userns else "-m", "sh", "-ec", inner], capture_output=True)
    if r.returncode != 0:
        raise AssertionError(f"overlay script failed: {r.stderr.decode(errors='replace')}")
    return r


@pytest.fixture
def builder(tmp_path: Path, state_dir: Path) -> Iterator[Builder]:
    yield Builder(tmp_path)


# ---- self-checks of the helpers ---------------------------------------------------------


def test_builder_whiteout_is_char_0_0(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "x"})
    b.whiteout("a")
    st = os.lstat(b.upper / "a")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def test_overlay_shell_writes_land_in_upper(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "x\n", "d/k": "k\n"})
    overlay_shell(b.session, "echo new > n && rm a && rm -r d && mkdir d && echo z > d/z")
    assert (b.upper / "n").read_text() == "new\n"
    assert stat.S_ISCHR(os.lstat(b.upper / "a").st_mode)
    assert os.getxattr(b.upper / "d", "user.overlay.opaque") == b"y"
    # the project itself is untouched
    assert tree_snapshot(b.project).keys() == {"a", "d", "d/k"}
