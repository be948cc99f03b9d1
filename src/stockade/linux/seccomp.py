"""Seccomp profiles: OCI-style JSON compiled to classic BPF by libseccomp.

The parent compiles; the sandbox's init installs the bytes with
``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog)`` as the last step before it
forks and execs the command.  libseccomp is loaded at run time from
``libseccomp.so.2`` through cffi's ABI mode, so building stockade needs no
libseccomp headers.

Profile schema (see ``seccomp_profiles/README.md``)::

    {
      "description": "one line shown by `stockade profiles`",
      "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 38,
      "architectures": ["SCMP_ARCH_NATIVE"],
      "syscalls": [
        {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
        {"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
         "args": [{"index": 1, "value": 4294967295, "valueTwo": 21522,
                   "op": "SCMP_CMP_MASKED_EQ"}]}
      ]
    }

Evaluation of one system call (the order libseccomp alone cannot express, so
the filter is built as two programs, see :func:`_compose`):

1. an argument-conditional rule whose action denies (ERRNO, TRAP, KILL_*) and
   whose comparisons all match decides;
2. else an unconditional rule naming the syscall decides;
3. else an argument-conditional ALLOW/LOG rule that matches allows;
4. else ``defaultAction``.

Non-native ABIs are killed twice over: libseccomp's bad-arch action is
KILL_PROCESS, and a hand-written prologue in front of the program kills any
architecture the profile does not list and, on x86-64, any syscall number with
``__X32_SYSCALL_BIT`` set (unless the profile lists SCMP_ARCH_X32).
"""

from __future__ import annotations

import errno as _errno
import hashlib
import json
import os
import platform
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PolicyError, SandboxError

__all__ = [
    "BUILTIN_PROFILES",
    "INIT_REQUIRED_CALLS",
    "CompiledFilter",
    "ProfileInfo",
    "cache_dir",
    "compile_profile",
    "evaluate",
    "kernel_const_allow",
    "libseccomp_version",
    "list_profiles",
    "profile_path",
    "register",
    "syscall_number",
]

# Bump when the compiler's output for the same profile changes (cache key).
_COMPILER_VERSION = b"stockade-seccomp-1"

BUILTIN_PROFILES = ("default", "strict", "permissive")

# ---- kernel constants --------------------------------------------------------
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_KILL_THREAD = 0x00000000
SECCOMP_RET_TRAP = 0x00030000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_TRACE = 0x7FF00000
SECCOMP_RET_LOG = 0x7FFC0000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ACTION_FULL = 0xFFFF0000
SECCOMP_RET_DATA = 0x0000FFFF

X32_SYSCALL_BIT = 0x40000000
BPF_MAXINSNS = 4096

# libseccomp's arch tokens are the kernel's AUDIT_ARCH_* values.
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
SCMP_ARCH_X32 = 0x4000003E  # libseccomp token; the kernel reports x32 as X86_64 + bit 30

# classic BPF opcodes
_BPF_LD, _BPF_LDX, _BPF_ST, _BPF_STX, _BPF_ALU, _BPF_JMP, _BPF_RET, _BPF_MISC = range(8)
_BPF_W, _BPF_H, _BPF_B = 0x00, 0x08, 0x10
_BPF_IMM, _BPF_ABS, _BPF_IND, _BPF_MEM, _BPF_LEN = 0x00, 0x20, 0x40, 0x60, 0x80
_BPF_K, _BPF_X = 0x00, 0x08
_BPF_JA, _BPF_JEQ, _BPF_JGT, _BPF_JGE, _BPF_JSET = 0x00, 0x10, 0x20, 0x30, 0x40
_INSN = struct.Struct("=HBBI")

