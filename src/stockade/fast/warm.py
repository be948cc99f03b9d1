"""Prepared runs kept on disk, for the CLI: the core's prepared-run cache hook
(``core.prepare.PreparedCache``), installed by the CLI (``CACHE``; ``STOCKADE_WARM=0``: not).

Every ``stockade run`` is a new process, so the caches of ``stockade.core.prepare`` start
empty and each command would load the policy, filter the environment, compile the
seccomp profile, detect the cgroup backend and build the plan again (and import
everything that takes). Instead, after preparing a run the core hands this cache what
the policy step made of the options (``core.prepare.Resolved``: the plan's inputs,
limits, audit facts) with everything it came from (``Deps``); it is stored under
``<state>/cache/warm-<key>.bin``, and a later command with the same options reuses it
when all of that still holds, checked as the in-process caches check it:

* the policy's tier files (stat), the directories on the way to every path the
  policy resolved (identity and mtime), the existence of granted paths;
* the secret scan: each directory of every visible tree (inode and mtime), and the
  denied paths inside them;
* the environment (a digest: no value is written down), the working directory,
  the user and group ids, the hard rlimits the plan's are clamped to;
* /etc (its directory, and each file copied into the sandbox), /etc/passwd and
  /etc/group, the project's owner, the seccomp profile file, the Landlock ABI,
  this process's cgroups;
* the code that prepares runs (its source files, the Python version, libseccomp).

Anything that cannot be checked that way (a file changed within the timestamp
granularity, a directory of a tree changed so recently that a scan would list it
again, conditional secret files, command rules, a seccomp profile given as a
path) means no entry is written, and the run is prepared in full. The core builds
each run's plan from what is loaded, with the session's own layers (snapshots, the
mask layer) and the command.

Only os, marshal, the blake2 digest and ``stockade.pathsig`` are imported to check
an entry.
"""

from __future__ import annotations

import marshal
import os

from ..pathsig import file_sig as _sig
from ..pathsig import paths_hold

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..core.prepare import CacheKey, Resolved
    from ..session.store import Session

VERSION = 3  # 2: inputs.forward, net; 3: inputs.tmpfs_size
# Entries decoded ahead by a CLI server (``preload``), for the supervisors it forks:
# path -> (the file's signature, its data, a plan of its base (``core.prepare.base_plan``),
# limits and manager).
_preloaded: dict[str, tuple[Any, dict[str, Any], Any, Any, Any]] = {}
_resolved: dict[str, Resolved] = {}  # path -> its decoded Resolved (as _preloaded)
last_path: str | None = None  # the entry this process last loaded or stored
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the stockade package


def _digest(data: bytes) -> str:
    try:
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - a Python without the builtin module
        from hashlib import blake2b
    return blake2b(data, digest_size=16).hexdigest()


def _env_digest() -> str:
    raw = getattr(os.environ, "_data", None)
    items = sorted(raw.items()) if isinstance(raw, dict) else sorted((os.fsencode(k), os.fsencode(v)) for k, v in os.environ.items())
    return _digest(b"\0".join(k + b"=" + v for k, v in items))


def _code() -> tuple[Any, ...]:
    import sys

    from ..core.prepare import code_files

    return (sys.hexversion, marshal.version, _libseccomp(), *(_sig(os.path.join(_PKG, f)) for f in ("fast/warm.py", *code_files())))


def _libseccomp() -> tuple[Any, ...] | None:
    """The library that compiled the seccomp filter (as linux/seccomp.py finds it)."""
    machine = os.uname().machine
    for d in (f"/usr/lib/{machine}-linux-gnu", f"/lib/{machine}-linux-gnu", "/usr/lib64", "/lib64", "/usr/lib", "/lib"):
        sig = _sig(f"{d}/libseccomp.so.2")
        if sig is not None:
            return sig
    return None


