"""A parsed profile compiled to one BPF program: libseccomp builds the main program and
the argument-deny program, a hand-written prologue kills foreign ABIs, and the result
is checked to still let the sandbox's init start, wait for and report the command."""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Iterable, Sequence

from ...errors import PolicyError, SandboxError
from .bpf import (
    AUDIT_ARCH_X86_64,
    BPF_A_SRC,
    BPF_ABS,
    BPF_JA,
    BPF_JEQ,
    BPF_JMP,
    BPF_JSET,
    BPF_K,
    BPF_LD,
    BPF_MAXINSNS,
    BPF_RET,
    BPF_W,
    INSN,
    SCMP_ARCH_X32,
    SECCOMP_RET_ACTION_FULL,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_KILL_PROCESS,
    X32_SYSCALL_BIT,
    insn,
)
from .evaluate import evaluate
from .lib import libseccomp
from .parse import PERMISSIVE, Cmp, Profile, action_name, profile_error

# libseccomp filter attributes
_ATTR_ACT_BADARCH = 2
_ATTR_CTL_OPTIMIZE = 8

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


def _plan(
    prof: Profile,
) -> tuple[list[tuple[int, int, tuple[Cmp, ...]]], list[tuple[int, int, tuple[Cmp, ...]]]]:
    """Split rules into the main program (A) and the argument-deny program (B).

    Returns two lists of (syscall nr, action, comparisons).
    """
    lib = libseccomp()
    uncond: dict[int, tuple[int, str, str]] = {}  # nr -> (action, where, name)
    cond: list[tuple[int, int, tuple[Cmp, ...], str, str]] = []
    for rule in prof.rules:
        for n in rule.names:
            nr = lib.resolve(n)
            assert nr is not None
            if not rule.args:
                prev = uncond.get(nr)
                if prev is not None and prev[0] != rule.action:
                    raise profile_error(
                        prof.path,
                        rule.where,
                        f"{n!r} already has action {action_name(prev[0])} in {prev[1]}; "
                        f"conflicting {action_name(rule.action)}",
                    )
                uncond[nr] = (rule.action, rule.where, n)
            else:
                cond.append((nr, rule.action, rule.args, rule.where, n))
    prog_a: list[tuple[int, int, tuple[Cmp, ...]]] = []
    prog_b: list[tuple[int, int, tuple[Cmp, ...]]] = []
    for nr, (action, _w, _n) in uncond.items():
        if action != prof.default_action:
            prog_a.append((nr, action, ()))
    for nr, action, args, where, n in cond:
        if action not in PERMISSIVE:
            prog_b.append((nr, action, args))
        elif nr in uncond:
            if uncond[nr][0] not in PERMISSIVE:
                raise profile_error(
                    prof.path,
                    where,
                    f"an argument-conditional {action_name(action)} for {n!r}, which "
                    f"{uncond[nr][1]} denies unconditionally: unconditional rules win over "
                    "conditional allows; drop the unconditional rule and let defaultAction "
                    "cover the other cases",
                )
            # subsumed by the unconditional allow
        elif action != prof.default_action:
            prog_a.append((nr, action, args))
    return prog_a, prog_b


def _build(
    prof: Profile, default: int, rules: Sequence[tuple[int, int, tuple[Cmp, ...]]]
) -> bytes:
    lib = libseccomp()
    ffi, c = lib.ffi, lib.lib
    ctx = c.seccomp_init(default)
    if ctx == ffi.NULL:
        raise profile_error(prof.path, "defaultAction", "libseccomp refused the default action")
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
    if not out or len(out) % INSN.size:
        raise SandboxError(
            "compile seccomp profile",
            path=str(prof.path),
            detail=f"libseccomp exported {len(out)} bytes",
        )
    return out


def _check(prof: Profile, step: str, rc: int) -> None:
    if rc < 0:
        raise SandboxError(f"libseccomp: {step}", path=str(prof.path), errno=-rc)