# Profile actions.  SCMP_ACT_TRACE and SCMP_ACT_NOTIFY are refused: with no tracer
# or supervisor attached they only return ENOSYS, and a supervisor would be a host
# process deciding on the sandbox's behalf, which stockade does not provide.
_ACTIONS: dict[str, int] = {
    "SCMP_ACT_ALLOW": SECCOMP_RET_ALLOW,
    "SCMP_ACT_ERRNO": SECCOMP_RET_ERRNO,
    "SCMP_ACT_KILL": SECCOMP_RET_KILL_THREAD,
    "SCMP_ACT_KILL_THREAD": SECCOMP_RET_KILL_THREAD,
    "SCMP_ACT_KILL_PROCESS": SECCOMP_RET_KILL_PROCESS,
    "SCMP_ACT_TRAP": SECCOMP_RET_TRAP,
    "SCMP_ACT_LOG": SECCOMP_RET_LOG,
}
_REFUSED_ACTIONS = {
    "SCMP_ACT_TRACE": "needs a ptrace supervisor, which stockade does not run",
    "SCMP_ACT_NOTIFY": "needs a user-notification supervisor, which stockade does not run",
}
_PERMISSIVE = {SECCOMP_RET_ALLOW, SECCOMP_RET_LOG}

_OPS: dict[str, int] = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}

# libseccomp filter attributes
_ATTR_ACT_BADARCH = 2
_ATTR_CTL_OPTIMIZE = 8

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

_SIGCHLD = 17
_CLONE_FORK_FLAGS = 0x01200000 | _SIGCHLD  # CLONE_CHILD_SETTID|CLONE_CHILD_CLEARTID|SIGCHLD
# What the sandbox's init (PID 1) does after installing the filter: fork the
# command with clone(SIGCHLD), mask and wait for signals, reap, forward signals,
# report over a pipe, and in the child set the process group (or, with a pty, a
# new session that takes the pty as its terminal), wire fds and exec.
# Each entry: (syscall, argument vector the check uses).
INIT_REQUIRED_CALLS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("clone", (_SIGCHLD, 0, 0, 0, 0, 0)),
    ("clone", (_CLONE_FORK_FLAGS, 0, 0, 0, 0, 0)),
    ("rt_sigprocmask", (0, 0, 0, 8, 0, 0)),
    ("rt_sigtimedwait", (0, 0, 0, 8, 0, 0)),
    ("rt_sigreturn", (0, 0, 0, 0, 0, 0)),
    ("wait4", (0xFFFFFFFFFFFFFFFF, 0, 0, 0, 0, 0)),
    ("kill", (2, 15, 0, 0, 0, 0)),
    ("write", (1, 0, 1, 0, 0, 0)),
    ("close", (3, 0, 0, 0, 0, 0)),
    ("setpgid", (0, 0, 0, 0, 0, 0)),
    ("setsid", (0, 0, 0, 0, 0, 0)),
    # TIOCSCTTY: under `stockade shell` the pty becomes the command's terminal
    ("ioctl", (0, 0x540E, 0, 0, 0, 0)),
    ("dup2", (3, 1, 0, 0, 0, 0)),
    ("dup3", (3, 1, 0x80000, 0, 0, 0)),
    ("execve", (0, 0, 0, 0, 0, 0)),
    ("exit_group", (0, 0, 0, 0, 0, 0)),
    ("exit", (0, 0, 0, 0, 0, 0)),
)


# ---- public types --------------------------------------------------------------
@dataclass(frozen=True)
class CompiledFilter:
    """A compiled profile: ``bpf`` is the raw array of ``struct sock_filter``."""

    name: str
    digest: str  # sha256 of ``bpf`` (hex): what the audit log records
    bpf: bytes

    @property
    def instructions(self) -> int:
        return len(self.bpf) // _INSN.size


@dataclass(frozen=True)
class ProfileInfo:
    name: str
    path: Path
    description: str
    default_action: str


# ---- libseccomp through cffi's ABI mode ---------------------------------------
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


def _libseccomp() -> _Libseccomp:
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _Libseccomp()
        return _lib


def libseccomp_version() -> str:
    return _libseccomp().version


def syscall_number(name: str) -> int:
    """The native number of ``name`` (for tests and the lead's code); KeyError if unknown."""
    nr = _libseccomp().resolve(name)
    if nr is None or nr < 0:
        raise KeyError(name)
    return nr


