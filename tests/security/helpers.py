"""Shared pieces of the security suite: canaries, compiled C helpers, attack runners."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import MUST_WORK, User, world_tmpdir

SIGSYS = 31


@dataclass
class Canary:
    """A host file outside the project that the sandbox must neither read nor change."""

    dir: Path
    path: Path
    secret: str
    digest: str

    @classmethod
    def make(cls) -> Canary:
        d = world_tmpdir("stockade-canary-")
        p = d / "canary.txt"
        secret = f"STOCKADE-CANARY-{secrets.token_hex(12)}"
        p.write_text(secret + "\n")
        p.chmod(0o644)  # readable by uid 65534 on the host: only the sandbox may stop it
        return cls(d, p, secret, hashlib.sha256(p.read_bytes()).hexdigest())

    def intact(self) -> bool:
        return (
            self.path.is_file()
            and hashlib.sha256(self.path.read_bytes()).hexdigest() == self.digest
            and sorted(os.listdir(self.dir)) == ["canary.txt"]
        )

    def leaked(self, *outputs: bytes | str) -> bool:
        for out in outputs:
            text = out.decode(errors="replace") if isinstance(out, bytes) else out
            if self.secret in text:
                return True
        return False


def compile_c(src: str, dest: Path, *flags: str) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        if MUST_WORK:
            pytest.fail("gcc missing (STOCKADE_MUST_WORK=1)")
        pytest.skip("gcc missing")
    assert gcc is not None
    c = dest.with_suffix(".c")
    c.write_text(src)
    subprocess.run([gcc, "-O1", *flags, "-o", str(dest), str(c)], check=True, capture_output=True)
    c.unlink()
    return dest


def sandbox(
    user: User,
    project: Path,
    argv: list[str],
    *extra: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """`stockade run [extra] -- argv` in the project, as the user under test."""
    return user.cli(["run", *extra, "--", *argv], cwd=project, timeout=timeout, env=env)


def sandbox_py(
    user: User, project: Path, code: str, *extra: str, timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    return sandbox(user, project, ["/usr/bin/python3", "-I", "-c", code], *extra, timeout=timeout)


# Python prelude for attacks that need raw syscalls (ctypes, no third-party code).
SYSCALL_PRELUDE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *a):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(x & 0xFFFFFFFFFFFFFFFF) for x in a])
    return 0 if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
"""