def _prologue(arches: Iterable[int]) -> bytes:
    """Kill every architecture not listed, and x32 numbers unless X32 is listed."""
    allowed = sorted({a for a in arches if a != SCMP_ARCH_X32})
    kill = insn(BPF_RET | BPF_K, 0, 0, SECCOMP_RET_KILL_PROCESS)
    x32_check = AUDIT_ARCH_X86_64 in allowed and SCMP_ARCH_X32 not in set(arches)
    tail: list[bytes] = []
    if x32_check:
        # only reached for X86_64: the arch checks below jump here for it
        tail = [
            insn(BPF_LD | BPF_W | BPF_ABS, 0, 0, 0),  # A = nr
            insn(BPF_JMP | BPF_JSET | BPF_K, 0, 1, X32_SYSCALL_BIT),
            kill,
        ]
    # arch dispatch: other arches jump past the x32 tail, x86_64 falls into it
    n = len(allowed)
    head = [insn(BPF_LD | BPF_W | BPF_ABS, 0, 0, 4)]  # A = arch
    for i, tok in enumerate(allowed):
        # distance from the instruction after this jeq to the target
        after_kill = (n - i - 1) + 1  # remaining jeqs + the kill
        target = after_kill if tok == AUDIT_ARCH_X86_64 or not tail else after_kill + len(tail)
        head.append(insn(BPF_JMP | BPF_JEQ | BPF_K, target, 0, tok))
    head.append(kill)
    return b"".join(head + tail)


def _compose(prologue: bytes, deny: bytes | None, main: bytes) -> bytes:
    """prologue + deny program (its RET ALLOW turned into a jump to main) + main."""
    if deny is None:
        out = prologue + main
    else:
        insns = [INSN.unpack_from(deny, i) for i in range(0, len(deny), INSN.size)]
        patched: list[bytes] = []
        for i, (code, jt, jf, k) in enumerate(insns):
            if code == (BPF_RET | BPF_K) and k == SECCOMP_RET_ALLOW:
                patched.append(insn(BPF_JMP | BPF_JA, 0, 0, len(insns) - i - 1))
            elif code == (BPF_RET | BPF_A_SRC):
                raise SandboxError(
                    "compose seccomp programs", detail="unexpected RET A in libseccomp output"
                )
            else:
                patched.append(insn(code, jt, jf, k))
        out = prologue + b"".join(patched) + main
    if len(out) // INSN.size > BPF_MAXINSNS:
        raise PolicyError(
            f"seccomp profile compiles to {len(out) // INSN.size} BPF instructions (limit {BPF_MAXINSNS})"
        )
    return out


def compile_bpf(prof: Profile) -> bytes:
    prog_a, prog_b = _plan(prof)
    main = _build(prof, prof.default_action, prog_a)
    deny = _build(prof, SECCOMP_RET_ALLOW, prog_b) if prog_b else None
    bpf = _compose(_prologue(prof.arches), deny, main)
    _check_init_calls(prof, bpf)
    return bpf


def _check_init_calls(prof: Profile, bpf: bytes) -> None:
    lib = libseccomp()
    denied: list[str] = []
    for name, args in INIT_REQUIRED_CALLS:
        nr = lib.resolve(name)
        if nr is None or nr < 0:
            continue
        ret = evaluate(bpf, nr, args, arch=lib.native)
        if (ret & SECCOMP_RET_ACTION_FULL) not in PERMISSIVE:
            what = (
                f"{name}({', '.join(hex(a) for a in args[:2])}, ...)" if name == "clone" else name
            )
            denied.append(f"{what} -> {action_name(ret)}")
    if denied:
        raise PolicyError(
            f"seccomp profile {prof.path}: denies {', '.join(sorted(set(denied)))}: the sandbox's "
            "init installs the filter in itself and then still needs "
            f"{', '.join(sorted({n for n, _ in INIT_REQUIRED_CALLS}))} to start, wait for "
            "and report the command; allow them"
        )