# ---- parsing and validation ----------------------------------------------------
@dataclass(frozen=True)
class _Cmp:
    index: int
    op: int
    a: int
    b: int


@dataclass(frozen=True)
class _Rule:
    where: str  # "syscalls[3]" for messages
    names: tuple[str, ...]
    action: int  # full SECCOMP_RET_* value, errno folded in
    args: tuple[_Cmp, ...]


@dataclass
class _Profile:
    path: Path
    description: str
    default_action: int
    default_action_name: str
    arches: list[int]
    rules: list[_Rule] = field(default_factory=list)


_TOP_KEYS = {
    "defaultAction",
    "defaultErrnoRet",
    "architectures",
    "syscalls",
    "description",
    "comment",
}
_RULE_KEYS = {"names", "action", "errnoRet", "args", "comment"}
_ARG_KEYS = {"index", "value", "valueTwo", "op"}


def _fail(path: Path, where: str, msg: str) -> PolicyError:
    return PolicyError(f"seccomp profile {path}: {where}: {msg}")


def _errno_value(path: Path, where: str, raw: object) -> int:
    if isinstance(raw, str):
        val = getattr(_errno, raw, None)
        if not isinstance(val, int):
            raise _fail(path, where, f"unknown errno name {raw!r}")
        return val
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= 4095:
        raise _fail(
            path, where, f"must be an errno number 0..4095 or a name like 'EPERM', not {raw!r}"
        )
    return raw


def _action(
    path: Path, where: str, raw: object, errno_raw: object, errno_where: str, default_errno: int
) -> int:
    if not isinstance(raw, str):
        raise _fail(path, where, f"must be a string like 'SCMP_ACT_ALLOW', not {raw!r}")
    if raw in _REFUSED_ACTIONS:
        raise _fail(path, where, f"{raw} is not supported: it {_REFUSED_ACTIONS[raw]}")
    base = _ACTIONS.get(raw)
    if base is None:
        raise _fail(
            path, where, f"unknown action {raw!r} (expected one of {', '.join(sorted(_ACTIONS))})"
        )
    if base == SECCOMP_RET_ERRNO:
        eno = default_errno if errno_raw is None else _errno_value(path, errno_where, errno_raw)
        return SECCOMP_RET_ERRNO | eno
    if errno_raw is not None:
        raise _fail(path, errno_where, f"only valid with SCMP_ACT_ERRNO, not {raw}")
    return base


