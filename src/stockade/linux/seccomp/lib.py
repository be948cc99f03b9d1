"""libseccomp, loaded at run time from ``libseccomp.so.2`` through cffi's ABI mode
(building stockade needs no libseccomp headers): syscall names, architectures, export."""

from __future__ import annotations

import errno as _errno
import threading
from typing import Any

from ...errors import SandboxError

# Syscalls newer than some libseccomp releases know.  Numbers from 424 on are
# shared by every architecture but alpha (asm-generic unification, Linux 5.1).
_EXTRA_SYSCALLS: dict[str, int] = {
    "futex_waitv": 449,
    "set_mempolicy_home_node": 450,
    "cachestat": 451,
    "fchmodat2": 452,
    "map_shadow_stack": 453,
    "futex_wake": 454,
    "futex_wait": 455,
    "futex_requeue": 456,
    "statmount": 457,
    "listmount": 458,
    "lsm_get_self_attr": 459,
    "lsm_set_self_attr": 460,
    "lsm_list_modules": 461,
    "mseal": 462,
    "setxattrat": 463,
    "getxattrat": 464,
    "listxattrat": 465,
    "removexattrat": 466,
    "open_tree_attr": 467,
    "file_getattr": 468,
    "file_setattr": 469,
}


_CDEF = """
typedef void *scmp_filter_ctx;
typedef uint64_t scmp_datum_t;
struct scmp_arg_cmp { unsigned int arg; int op; scmp_datum_t datum_a; scmp_datum_t datum_b; };
struct scmp_version { unsigned int major; unsigned int minor; unsigned int micro; };
scmp_filter_ctx seccomp_init(uint32_t def_action);
void seccomp_release(scmp_filter_ctx ctx);
int seccomp_attr_set(scmp_filter_ctx ctx, int attr, uint32_t value);
uint32_t seccomp_arch_native(void);
uint32_t seccomp_arch_resolve_name(const char *arch_name);
int seccomp_arch_add(scmp_filter_ctx ctx, uint32_t arch_token);
int seccomp_arch_remove(scmp_filter_ctx ctx, uint32_t arch_token);
int seccomp_rule_add_array(scmp_filter_ctx ctx, uint32_t action, int syscall,
                           unsigned int arg_cnt, const struct scmp_arg_cmp *arg_array);
int seccomp_syscall_resolve_name(const char *name);
int seccomp_export_bpf(const scmp_filter_ctx ctx, int fd);
const struct scmp_version *seccomp_version(void);
"""

_NR_SCMP_ERROR = -1


class _Libseccomp:
    def __init__(self) -> None:
        import cffi

        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        try:
            self.lib: Any = self.ffi.dlopen("libseccomp.so.2")
        except OSError as exc:
            raise SandboxError(
                "load libseccomp",
                path="libseccomp.so.2",
                errno=_errno.ENOENT,
                detail=str(exc),
                remedy="install libseccomp (Debian/Ubuntu: apt-get install libseccomp2), "
                "or run with --seccomp off --allow-degraded seccomp",
            ) from exc
        v = self.lib.seccomp_version()
        self.version = f"{v.major}.{v.minor}.{v.micro}"
        self.native = int(self.lib.seccomp_arch_native())
        self._names: dict[str, int] = {}

    def resolve(self, name: str) -> int | None:
        """Native syscall number; negative for a syscall this arch lacks; None if unknown."""
        got = self._names.get(name)
        if got is None:
            nr = int(self.lib.seccomp_syscall_resolve_name(name.encode()))
            if nr == _NR_SCMP_ERROR:
                extra = _EXTRA_SYSCALLS.get(name)
                if extra is None:
                    return None
                nr = extra
            self._names[name] = got = nr
        return got

    def arch_token(self, name: str) -> int | None:
        if name == "SCMP_ARCH_NATIVE":
            return self.native
        if not name.startswith("SCMP_ARCH_"):
            return None
        tok = int(self.lib.seccomp_arch_resolve_name(name[len("SCMP_ARCH_") :].lower().encode()))
        return tok or None


_lib_lock = threading.Lock()
_lib: _Libseccomp | None = None


def libseccomp() -> _Libseccomp:
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _Libseccomp()
        return _lib


def libseccomp_version() -> str:
    return libseccomp().version


def syscall_number(name: str) -> int:
    """The native number of ``name`` (for tests and the lead's code); KeyError if unknown."""
    nr = libseccomp().resolve(name)
    if nr is None or nr < 0:
        raise KeyError(name)
    return nr
