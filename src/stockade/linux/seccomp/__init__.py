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
the filter is built as two programs, see ``compile._compose``):

1. an argument-conditional rule whose action denies (ERRNO, TRAP, KILL_*) and
   whose comparisons all match decides;
2. else an unconditional rule naming the syscall decides;
3. else an argument-conditional ALLOW/LOG rule that matches allows;
4. else ``defaultAction``.

Non-native ABIs are killed twice over: libseccomp's bad-arch action is
KILL_PROCESS, and a hand-written prologue in front of the program kills any
architecture the profile does not list and, on x86-64, any syscall number with
``__X32_SYSCALL_BIT`` set (unless the profile lists SCMP_ARCH_X32).

The modules, bottom up: ``bpf`` (kernel constants, instructions), ``lib`` (libseccomp),
``parse`` (JSON -> a checked profile), ``evaluate`` (a BPF interpreter), ``compile``
(profile -> BPF), ``profiles`` (shipped profiles, listing), ``cache`` (``compile_profile``).
"""

from __future__ import annotations

from .bpf import (
    AUDIT_ARCH_I386,
    AUDIT_ARCH_X86_64,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_ERRNO,
    SECCOMP_RET_KILL_PROCESS,
    SECCOMP_RET_KILL_THREAD,
    SECCOMP_RET_LOG,
    SECCOMP_RET_TRAP,
)
from .cache import CompiledFilter, cache_dir, clear_memory_cache, compile_profile
from .compile import INIT_REQUIRED_CALLS
from .evaluate import evaluate, kernel_const_allow
from .lib import libseccomp_version, syscall_number
from .profiles import BUILTIN_PROFILES, ProfileInfo, list_profiles, profile_path

__all__ = [
    "AUDIT_ARCH_I386",
    "AUDIT_ARCH_X86_64",
    "BUILTIN_PROFILES",
    "INIT_REQUIRED_CALLS",
    "SECCOMP_RET_ALLOW",
    "SECCOMP_RET_ERRNO",
    "SECCOMP_RET_KILL_PROCESS",
    "SECCOMP_RET_KILL_THREAD",
    "SECCOMP_RET_LOG",
    "SECCOMP_RET_TRAP",
    "CompiledFilter",
    "ProfileInfo",
    "cache_dir",
    "clear_memory_cache",
    "compile_profile",
    "evaluate",
    "kernel_const_allow",
    "libseccomp_version",
    "list_profiles",
    "profile_path",
    "syscall_number",
]