def _u64(path: Path, where: str, raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not -(1 << 63) <= raw < (1 << 64):
        raise _fail(path, where, f"must be an integer in the 64-bit range, not {raw!r}")
    return raw & 0xFFFFFFFFFFFFFFFF


def _action_name(action: int) -> str:
    base = action & SECCOMP_RET_ACTION_FULL
    if base == SECCOMP_RET_ERRNO:
        eno = action & SECCOMP_RET_DATA
        return f"SCMP_ACT_ERRNO({_errno.errorcode.get(eno, eno)})"
    for name, val in _ACTIONS.items():
        if val == base and name != "SCMP_ACT_KILL":
            return name
    return hex(action)


def _parse(path: Path, data: bytes) -> _Profile:
    lib = _libseccomp()
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, "JSON", str(exc)) from exc
    if not isinstance(doc, dict):
        raise _fail(path, "top level", "must be a JSON object")
    for key in doc:
        if key not in _TOP_KEYS:
            raise _fail(path, key, f"unknown field (known: {', '.join(sorted(_TOP_KEYS))})")
    desc = doc.get("description", "")
    if not isinstance(desc, str):
        raise _fail(path, "description", "must be a string")
    if "defaultAction" not in doc:
        raise _fail(path, "defaultAction", "missing")
    default_errno = _errno.EPERM
    if doc.get("defaultErrnoRet") is not None:
        default_errno = _errno_value(path, "defaultErrnoRet", doc["defaultErrnoRet"])
    default_action = _action(
        path,
        "defaultAction",
        doc["defaultAction"],
        doc.get("defaultErrnoRet"),
        "defaultErrnoRet",
        default_errno,
    )

    arch_names = doc.get("architectures", ["SCMP_ARCH_NATIVE"])
    if not isinstance(arch_names, list) or not arch_names:
        raise _fail(path, "architectures", "must be a non-empty list like ['SCMP_ARCH_NATIVE']")
    arches: list[int] = []
    for i, an in enumerate(arch_names):
        tok = lib.arch_token(an) if isinstance(an, str) else None
        if tok is None:
            raise _fail(path, f"architectures[{i}]", f"unknown architecture {an!r}")
        if tok not in arches:
            arches.append(tok)
    if lib.native not in arches:
        raise _fail(
            path,
            "architectures",
            f"does not include this machine's architecture ({platform.machine()}); "
            "list SCMP_ARCH_NATIVE",
        )

    prof = _Profile(path, desc, default_action, str(doc["defaultAction"]), arches)
    rules = doc.get("syscalls", [])
    if not isinstance(rules, list):
        raise _fail(path, "syscalls", "must be a list")
    for i, r in enumerate(rules):
        where = f"syscalls[{i}]"
        if not isinstance(r, dict):
            raise _fail(path, where, "must be an object")
        for key in r:
            if key not in _RULE_KEYS:
                raise _fail(
                    path,
                    f"{where}.{key}",
                    f"unknown field (known: {', '.join(sorted(_RULE_KEYS))})",
                )
        names = r.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise _fail(path, f"{where}.names", "must be a non-empty list of syscall names")
        for j, n in enumerate(names):
            if lib.resolve(n) is None:
                raise _fail(
                    path, f"{where}.names[{j}]", f"unknown syscall {n!r} (libseccomp {lib.version})"
                )
        if "action" not in r:
            raise _fail(path, f"{where}.action", "missing")
        action = _action(
            path,
            f"{where}.action",
            r["action"],
            r.get("errnoRet"),
            f"{where}.errnoRet",
            _errno.EPERM,
        )
        raw_args = r.get("args") or []
        if not isinstance(raw_args, list):
            raise _fail(path, f"{where}.args", "must be a list of {index, value, valueTwo, op}")
        cmps: list[_Cmp] = []
        for k, a in enumerate(raw_args):
            aw = f"{where}.args[{k}]"
            if not isinstance(a, dict):
                raise _fail(path, aw, "must be an object {index, value, valueTwo, op}")
            for key in a:
                if key not in _ARG_KEYS:
                    raise _fail(
                        path,
                        f"{aw}.{key}",
                        f"unknown field (known: {', '.join(sorted(_ARG_KEYS))})",
                    )
            idx = a.get("index")
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx <= 5:
                raise _fail(path, f"{aw}.index", f"must be an argument index 0..5, not {idx!r}")
            if any(c.index == idx for c in cmps):
                raise _fail(
                    path,
                    f"{aw}.index",
                    f"a second comparison on argument {idx} in one rule (libseccomp cannot AND "
                    "them); write a separate rule",
                )
            op = a.get("op")
            if not isinstance(op, str) or op not in _OPS:
                raise _fail(
                    path, f"{aw}.op", f"unknown operator {op!r} (expected one of {', '.join(_OPS)})"
                )
            if "value" not in a:
                raise _fail(path, f"{aw}.value", "missing")
            va = _u64(path, f"{aw}.value", a["value"])
            vb = _u64(path, f"{aw}.valueTwo", a.get("valueTwo", 0))
            cmps.append(_Cmp(idx, _OPS[op], va, vb))
        prof.rules.append(_Rule(where, tuple(names), action, tuple(cmps)))
    return prof