def _proc_cgroup() -> bytes:
    try:
        from ..paths import proc_cgroup_path

        with open(proc_cgroup_path(), "rb") as f:
            return f.read()
    except OSError:
        return b""


def path_for(key: tuple[Any, ...]) -> str:
    from ..paths import state_dir

    return os.path.join(state_dir(), "cache", f"warm-{_digest(marshal.dumps(key))}.bin")


# --------------------------------------------------------------------------- plans as data


def _enc(v: Any) -> Any:
    if hasattr(v, "__dataclass_fields__"):
        return ("\0dc", type(v).__name__, {k: _enc(getattr(v, k)) for k in v.__dataclass_fields__})
    if isinstance(v, tuple):
        return tuple(_enc(x) for x in v)
    if isinstance(v, list):
        return [_enc(x) for x in v]
    if isinstance(v, dict):
        return {k: _enc(x) for k, x in v.items()}
    return v


def _dec(v: Any, ns: Any) -> Any:
    if isinstance(v, tuple):
        if len(v) == 3 and v[0] == "\0dc":
            cls = getattr(ns, v[1])
            return cls(**{k: _dec(x, ns) for k, x in v[2].items()})
        return tuple(_dec(x, ns) for x in v)
    if isinstance(v, list):
        return [_dec(x, ns) for x in v]
    if isinstance(v, dict):
        return {k: _dec(x, ns) for k, x in v.items()}
    return v


def _manager_desc(m: Any) -> Any:
    from ..cgroups.hybrid import HybridManager
    from ..cgroups.none import NoneManager
    from ..cgroups.v1 import V1Manager
    from ..cgroups.v2 import V2Manager

    t = type(m)
    if t is V1Manager:
        return ("v1", {c: (tuple(sorted(h.controllers)), h.own_dir, h.own_rel) for c, h in m.hierarchies.items()}, m.note)
    if t is V2Manager:
        return ("v2", m.parent, tuple(sorted(m.controllers)), m.rel_parent, m.note)
    if t is HybridManager:
        a, b = _manager_desc(m.v2), _manager_desc(m.v1)
        return None if a is None or b is None else ("hybrid", a, b)
    if t is NoneManager:
        return ("none", m.reason, m.nproc_safe)
    return None


def _manager(desc: Any) -> Any:
    kind = desc[0]
    if kind == "v1":
        from ..cgroups.v1 import Hierarchy, V1Manager

        hs: dict[str, Hierarchy] = {}
        made: dict[tuple[Any, ...], Hierarchy] = {}
        for c, h in desc[1].items():
            if h not in made:  # co-mounted controllers share one Hierarchy
                made[h] = Hierarchy(controllers=frozenset(h[0]), own_dir=h[1], own_rel=h[2])
            hs[c] = made[h]
        return V1Manager(hierarchies=hs, note=desc[2])
    if kind == "v2":
        from ..cgroups.v2 import V2Manager

        return V2Manager(parent=desc[1], controllers=frozenset(desc[2]), rel_parent=desc[3], note=desc[4])
    if kind == "hybrid":
        from ..cgroups.hybrid import HybridManager

        return HybridManager(_manager(desc[1]), _manager(desc[2]))
    from ..cgroups.none import NoneManager

    return NoneManager(reason=desc[1], nproc_safe=desc[2])


# --------------------------------------------------------------------------- save


