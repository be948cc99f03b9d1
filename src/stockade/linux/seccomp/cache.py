"""``compile_profile``: a profile compiled once, kept in memory (by file identity and by
content) and on disk under the state dir (keyed by content, compiler and libseccomp)."""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

from ...errors import PolicyError
from .bpf import BPF_MAXINSNS, INSN
from .compile import compile_bpf
from .parse import parse_profile
from .profiles import profile_path

# Bump when the compiler's output for the same profile changes (cache key).
_COMPILER_VERSION = b"stockade-seccomp-1"


@dataclass(frozen=True)
class CompiledFilter:
    """A compiled profile: ``bpf`` is the raw array of ``struct sock_filter``."""

    name: str
    digest: str  # sha256 of ``bpf`` (hex): what the audit log records
    bpf: bytes

    @property
    def instructions(self) -> int:
        return len(self.bpf) // INSN.size


def cache_dir() -> Path:
    from ...paths import state_dir

    return Path(state_dir()) / "cache" / "seccomp"


_mem_lock = threading.Lock()
_mem_by_stat: dict[tuple[str, int, int, int, int], CompiledFilter] = {}
_mem_by_key: dict[str, bytes] = {}


def _libseccomp_identity() -> bytes:
    """Which libseccomp would compile, without loading it: loading (cffi's cdef parse and
    dlopen) costs tens of milliseconds, too much for the cached launch path. The shared
    object's identity changes when the library is upgraded."""
    machine = platform.machine()
    for d in (f"/usr/lib/{machine}-linux-gnu", f"/lib/{machine}-linux-gnu", "/usr/lib64", "/lib64", "/usr/lib", "/lib"):
        try:
            st = os.stat(f"{d}/libseccomp.so.2")
        except OSError:
            continue
        return f"{d}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()
    return b"libseccomp:unknown"  # loaded from elsewhere (LD_LIBRARY_PATH): still keyed by profile


def _cache_key(data: bytes) -> str:
    h = hashlib.sha256()
    for part in (_COMPILER_VERSION, platform.machine().encode(), _libseccomp_identity()):
        h.update(part + b"\0")
    h.update(data)
    return h.hexdigest()


def _read_cached(path: Path) -> bytes | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if not raw or len(raw) % INSN.size or len(raw) // INSN.size > BPF_MAXINSNS:
        return None
    return raw


def _write_cached(path: Path, bpf: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(bpf)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        pass  # the cache is an optimisation; a read-only state dir must not fail a run


def compile_profile(spec: str, *, use_cache: bool = True) -> CompiledFilter:
    """Compile a builtin profile name or a JSON file to BPF (cached in memory and on disk)."""
    name, path = profile_path(spec)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PolicyError(f"seccomp profile {path}: {exc.strerror}") from exc
    skey = (str(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    if use_cache:
        with _mem_lock:
            hit = _mem_by_stat.get(skey)
        if hit is not None and hit.name == name:
            return hit
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"seccomp profile {path}: {exc.strerror}") from exc
    key = _cache_key(data)
    bpf: bytes | None = None
    if use_cache:
        with _mem_lock:
            bpf = _mem_by_key.get(key)
        if bpf is None:
            bpf = _read_cached(cache_dir() / f"{key}.bpf")
    if bpf is None:
        bpf = compile_bpf(parse_profile(path, data))
        if use_cache:
            _write_cached(cache_dir() / f"{key}.bpf", bpf)
    out = CompiledFilter(name=name, digest=hashlib.sha256(bpf).hexdigest(), bpf=bpf)
    with _mem_lock:
        _mem_by_key[key] = bpf
        _mem_by_stat[skey] = out
    return out


def clear_memory_cache() -> None:
    with _mem_lock:
        _mem_by_stat.clear()
        _mem_by_key.clear()