# ---- compilation ----------------------------------------------------------------
def _plan(
    prof: _Profile,
) -> tuple[list[tuple[int, int, tuple[_Cmp, ...]]], list[tuple[int, int, tuple[_Cmp, ...]]]]:
    """Split rules into the main program (A) and the argument-deny program (B).

    Returns two lists of (syscall nr, action, comparisons).
    """
    lib = _libseccomp()
    uncond: dict[int, tuple[int, str, str]] = {}  # nr -> (action, where, name)
    cond: list[tuple[int, int, tuple[_Cmp, ...], str, str]] = []
    for rule in prof.rules:
        for n in rule.names:
            nr = lib.resolve(n)
            assert nr is not None
            if not rule.args:
                prev = uncond.get(nr)
                if prev is not None and prev[0] != rule.action:
                    raise _fail(
                        prof.path,
                        rule.where,
                        f"{n!r} already has action {_action_name(prev[0])} in {prev[1]}; "
                        f"conflicting {_action_name(rule.action)}",
                    )
                uncond[nr] = (rule.action, rule.where, n)
            else:
                cond.append((nr, rule.action, rule.args, rule.where, n))
    prog_a: list[tuple[int, int, tuple[_Cmp, ...]]] = []
    prog_b: list[tuple[int, int, tuple[_Cmp, ...]]] = []
    for nr, (action, _w, _n) in uncond.items():
        if action != prof.default_action:
            prog_a.append((nr, action, ()))
    for nr, action, args, where, n in cond:
        if action not in _PERMISSIVE:
            prog_b.append((nr, action, args))
        elif nr in uncond:
            if uncond[nr][0] not in _PERMISSIVE:
                raise _fail(
                    prof.path,
                    where,
                    f"an argument-conditional {_action_name(action)} for {n!r}, which "
                    f"{uncond[nr][1]} denies unconditionally: unconditional rules win over "
                    "conditional allows; drop the unconditional rule and let defaultAction "
                    "cover the other cases",
                )
            # subsumed by the unconditional allow
        elif action != prof.default_action:
            prog_a.append((nr, action, args))
    return prog_a, prog_b


def _build(
    prof: _Profile, default: int, rules: Sequence[tuple[int, int, tuple[_Cmp, ...]]]
) -> bytes:
    lib = _libseccomp()
    ffi, c = lib.ffi, lib.lib
    ctx = c.seccomp_init(default)
    if ctx == ffi.NULL:
        raise _fail(prof.path, "defaultAction", "libseccomp refused the default action")
    try:
        _check(
            prof,
            "set bad-arch action",
            c.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, SECCOMP_RET_KILL_PROCESS),
        )
        # binary-tree syscall dispatch (libseccomp >= 2.5): O(log n) per syscall
        c.seccomp_attr_set(ctx, _ATTR_CTL_OPTIMIZE, 2)
        for tok in prof.arches:
            if tok != lib.native:
                rc = c.seccomp_arch_add(ctx, tok)
                if rc not in (0, -_errno.EEXIST):
                    _check(prof, f"add architecture {tok:#x}", rc)
        for nr, action, args in rules:
            arr = ffi.new("struct scmp_arg_cmp[]", max(1, len(args)))
            for i, cm in enumerate(args):
                arr[i].arg = cm.index
                arr[i].op = cm.op
                arr[i].datum_a = cm.a
                arr[i].datum_b = cm.b
            rc = c.seccomp_rule_add_array(ctx, action, nr, len(args), arr if args else ffi.NULL)
            if rc == -_errno.EACCES or (rc == -_errno.EDOM and nr < 0):
                continue  # same as the default action / not on this arch
            _check(prof, f"add rule for syscall {nr}", rc)
        fd = os.memfd_create("stockade-seccomp", os.MFD_CLOEXEC)
        try:
            _check(prof, "export BPF", c.seccomp_export_bpf(ctx, fd))
            size = os.fstat(fd).st_size
            out = os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        c.seccomp_release(ctx)
    if not out or len(out) % _INSN.size:
        raise SandboxError(
            "compile seccomp profile",
            path=str(prof.path),
            detail=f"libseccomp exported {len(out)} bytes",
        )
    return out


def _check(prof: _Profile, step: str, rc: int) -> None:
    if rc < 0:
        raise SandboxError(f"libseccomp: {step}", path=str(prof.path), errno=-rc)


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return _INSN.pack(code, jt, jf, k)