def save(key: CacheKey, resolved: Resolved) -> bool:
    """Write the entry for ``key`` after a full preparation; False when it cannot be
    revalidated later (nothing is written then)."""
    dep = resolved.deps
    manager = _manager_desc(resolved.cg_manager)
    if dep is None or manager is None:
        return False
    i = resolved.inputs
    a = resolved.audit
    pol = a.policy
    data = {
        "version": VERSION,
        "deps": {
            "code": _code(),
            "env": _env_digest(),
            "cwd": os.getcwd(),
            "ids": (os.geteuid(), os.getegid()),
            "cgroup": _proc_cgroup(),
            "policy_files": dep.policy_files,
            "session_policy": dep.session_policy,
            "policy_dirs": dict(dep.policy_dirs),
            "policy_resolved": dep.policy_resolved,
            "policy_exists": dep.policy_exists,
            "scans": dict(dep.scans),
            "etc": dep.etc,
            "passwd": dep.passwd,
            "owner": dep.owner,
            "seccomp": dep.seccomp,
            "rlimits": dep.rlimits,
            "landlock": dep.landlock,
        },
        # the command is no part of it: a cache is no record to keep secrets in
        "inputs": {**{f: getattr(i, f) for f in _INPUT_FIELDS}, "project": str(i.project), "cwd": str(i.cwd),
                   "env": tuple(i.env.items())},
        "manager": manager,
        "limits": _enc(resolved.limits),
        "timeout": resolved.timeout,
        # the run's network policy, as data (policy.network rebuilds it; its rules are re-checked)
        "net": None if resolved.net is None else resolved.net.to_json(),
        "audit": {
            "digest": pol.digest,
            "files": tuple(tuple(f) for f in pol.files),
            "read_only": bool(pol.read_only),
            "warnings": tuple(pol.warnings),
            "masked": tuple((str(x.path), bool(x.is_dir), x.rule, x.source, x.origin, bool(x.is_symlink)) for x in a.masked),
            "removed": a.removed,
            "run_read_only": a.read_only,
            "project": a.project,
            "unenforced": a.unenforced,
        },
    }
    path = path_for(key)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, marshal.dumps(data))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except (OSError, ValueError):
        return False
    global last_path
    last_path = path
    return True


# PlanInputs' fields kept as they are (marshal-able); project, cwd and env are converted
_INPUT_FIELDS = (
    "root", "user", "read_only", "network", "forward", "keep_fds", "masked", "grants", "exec_allow", "etc_extra", "landlock",
    "seccomp_name", "seccomp_bpf", "rlimits", "degraded", "mask_items", "mask_mode", "tmpfs_size",
)


# --------------------------------------------------------------------------- load


