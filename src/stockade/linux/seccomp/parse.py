"""OCI-style JSON profiles parsed and validated, with one-line errors naming the field."""

from __future__ import annotations

import errno as _errno
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import PolicyError
from .bpf import (
    SECCOMP_RET_ACTION_FULL,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_DATA,
    SECCOMP_RET_ERRNO,
    SECCOMP_RET_KILL_PROCESS,
    SECCOMP_RET_KILL_THREAD,
    SECCOMP_RET_LOG,
    SECCOMP_RET_TRAP,
)
from .lib import libseccomp

# Profile actions.  SCMP_ACT_TRACE and SCMP_ACT_NOTIFY are refused: with no tracer
# or supervisor attached they only return ENOSYS, and a supervisor would be a host
# process deciding on the sandbox's behalf, which stockade does not provide. Observe
# mode (linux/seccomp/observe.py) notifies with a filter of its own, never a profile's.
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
    "SCMP_ACT_NOTIFY": ("is reserved to observe mode (`stockade run --observe`), whose own filter notifies its "
                        "supervisor and always lets the call continue; a profile cannot ask for it"),
}
PERMISSIVE = {SECCOMP_RET_ALLOW, SECCOMP_RET_LOG}

_OPS: dict[str, int] = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}


@dataclass(frozen=True)
class Cmp:
    index: int
    op: int
    a: int
    b: int


@dataclass(frozen=True)
class _Rule:
    where: str  # "syscalls[3]" for messages
    names: tuple[str, ...]
    action: int  # full SECCOMP_RET_* value, errno folded in
    args: tuple[Cmp, ...]


@dataclass
class Profile:
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


def profile_error(path: Path, where: str, msg: str) -> PolicyError:
    return PolicyError(f"seccomp profile {path}: {where}: {msg}")


def _errno_value(path: Path, where: str, raw: object) -> int:
    if isinstance(raw, str):
        val = getattr(_errno, raw, None)
        if not isinstance(val, int):
            raise profile_error(path, where, f"unknown errno name {raw!r}")
        return val
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= 4095:
        raise profile_error(
            path, where, f"must be an errno number 0..4095 or a name like 'EPERM', not {raw!r}"
        )
    return raw


def _action(
    path: Path, where: str, raw: object, errno_raw: object, errno_where: str, default_errno: int
) -> int:
    if not isinstance(raw, str):
        raise profile_error(path, where, f"must be a string like 'SCMP_ACT_ALLOW', not {raw!r}")
    if raw in _REFUSED_ACTIONS:
        raise profile_error(path, where, f"{raw} is not supported: it {_REFUSED_ACTIONS[raw]}")
    base = _ACTIONS.get(raw)
    if base is None:
        raise profile_error(
            path, where, f"unknown action {raw!r} (expected one of {', '.join(sorted(_ACTIONS))})"
        )
    if base == SECCOMP_RET_ERRNO:
        eno = default_errno if errno_raw is None else _errno_value(path, errno_where, errno_raw)
        return SECCOMP_RET_ERRNO | eno
    if errno_raw is not None:
        raise profile_error(path, errno_where, f"only valid with SCMP_ACT_ERRNO, not {raw}")
    return base


def _u64(path: Path, where: str, raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not -(1 << 63) <= raw < (1 << 64):
        raise profile_error(path, where, f"must be an integer in the 64-bit range, not {raw!r}")
    return raw & 0xFFFFFFFFFFFFFFFF


def action_name(action: int) -> str:
    base = action & SECCOMP_RET_ACTION_FULL
    if base == SECCOMP_RET_ERRNO:
        eno = action & SECCOMP_RET_DATA
        return f"SCMP_ACT_ERRNO({_errno.errorcode.get(eno, eno)})"
    for name, val in _ACTIONS.items():
        if val == base and name != "SCMP_ACT_KILL":
            return name
    return hex(action)


def parse_profile(path: Path, data: bytes) -> Profile:
    lib = libseccomp()
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise profile_error(path, "JSON", str(exc)) from exc
    if not isinstance(doc, dict):
        raise profile_error(path, "top level", "must be a JSON object")
    for key in doc:
        if key not in _TOP_KEYS:
            raise profile_error(path, key, f"unknown field (known: {', '.join(sorted(_TOP_KEYS))})")
    desc = doc.get("description", "")
    if not isinstance(desc, str):
        raise profile_error(path, "description", "must be a string")
    if "defaultAction" not in doc:
        raise profile_error(path, "defaultAction", "missing")
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
        raise profile_error(path, "architectures", "must be a non-empty list like ['SCMP_ARCH_NATIVE']")
    arches: list[int] = []
    for i, an in enumerate(arch_names):
        tok = lib.arch_token(an) if isinstance(an, str) else None
        if tok is None:
            raise profile_error(path, f"architectures[{i}]", f"unknown architecture {an!r}")
        if tok not in arches:
            arches.append(tok)
    if lib.native not in arches:
        raise profile_error(
            path,
            "architectures",
            f"does not include this machine's architecture ({platform.machine()}); "
            "list SCMP_ARCH_NATIVE",
        )

    prof = Profile(path, desc, default_action, str(doc["defaultAction"]), arches)
    rules = doc.get("syscalls", [])
    if not isinstance(rules, list):
        raise profile_error(path, "syscalls", "must be a list")
    for i, r in enumerate(rules):
        where = f"syscalls[{i}]"
        if not isinstance(r, dict):
            raise profile_error(path, where, "must be an object")
        for key in r:
            if key not in _RULE_KEYS:
                raise profile_error(
                    path,
                    f"{where}.{key}",
                    f"unknown field (known: {', '.join(sorted(_RULE_KEYS))})",
                )
        names = r.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise profile_error(path, f"{where}.names", "must be a non-empty list of syscall names")
        for j, n in enumerate(names):
            if lib.resolve(n) is None:
                raise profile_error(
                    path, f"{where}.names[{j}]", f"unknown syscall {n!r} (libseccomp {lib.version})"
                )
        if "action" not in r:
            raise profile_error(path, f"{where}.action", "missing")
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
            raise profile_error(path, f"{where}.args", "must be a list of {index, value, valueTwo, op}")
        cmps: list[Cmp] = []
        for k, a in enumerate(raw_args):
            aw = f"{where}.args[{k}]"
            if not isinstance(a, dict):
                raise profile_error(path, aw, "must be an object {index, value, valueTwo, op}")
            for key in a:
                if key not in _ARG_KEYS:
                    raise profile_error(
                        path,
                        f"{aw}.{key}",
                        f"unknown field (known: {', '.join(sorted(_ARG_KEYS))})",
                    )
            idx = a.get("index")
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx <= 5:
                raise profile_error(path, f"{aw}.index", f"must be an argument index 0..5, not {idx!r}")
            if any(c.index == idx for c in cmps):
                raise profile_error(
                    path,
                    f"{aw}.index",
                    f"a second comparison on argument {idx} in one rule (libseccomp cannot AND "
                    "them); write a separate rule",
                )
            op = a.get("op")
            if not isinstance(op, str) or op not in _OPS:
                raise profile_error(
                    path, f"{aw}.op", f"unknown operator {op!r} (expected one of {', '.join(_OPS)})"
                )
            if "value" not in a:
                raise profile_error(path, f"{aw}.value", "missing")
            va = _u64(path, f"{aw}.value", a["value"])
            vb = _u64(path, f"{aw}.valueTwo", a.get("valueTwo", 0))
            cmps.append(Cmp(idx, _OPS[op], va, vb))
        prof.rules.append(_Rule(where, tuple(names), action, tuple(cmps)))
    return prof