def _prologue(arches: Iterable[int]) -> bytes:
    """Kill every architecture not listed, and x32 numbers unless X32 is listed."""
    allowed = sorted({a for a in arches if a != SCMP_ARCH_X32})
    kill = _insn(_BPF_RET | _BPF_K, 0, 0, SECCOMP_RET_KILL_PROCESS)
    x32_check = AUDIT_ARCH_X86_64 in allowed and SCMP_ARCH_X32 not in set(arches)
    tail: list[bytes] = []
    if x32_check:
        # only reached for X86_64: the arch checks below jump here for it
        tail = [
            _insn(_BPF_LD | _BPF_W | _BPF_ABS, 0, 0, 0),  # A = nr
            _insn(_BPF_JMP | _BPF_JSET | _BPF_K, 0, 1, X32_SYSCALL_BIT),
            kill,
        ]
    # arch dispatch: other arches jump past the x32 tail, x86_64 falls into it
    n = len(allowed)
    head = [_insn(_BPF_LD | _BPF_W | _BPF_ABS, 0, 0, 4)]  # A = arch
    for i, tok in enumerate(allowed):
        # distance from the instruction after this jeq to the target
        after_kill = (n - i - 1) + 1  # remaining jeqs + the kill
        target = after_kill if tok == AUDIT_ARCH_X86_64 or not tail else after_kill + len(tail)
        head.append(_insn(_BPF_JMP | _BPF_JEQ | _BPF_K, target, 0, tok))
    head.append(kill)
    return b"".join(head + tail)


def _compose(prologue: bytes, deny: bytes | None, main: bytes) -> bytes:
    """prologue + deny program (its RET ALLOW turned into a jump to main) + main."""
    if deny is None:
        out = prologue + main
    else:
        insns = [_INSN.unpack_from(deny, i) for i in range(0, len(deny), _INSN.size)]
        patched: list[bytes] = []
        for i, (code, jt, jf, k) in enumerate(insns):
            if code == (_BPF_RET | _BPF_K) and k == SECCOMP_RET_ALLOW:
                patched.append(_insn(_BPF_JMP | _BPF_JA, 0, 0, len(insns) - i - 1))
            elif code == (_BPF_RET | _BPF_A_SRC):
                raise SandboxError(
                    "compose seccomp programs", detail="unexpected RET A in libseccomp output"
                )
            else:
                patched.append(_insn(code, jt, jf, k))
        out = prologue + b"".join(patched) + main
    if len(out) // _INSN.size > BPF_MAXINSNS:
        raise PolicyError(
            f"seccomp profile compiles to {len(out) // _INSN.size} BPF instructions (limit {BPF_MAXINSNS})"
        )
    return out


_BPF_A_SRC = 0x10  # BPF_RET | BPF_A


def _compile(prof: _Profile) -> bytes:
    prog_a, prog_b = _plan(prof)
    main = _build(prof, prof.default_action, prog_a)
    deny = _build(prof, SECCOMP_RET_ALLOW, prog_b) if prog_b else None
    bpf = _compose(_prologue(prof.arches), deny, main)
    _check_init_calls(prof, bpf)
    return bpf


def _check_init_calls(prof: _Profile, bpf: bytes) -> None:
    lib = _libseccomp()
    denied: list[str] = []
    for name, args in INIT_REQUIRED_CALLS:
        nr = lib.resolve(name)
        if nr is None or nr < 0:
            continue
        ret = evaluate(bpf, nr, args, arch=lib.native)
        if (ret & SECCOMP_RET_ACTION_FULL) not in _PERMISSIVE:
            what = (
                f"{name}({', '.join(hex(a) for a in args[:2])}, ...)" if name == "clone" else name
            )
            denied.append(f"{what} -> {_action_name(ret)}")
    if denied:
        raise PolicyError(
            f"seccomp profile {prof.path}: denies {', '.join(sorted(set(denied)))}: the sandbox's "
            "init installs the filter in itself and then still needs "
            f"{', '.join(sorted({n for n, _ in INIT_REQUIRED_CALLS}))} to start, wait for "
            "and report the command; allow them"
        )


