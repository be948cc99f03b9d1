"""Run a command under a seccomp filter that refuses new namespaces the way container
engines' default profiles do (tests of `stockade doctor` and run errors).

    python deny_namespaces.py ERRNO -- ARGV...

clone3 and unshare give ERRNO (ENOSYS or EPERM: Docker's profile answers clone3 with
ENOSYS so callers fall back to clone); clone with CLONE_NEWUSER gives EPERM, as
Docker's does without CAP_SYS_ADMIN. Uses stockade's own profile compiler (libseccomp).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import sys
import tempfile

from stockade.linux.seccomp import compile_profile

CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


def main() -> None:
    err = getattr(errno, sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    if sys.argv[1] == "ENOSYS":
        rules = [{"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": err},
                 {"names": ["unshare"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}]
    else:
        rules = [{"names": ["clone3", "unshare"], "action": "SCMP_ACT_ERRNO", "errnoRet": err}]
    rules.append({"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
                  "args": [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER,
                            "op": "SCMP_CMP_MASKED_EQ"}]})
    prof = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_NATIVE"], "syscalls": rules}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prof, f)
    try:
        bpf = compile_profile(f.name, use_cache=False).bpf
    finally:
        os.unlink(f.name)
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = struct.pack("HxxxxxxQ", len(bpf) // 8, ctypes.addressof(buf))
    prog = ctypes.create_string_buffer(fprog, len(fprog))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(prog)), 0, 0) != 0:
        e = ctypes.get_errno()
        sys.exit(f"deny_namespaces: installing the filter failed: {os.strerror(e)}")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
