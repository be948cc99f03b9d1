"""A classic BPF interpreter (validation and tests), and the kernel's action-cache
emulation (``kernel_const_allow``)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from .bpf import (
    BPF_A_SRC,
    BPF_ABS,
    BPF_ALU,
    BPF_IMM,
    BPF_JA,
    BPF_JEQ,
    BPF_JGE,
    BPF_JGT,
    BPF_JMP,
    BPF_JSET,
    BPF_K,
    BPF_LD,
    BPF_LDX,
    BPF_LEN,
    BPF_MEM,
    BPF_MISC,
    BPF_RET,
    BPF_ST,
    BPF_STX,
    BPF_W,
    BPF_X,
    INSN,
    SECCOMP_RET_ALLOW,
)
from .lib import libseccomp


def evaluate(
    bpf: bytes, nr: int, args: Sequence[int] = (), *, arch: int | None = None, ip: int = 0
) -> int:
    """Run ``bpf`` on a ``struct seccomp_data`` and return the SECCOMP_RET_* value."""
    if arch is None:
        arch = libseccomp().native
    a6 = [int(x) & 0xFFFFFFFFFFFFFFFF for x in args] + [0] * (6 - len(args))
    data = struct.pack("=iIQ6Q", nr, arch, ip, *a6[:6])
    prog = [INSN.unpack_from(bpf, i) for i in range(0, len(bpf), INSN.size)]
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
        if cls == BPF_RET:
            return acc if (code & 0x18) == BPF_A_SRC else k
        if cls in (BPF_LD, BPF_LDX):
            mode = code & 0xE0
            if mode == BPF_ABS:
                if code & 0x18 != BPF_W or k % 4 or k + 4 > len(data):
                    raise ValueError(f"BPF: bad load at offset {k}")
                val = struct.unpack_from("=I", data, k)[0]
            elif mode == BPF_IMM:
                val = k
            elif mode == BPF_MEM:
                val = mem[k]
            elif mode == BPF_LEN:
                val = len(data)
            else:
                raise ValueError(f"BPF: unsupported load {code:#x}")
            if cls == BPF_LD:
                acc = val
            else:
                x = val
        elif cls == BPF_ST:
            mem[k] = acc
        elif cls == BPF_STX:
            mem[k] = x
        elif cls == BPF_ALU:
            op = code & 0xF0
            src = x if code & BPF_X else k
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
        elif cls == BPF_JMP:
            op = code & 0xF0
            src = x if code & BPF_X else k
            if op == BPF_JA:
                pc += k
                continue
            if op == BPF_JEQ:
                cond = acc == src
            elif op == BPF_JGT:
                cond = acc > src
            elif op == BPF_JGE:
                cond = acc >= src
            elif op == BPF_JSET:
                cond = bool(acc & src)
            else:
                raise ValueError(f"BPF: unsupported jump {code:#x}")
            pc += jt if cond else jf
        elif cls == BPF_MISC:
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
        arch = libseccomp().native
    prog: list[tuple[int, int, int, int]] = [
        INSN.unpack_from(bpf, i) for i in range(0, len(bpf), INSN.size)
    ]
    reg = 0
    pc = 0
    while 0 <= pc < len(prog):
        code, jt, jf, k = prog[pc]
        if code == BPF_LD | BPF_W | BPF_ABS:
            if k == 0:
                reg = nr & 0xFFFFFFFF
            elif k == 4:
                reg = arch
            else:
                return False
        elif code == BPF_RET | BPF_K:
            return k == SECCOMP_RET_ALLOW
        elif code == BPF_JMP | BPF_JA:
            pc += k
        elif code in (
            BPF_JMP | BPF_JEQ | BPF_K,
            BPF_JMP | BPF_JGE | BPF_K,
            BPF_JMP | BPF_JGT | BPF_K,
            BPF_JMP | BPF_JSET | BPF_K,
        ):
            op = code & 0xF0
            res = (
                reg == k
                if op == BPF_JEQ
                else reg >= k
                if op == BPF_JGE
                else reg > k
                if op == BPF_JGT
                else bool(reg & k)
            )
            pc += jt if res else jf
        elif code == BPF_ALU | 0x50 | BPF_K:  # BPF_AND
            reg &= k
        else:
            return False
        pc += 1
    return False