# ---- a classic BPF interpreter (validation and tests) ----------------------------
def evaluate(
    bpf: bytes, nr: int, args: Sequence[int] = (), *, arch: int | None = None, ip: int = 0
) -> int:
    """Run ``bpf`` on a ``struct seccomp_data`` and return the SECCOMP_RET_* value."""
    if arch is None:
        arch = _libseccomp().native
    a6 = [int(x) & 0xFFFFFFFFFFFFFFFF for x in args] + [0] * (6 - len(args))
    data = struct.pack("=iIQ6Q", nr, arch, ip, *a6[:6])
    prog = [_INSN.unpack_from(bpf, i) for i in range(0, len(bpf), _INSN.size)]
    acc = x = 0
    mem = [0] * 16
    pc = 0
    m32 = 0xFFFFFFFF
    for _step in range(len(prog) + 1):
        if not 0 <= pc < len(prog):
            raise ValueError(f"BPF: pc {pc} outside the program")
        code, jt, jf, k = prog[pc]
        pc += 1
        cls = code & 0x07
        if cls == _BPF_RET:
            return acc if (code & 0x18) == _BPF_A_SRC else k
        if cls in (_BPF_LD, _BPF_LDX):
            mode = code & 0xE0
            if mode == _BPF_ABS:
                if code & 0x18 != _BPF_W or k % 4 or k + 4 > len(data):
                    raise ValueError(f"BPF: bad load at offset {k}")
                val = struct.unpack_from("=I", data, k)[0]
            elif mode == _BPF_IMM:
                val = k
            elif mode == _BPF_MEM:
                val = mem[k]
            elif mode == _BPF_LEN:
                val = len(data)
            else:
                raise ValueError(f"BPF: unsupported load {code:#x}")
            if cls == _BPF_LD:
                acc = val
            else:
                x = val
        elif cls == _BPF_ST:
            mem[k] = acc
        elif cls == _BPF_STX:
            mem[k] = x
        elif cls == _BPF_ALU:
            op = code & 0xF0
            src = x if code & _BPF_X else k
            if op == 0x00:
                acc = (acc + src) & m32
            elif op == 0x10:
                acc = (acc - src) & m32
            elif op == 0x20:
                acc = (acc * src) & m32
            elif op == 0x30:
                acc = acc // src if src else 0
            elif op == 0x40:
                acc |= src
            elif op == 0x50:
                acc &= src
            elif op == 0x60:
                acc = (acc << src) & m32
            elif op == 0x70:
                acc >>= src
            elif op == 0x80:
                acc = (-acc) & m32
            elif op == 0x90:
                acc = acc % src if src else 0
            elif op == 0xA0:
                acc ^= src
            else:
                raise ValueError(f"BPF: unsupported ALU {code:#x}")
        elif cls == _BPF_JMP:
            op = code & 0xF0
            src = x if code & _BPF_X else k
            if op == _BPF_JA:
                pc += k
                continue
            if op == _BPF_JEQ:
                cond = acc == src
            elif op == _BPF_JGT:
                cond = acc > src
            elif op == _BPF_JGE:
                cond = acc >= src
            elif op == _BPF_JSET:
                cond = bool(acc & src)
            else:
                raise ValueError(f"BPF: unsupported jump {code:#x}")
            pc += jt if cond else jf
        elif cls == _BPF_MISC:
            if code & 0xF8 == 0x00:
                x = acc
            else:
                acc = x
        else:  # pragma: no cover - all 8 classes handled
            raise ValueError(f"BPF: unknown class {code:#x}")
    raise ValueError("BPF: program did not return")


