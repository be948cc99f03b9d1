"""Kernel seccomp constants and classic BPF instructions (``struct sock_filter``)."""

from __future__ import annotations

import struct

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
BPF_LD, BPF_LDX, BPF_ST, BPF_STX, BPF_ALU, BPF_JMP, BPF_RET, BPF_MISC = range(8)
BPF_W, BPF_H, BPF_B = 0x00, 0x08, 0x10
BPF_IMM, BPF_ABS, BPF_IND, BPF_MEM, BPF_LEN = 0x00, 0x20, 0x40, 0x60, 0x80
BPF_K, BPF_X = 0x00, 0x08
BPF_JA, BPF_JEQ, BPF_JGT, BPF_JGE, BPF_JSET = 0x00, 0x10, 0x20, 0x30, 0x40
INSN = struct.Struct("=HBBI")
BPF_A_SRC = 0x10  # BPF_RET | BPF_A


def insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return INSN.pack(code, jt, jf, k)