def _deps_hold(d: dict[str, Any]) -> bool:
    if d["ids"] != (os.geteuid(), os.getegid()) or d["cwd"] != os.getcwd() or d["env"] != _env_digest():
        return False
    if d["code"] != _code() or d["cgroup"] != _proc_cgroup():
        return False
    for f, s in d["policy_files"]:
        if _sig(f) != s:
            return False
    if not paths_hold(d["policy_dirs"]):
        return False
    for raw, real in d["policy_resolved"]:
        if os.path.realpath(raw) != real:
            return False
    for p, e in d["policy_exists"]:
        if os.path.lexists(p) != e:
            return False
    for root, (dirs, deny_facts) in d["scans"].items():
        for rel, mtime, ino in dirs:
            try:
                st = os.lstat(f"{root}/{rel}" if rel else root)
            except OSError:
                return False
            if st.st_mtime_ns != mtime or st.st_ino != ino:
                return False
        for path, exists, is_link, is_dir in deny_facts:
            e = os.path.lexists(path)
            if e != exists or (e and (os.path.islink(path) != is_link or os.path.isdir(path) != is_dir)):
                return False
    etc_sig, files = d["etc"]
    try:
        st = os.stat("/etc")
    except OSError:
        return False
    if (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != tuple(etc_sig):
        return False
    for path, sig in files:
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != tuple(sig):
            return False
    from ..core.prepare import passwd_sig

    if d["passwd"] != passwd_sig():
        return False
    if d["seccomp"] is not None and _sig(d["seccomp"][0]) != tuple(d["seccomp"][1]):
        return False
    import resource

    return all(resource.getrlimit(r)[1] == h for r, h in d["rlimits"])


class _Policy:
    """What the run's audit events need of the policy."""

    __slots__ = ("digest", "files", "read_only", "warnings")

    def __init__(self, a: dict[str, Any]) -> None:
        self.digest = a["digest"]
        self.files = [tuple(x) for x in a["files"]]
        self.read_only = a["read_only"]
        self.warnings = list(a["warnings"])


class _Masked:
    __slots__ = ("is_dir", "is_symlink", "origin", "path", "rule", "source")

    def __init__(self, path: str, is_dir: bool, rule: str, source: str, origin: str, is_symlink: bool) -> None:
        from pathlib import Path

        self.path, self.is_dir, self.rule, self.source, self.origin, self.is_symlink = Path(path), is_dir, rule, source, origin, is_symlink


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            data = marshal.loads(f.read())
    except (OSError, ValueError, EOFError, TypeError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return None
    return data


def _decoded(data: dict[str, Any]) -> Resolved:
    from pathlib import Path

    from ..cgroups import base as cgbase
    from ..core.prepare import AuditFacts, PlanInputs, Resolved

    i = data["inputs"]
    inputs = PlanInputs(project=Path(i["project"]), cwd=Path(i["cwd"]), env=dict(i["env"]),
                        **{f: i[f] for f in _INPUT_FIELDS})
    a = data["audit"]
    audit = AuditFacts(policy=_Policy(a), masked=tuple(_Masked(*m) for m in a["masked"]), removed=tuple(a["removed"]),
                       read_only=a["run_read_only"], project=a["project"], unenforced=tuple(a["unenforced"]))
    net = None
    if data.get("net") is not None:
        from ..policy.network import NetPolicy

        net = NetPolicy.from_json(data["net"])
    return Resolved(inputs, _manager(data["manager"]), _dec(data["limits"], cgbase), data["timeout"], audit, net=net)


def preload(path: str) -> Any:
    """Decode the entry at ``path`` now (its checks still run at every load);
    returns a plan of its base (for a launcher), or None."""
    sig = _sig(path)
    data = _read(path) if sig is not None else None
    if data is None:
        _preloaded.pop(path, None)
        _resolved.pop(path, None)
        return None
    from ..core.prepare import base_plan

    resolved = _decoded(data)
    _preloaded[path] = (sig, data, base_plan(resolved), resolved.limits, resolved.cg_manager)
    _resolved[path] = resolved
    while len(_preloaded) > 8:
        _resolved.pop(next(iter(_preloaded)), None)
        del _preloaded[next(iter(_preloaded))]
    return _preloaded[path][2]


def load(key: CacheKey, sess: Session) -> Resolved | None:
    """The stored preparation for ``key``, for a run in ``sess``, if it still holds."""
    global last_path
    path = last_path = path_for(key)
    pre = _preloaded.get(path)
    if pre is not None and _sig(path) == pre[0]:
        data = pre[1]
    else:
        pre = None
        got = _read(path)
        if got is None:
            return None
        data = got
    d = data["deps"]
    sp = d.get("session_policy")
    if sp is None:
        return None
    if sp[1] is None:
        if _sig(os.path.join(sess.dir, "policy.json")) is not None:
            return None
    elif sp[0] != str(sess.dir) or _sig(os.path.join(sess.dir, "policy.json")) != tuple(sp[1]):
        return None
    if not _deps_hold(d):
        return None
    from .. import plan as planmod

    if d["owner"] is not None:
        st = os.stat(data["audit"]["project"])
        if (st.st_uid, st.st_gid) != tuple(d["owner"]):
            return None
    if planmod.landlock_abi() != d["landlock"]:
        return None
    hit = _resolved.get(path) if pre is not None else None
    return hit if hit is not None else _decoded(data)


class _Cache:
    """``core.prepare.PreparedCache`` over this module's entries."""

    def load(self, key: CacheKey, sess: Session) -> Resolved | None:
        return load(key, sess)

    def save(self, key: CacheKey, resolved: Resolved) -> None:
        save(key, resolved)


CACHE = _Cache()