def kernel_const_allow(bpf: bytes, nr: int, *, arch: int | None = None) -> bool:
    """Whether the kernel's seccomp action cache (Linux >= 5.11) will allow ``nr``
    without running the filter: mirrors ``seccomp_is_const_allow()`` in
    kernel/seccomp.c, which emulates the program with only ``nr`` and ``arch``
    known and gives up on any argument load."""
    if arch is None:
        arch = _libseccomp().native
    prog: list[tuple[int, int, int, int]] = [
        _INSN.unpack_from(bpf, i) for i in range(0, len(bpf), _INSN.size)
    ]
    reg = 0
    pc = 0
    while 0 <= pc < len(prog):
        code, jt, jf, k = prog[pc]
        if code == _BPF_LD | _BPF_W | _BPF_ABS:
            if k == 0:
                reg = nr & 0xFFFFFFFF
            elif k == 4:
                reg = arch
            else:
                return False
        elif code == _BPF_RET | _BPF_K:
            return k == SECCOMP_RET_ALLOW
        elif code == _BPF_JMP | _BPF_JA:
            pc += k
        elif code in (
            _BPF_JMP | _BPF_JEQ | _BPF_K,
            _BPF_JMP | _BPF_JGE | _BPF_K,
            _BPF_JMP | _BPF_JGT | _BPF_K,
            _BPF_JMP | _BPF_JSET | _BPF_K,
        ):
            op = code & 0xF0
            res = (
                reg == k
                if op == _BPF_JEQ
                else reg >= k
                if op == _BPF_JGE
                else reg > k
                if op == _BPF_JGT
                else bool(reg & k)
            )
            pc += jt if res else jf
        elif code == _BPF_ALU | 0x50 | _BPF_K:  # BPF_AND
            reg &= k
        else:
            return False
        pc += 1
    return False


# ---- profiles on disk and the cache ------------------------------------------------
def _profiles_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "seccomp_profiles"


def profile_path(spec: str) -> tuple[str, Path]:
    """(display name, path) for a profile name or a path to a JSON file."""
    if spec == "off":
        raise PolicyError("--seccomp off is not a profile: it needs --allow-degraded seccomp")
    if "/" in spec or spec.endswith(".json"):
        p = Path(spec).expanduser()
        if p.is_dir():
            raise PolicyError(f"seccomp profile {spec}: is a directory; expected a JSON profile file (or one of {', '.join(BUILTIN_PROFILES)})")
        if not p.is_file():
            what = "no such file" if not p.exists() else "not a regular file"
            raise PolicyError(f"seccomp profile {spec}: {what}; expected a JSON profile file (or one of {', '.join(BUILTIN_PROFILES)})")
        return str(p), p.resolve()
    if spec not in BUILTIN_PROFILES:
        raise PolicyError(
            f"unknown seccomp profile {spec!r}: use one of {', '.join(BUILTIN_PROFILES)}, "
            "'off', or a path to a JSON profile"
        )
    return spec, _profiles_dir() / f"{spec}.json"


def cache_dir() -> Path:
    from ..session.store import state_dir

    return state_dir() / "cache" / "seccomp"


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
    if not raw or len(raw) % _INSN.size or len(raw) // _INSN.size > BPF_MAXINSNS:
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
        bpf = _compile(_parse(path, data))
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


def list_profiles() -> list[ProfileInfo]:
    out: list[ProfileInfo] = []
    for name in BUILTIN_PROFILES:
        p = _profiles_dir() / f"{name}.json"
        try:
            doc = json.loads(p.read_bytes())
            desc = str(doc.get("description", ""))
            dflt = str(doc.get("defaultAction", ""))
            if dflt == "SCMP_ACT_ERRNO" and doc.get("defaultErrnoRet") is not None:
                eno = doc["defaultErrnoRet"]
                dflt += f"({_errno.errorcode.get(eno, eno) if isinstance(eno, int) else eno})"
        except (OSError, ValueError, AttributeError) as exc:
            desc, dflt = f"unreadable: {exc}", "?"
        out.append(ProfileInfo(name=name, path=p, description=desc, default_action=dflt))
    return out


def register(subparsers: Any) -> None:
    """`stockade profiles`: see :mod:`stockade.linux.seccomp_cli`."""
    from .seccomp_cli import register as _register

    _register(subparsers)
