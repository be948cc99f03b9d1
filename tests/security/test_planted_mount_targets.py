"""Mount targets can't be steered to the host by symlinks an earlier run planted.

Secret masks in the project are overlay content (no mount point inside the project),
and masks inside grants are mounted only after the host's tree is detached.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.conftest import User, world_tmpdir


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_symlink_planted_in_upper_cannot_aim_a_mask_at_the_host(user: User, project: Path) -> None:
    victim = world_tmpdir("stockade-victim-")
    os.chmod(victim, 0o777)
    (project / "config" / "sub").mkdir(parents=True)
    (project / "config" / "sub" / ".env").write_text("TOKEN=real\n")
    user.own(project / "config")
    try:
        for mode in ("empty", "absent"):
            plant = f"rm -rf config; ln -s /oldroot{victim} config; ln -s {victim} config2"
            r = user.cli(["run", "-s", f"p-{mode}", "--", "sh", "-c", plant], cwd=project)
            assert r.returncode == 0, r.stderr.decode()
            r = user.cli(["run", "-s", f"p-{mode}", "--mask-mode", mode, "--", "sh", "-c", "ls -la config/ config2/ 2>&1; true"], cwd=project)
            assert r.returncode == 0, r.stderr.decode()
            assert _listing(victim) == [], f"mode {mode}: the host dir gained {_listing(victim)}"
        assert (project / "config/sub/.env").read_text() == "TOKEN=real\n"
    finally:
        shutil.rmtree(victim, ignore_errors=True)


def test_masked_secret_reads_empty_or_absent(user: User, project: Path) -> None:
    (project / "deploy").mkdir()
    (project / "deploy" / ".env").write_text("TOKEN=real\n")
    (project / ".ssh").mkdir()
    (project / ".ssh" / "id_rsa").write_text("KEY\n")
    user.own(project)
    r = user.cli(["run", "--mask-mode", "empty", "--", "sh", "-c", "wc -c < deploy/.env; ls -A .ssh | wc -l; ls -ld deploy | cut -c1-10"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    size, entries, mode = r.stdout.decode().split()
    assert (size, entries) == ("0", "0")
    assert mode == "drwxr-xr-x"  # the mask layer mirrors the project's directories
    r = user.cli(["run", "--mask-mode", "absent", "--", "sh", "-c", "test -e deploy/.env || echo ABSENT; test -e .ssh || echo NODIR"], cwd=project)
    assert r.stdout.decode().split() == ["ABSENT", "NODIR"]
    r = user.cli(["run", "--read-only", "--mask-mode", "empty", "--", "sh", "-c", "cat deploy/.env; echo x > new 2>&1 || echo EROFS"], cwd=project)
    assert b"TOKEN" not in r.stdout and b"EROFS" in r.stdout
    assert (project / "deploy/.env").read_text() == "TOKEN=real\n"
