"""`stockade doctor`: probe each kernel feature the sandbox relies on.

Each probe reports ``ok``, ``degraded`` or ``missing`` (``info`` for facts that
decide nothing) with a fix.  Probes that only depend on the boot and the caller
are cached in ``<state>/doctor.json`` (keyed by boot id, kernel release, uid and
state dir); the self-test sandbox always runs live.  The exit status is 0 only
when everything the default policy needs is present.

Live probes fork a child that unshares a user and mount namespace (no Python
threads are started, and the child only makes syscalls before ``os._exit``).

The network section (``--net allow`` and ``--forward``; the default ``--net none``
needs none of it) takes the steps net/netns.py's helper takes, for real: one child
makes a user and network namespace and brings lo up over netlink (pyroute2), a
sibling of this uid joins both with setns and binds 127.0.0.1:53 and :3128 there.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .linux import libc

CACHE_VERSION = 5
REQUIRED = ("userns", "proc", "hostname", "overlay", "landlock", "seccomp", "self-test")
NETWORK = "network"  # the section of the probes --net allow and --forward need

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_RDONLY = 1
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_GET_SECCOMP = 21
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000

APPARMOR_SYSCTL = "kernel/apparmor_restrict_unprivileged_userns"


@dataclass
class Probe:
    name: str
    status: str  # ok | degraded | missing | info
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    # for a failure: what the environment makes of it, and the environment seen
    # (the same words a run's error uses: linux/remedies.py)
    cause: str | None = None
    environment: str | None = None
    section: str | None = None  # NETWORK, or None: what every run needs

    @property
    def required(self) -> bool:
        return self.name in REQUIRED


@dataclass
class Report:
    probes: list[Probe]
    cached: bool = False

    @property
    def exit_status(self) -> int:
        return 1 if any(p.required and p.status == "missing" for p in self.probes) else 0

    def get(self, name: str) -> Probe | None:
        return next((p for p in self.probes if p.name == name), None)

    @property
    def network_missing(self) -> list[str]:
        return [p.name for p in self.probes if p.section == NETWORK and p.status == "missing"]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.exit_status == 0,
            "cached": self.cached,
            "network": {"ok": not self.network_missing, "missing": self.network_missing},
            "probes": [{**asdict(p), "required": p.required} for p in self.probes],
        }

    def format(self) -> str:
        out = []
        section = None
        for p in self.probes:
            if p.section != section:
                section = p.section
                if section == NETWORK:
                    out.append("network (--net allow and --forward; the default --net none needs none of it):")
            first, *more = p.detail.split("\n")
            out.append(f"{p.status.upper():<9} {p.name:<12} {first}")
            out.extend(f"{'':<22}{ln}" for ln in more)
            if p.cause and p.status != "ok" and p.cause not in p.detail:
                out.append(f"{'':<22}cause: {p.cause}")
            if p.fix and p.status != "ok":
                out.append(f"{'':<22}fix: {p.fix}")
        out.append("")
        if self.exit_status == 0:
            out.append("stockade can run with its default policy on this machine.")
        else:
            missing = [p.name for p in self.probes if p.required and p.status == "missing"]
            out.append("stockade cannot run with its default policy: missing " + ", ".join(missing) + ".")
        if self.network_missing:
            out.append("--net allow and --forward cannot run here: missing " + ", ".join(self.network_missing)
                       + " (--net none and --net host can).")
        return "\n".join(out)


# --------------------------------------------------------------------------- helpers


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def sysctls(proc: Path = Path("/proc")) -> dict[str, str | None]:
    names = (
        "kernel/unprivileged_userns_clone",
        "user/max_user_namespaces",
        APPARMOR_SYSCTL,
        "kernel/osrelease",
        "kernel/random/boot_id",
    )
    return {n: _read(proc / "sys" / n) for n in names}


def _child_result(fn: Any) -> dict[str, Any]:
    """Run ``fn()`` in a forked child; it returns a JSON-able dict via a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: syscalls only, then _exit
        try:
            os.close(r)
            try:
                res = fn()
            except OSError as e:
                res = {"ok": False, "errno": e.errno, "error": f"{e.strerror}", "step": getattr(e, "step", "")}
            except BaseException as e:  # report anything, never return into the parent's code
                res = {"ok": False, "errno": 0, "error": repr(e), "step": ""}
            os.write(w, json.dumps(res).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    os.waitpid(pid, 0)
    try:
        out: dict[str, Any] = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        out = {"ok": False, "error": "probe child died", "errno": 0, "step": ""}
    return out


class _StepError(OSError):
    step: str


def _check(rc: int, step: str) -> None:
    if rc != 0:
        e = libc.errno()
        err = _StepError(e, os.strerror(e))
        err.step = step
        raise err


def _enter_userns(other: int = CLONE_NEWNS) -> None:
    """unshare(NEWUSER|``other``), map the caller's ids to themselves... as root inside."""
    uid, gid = os.getuid(), os.getgid()
    names = "|".join(n for n, f in (("CLONE_NEWNS", CLONE_NEWNS), ("CLONE_NEWNET", CLONE_NEWNET)) if other & f)
    _check(libc.unshare(CLONE_NEWUSER | other), f"unshare(CLONE_NEWUSER|{names})")
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
    except FileNotFoundError:
        pass
    for name, line in (("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(line)
        except OSError as e:
            _check_errno(e.errno or 0, f"write /proc/self/{name}")
    if other & CLONE_NEWNS:
        _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount(/, MS_PRIVATE)")


# --------------------------------------------------------------------------- probes


def _env(proc: Path = Path("/proc")) -> Any:
    from .linux import remedies

    return remedies.detect(proc)


def _errno_of(live: dict[str, Any], default: int) -> int:
    import errno as E

    if live.get("errno"):
        return int(live["errno"])
    err = str(live.get("error") or "")
    return next((n for n, name in E.errorcode.items() if name in err.split()), default)


def analyze_userns(sc: dict[str, str | None], live: dict[str, Any], uid: int, env: Any = None) -> Probe:
    """Name the cause of a user-namespace failure from the sysctls and the environment
    (pure given ``env``; unit-tested); the words are a run's (linux/remedies.userns)."""
    import dataclasses
    import errno as E

    from .linux import remedies

    data = {"sysctls": {k: v for k, v in sc.items() if "userns" in k or "max_user" in k}, "live": live}
    env = dataclasses.replace(env or remedies.detect(), uid=uid,
                              max_user_namespaces=sc.get("user/max_user_namespaces"),
                              unprivileged_userns_clone=sc.get("kernel/unprivileged_userns_clone"),
                              apparmor_restrict=sc.get(APPARMOR_SYSCTL))
    where = env.describe()
    if live.get("ok"):
        detail = "user namespaces work (unshare + id map + mount)"
        if env.apparmor_restrict == "1" and uid != 0:
            detail += "; an AppArmor profile allows them for this interpreter"
        return Probe("userns", "ok", detail, None, data, environment=where)
    err = _errno_of(live, E.ENOSPC if env.max_user_namespaces == "0" else E.EPERM)
    step = live.get("step") or "unshare"
    rem = _remedy_for(step, err, env) or remedies.userns(err, env)
    return Probe("userns", "missing", f"{step}: {live.get('error') or 'failed'}: {rem.cause}", rem.fix, data,
                 cause=rem.cause, environment=where)


def probe_userns(proc: Path = Path("/proc")) -> list[Probe]:
    sc = sysctls(proc)

    def child() -> dict[str, Any]:
        _enter_userns()
        d = tempfile.mkdtemp(prefix="stockade-doctor-")
        try:
            _check(libc.mount(b"tmpfs", d.encode(), b"tmpfs", 0, b"size=16k"), f"mount tmpfs on {d}")
            libc.umount2(d.encode(), 0)
        finally:
            os.rmdir(d)
        return {"ok": True}

    live = _child_result(child)
    probes = [analyze_userns(sc, live, os.getuid())]
    # nested, uid 65534 is rarely mapped: setpriv could not become it to try
    if os.getuid() == 0 and not _env(proc).nested:
        unpriv = unprivileged_userns()
        if unpriv is not None:
            probes.append(unpriv)
    return probes


def _remedy_for(step: str, err: int, env: Any) -> Any:
    """The remedy for a step of the user-namespace set-up itself (None: not one of them):
    the namespace was made and a map or mount in it refused, which is that step's cause."""
    from .linux import remedies

    if step.startswith("unshare(CLONE_NEWUSER"):
        return remedies.userns(err, env)
    if step.startswith("write /proc/self/"):
        return remedies.id_map(err, env, step.rsplit("/", 1)[1])
    if step.startswith("mount(/, MS_PRIVATE)") or step.startswith("mount tmpfs"):
        return remedies.mount(err, env)
    return None


def _step_probe(name: str, what: str, live: dict[str, Any], remedy: Any, env: Any, *,
                failed: str = "missing") -> Probe:
    """A live step's result as a probe: on failure, the cause and fix a run's error gives."""
    where = env.describe()
    if live.get("ok"):
        return Probe(name, "ok", live.get("detail") or f"{what} works", None, {"live": live}, environment=where)
    err = int(live.get("errno") or 0)
    # no namespace to try the step in: the set-up step's own cause
    rem = _remedy_for(str(live.get("step") or ""), err, env) or remedy(err, env)
    import errno as E

    ename = E.errorcode.get(err, str(err))
    return Probe(name, failed, f"{live.get('step') or what}: {ename}: {rem.cause}", rem.fix, {"live": live},
                 cause=rem.cause, environment=where)


def _in_userns_child(fn: Any) -> dict[str, Any]:
    """``fn()`` in a throwaway child, inside a new user and mount namespace (as a run's)."""

    def child() -> dict[str, Any]:
        _enter_userns()
        return dict(fn())

    return _child_result(child)


def probe_clone3(env: Any = None) -> Probe:
    """clone3(CLONE_NEWUSER), the call a run starts with (container profiles answer
    ENOSYS so that callers fall back to clone)."""
    from .linux import remedies

    env = env or remedies.detect()

    def child() -> dict[str, Any]:
        pid = libc.clone3(CLONE_NEWUSER, 17)  # exit signal SIGCHLD
        if pid == 0:
            os._exit(0)
        _check(-1 if pid < 0 else 0, "clone3(CLONE_NEWUSER)")
        os.waitpid(int(pid), 0)
        return {"ok": True, "detail": "clone3 creates a user namespace"}

    live = _child_result(child)
    # ENOSYS: a run falls back to clone where the C core does; a weaker signal than EPERM
    import errno as E

    status = "degraded" if live.get("errno") == E.ENOSYS else "missing"
    return _step_probe("clone3", "clone3", live, remedies.userns, env, failed=status)


def probe_setgroups(env: Any = None) -> Probe:
    """setgroups(2), which a root caller's sandbox calls to drop supplementary groups."""
    from .linux import remedies

    env = env or remedies.detect()
    if os.geteuid() != 0:
        return Probe("setgroups", "ok", "not needed: an unprivileged caller's sandbox maps its own id only, "
                     "setgroups denied", None, environment=env.describe())

    def child() -> dict[str, Any]:
        try:
            os.setgroups(os.getgroups())
        except OSError as e:
            err = _StepError(e.errno, e.strerror)
            err.step = "setgroups"
            raise err from None
        return {"ok": True, "detail": f"setgroups works (/proc/self/setgroups: {env.setgroups or '?'})"}

    # a refusal leaves runs working with one id and the caller's groups: degraded, not missing
    return _step_probe("setgroups", "setgroups", _child_result(child), remedies.setgroups, env, failed="degraded")


def probe_proc(env: Any = None) -> Probe:
    """A new procfs in a new user and PID namespace (the sandbox's /proc)."""
    from .linux import remedies

    env = env or remedies.detect()

    def fn() -> dict[str, Any]:
        _check(libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
        d = tempfile.mkdtemp(prefix="stockade-doctor-proc-")
        try:
            pid = os.fork()
            if pid == 0:  # the new PID namespace's first process
                rc = libc.mount(b"proc", d.encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
                err = libc.errno()
                if rc == 0:
                    libc.umount2(d.encode(), 2)  # MNT_DETACH: the dir is removed next
                os._exit(0 if rc == 0 else min(err, 255))
            _pid, status = os.waitpid(pid, 0)
        finally:
            os.rmdir(d)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            _check_errno(code, "mount proc")
        return {"ok": True, "detail": "a new procfs mounts in a new user and PID namespace"}

    return _step_probe("proc", "mount proc", _in_userns_child(fn), remedies.proc, env)


def probe_hostname(env: Any = None) -> Probe:
    """sethostname in a new UTS namespace (the sandbox's hostname)."""
    from .linux import remedies

    env = env or remedies.detect()

    def fn() -> dict[str, Any]:
        _check(libc.unshare(CLONE_NEWUTS), "unshare(CLONE_NEWUTS)")
        _check(libc.sethostname(b"stockade-doctor"), "sethostname")
        return {"ok": True, "detail": "sethostname works in a new UTS namespace"}

    return _step_probe("hostname", "sethostname", _in_userns_child(fn), remedies.hostname, env)


def _check_errno(err: int, step: str) -> None:
    e = _StepError(err, os.strerror(err))
    e.step = step
    raise e


def unprivileged_userns() -> Probe | None:
    """As root: can an unprivileged user (nobody) create a user namespace? Info only."""
    setpriv = shutil.which("setpriv")
    unshare = shutil.which("unshare")
    if not setpriv or not unshare:
        return None
    import subprocess

    try:
        p = subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", unshare, "-Urm", "true"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    sc = sysctls()
    if p.returncode == 0:
        return Probe("userns-user", "info", "unprivileged users can create user namespaces")
    cause = analyze_userns(sc, {"ok": False, "step": "unshare -Urm", "error": p.stderr.strip()[:200]}, 65534)
    return Probe("userns-user", "info", "unprivileged users cannot: " + cause.detail, cause.fix)


def probe_overlay(state: Path) -> Probe:
    """Overlay mounted inside a user namespace, upper on the state dir's filesystem."""
    try:
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
        base = Path(tempfile.mkdtemp(prefix=".doctor-overlay-", dir=state))
    except OSError as e:
        return Probe("overlay", "missing", f"cannot create a probe dir in {state}: {e.strerror}",
                     "set STOCKADE_STATE_DIR to a writable directory")
    from .linux import remedies

    fstype = remedies.fstype(str(state.resolve()))
    try:
        for d in ("lower", "upper", "work", "merged"):
            (base / d).mkdir()
        (base / "lower" / "a").write_text("a")
        (base / "lower" / "b").write_text("b")

        def child() -> dict[str, Any]:
            _enter_userns()
            opts = f"lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work"
            used = ""
            for extra in (",userxattr", ""):
                if libc.mount(b"overlay", f"{base}/merged".encode(), b"overlay", 0, (opts + extra).encode()) == 0:
                    used = extra.lstrip(",") or "default"
                    break
            else:
                _check(-1, "mount overlay")
            (base / "merged" / "c").write_text("c")
            whiteout = True
            try:
                os.unlink(base / "merged" / "a")
            except OSError:
                whiteout = False
            libc.umount2(f"{base}/merged".encode(), 0)
            return {"ok": True, "options": used, "whiteout": whiteout}

        res = _child_result(child)
        upper_ok = (base / "upper" / "c").is_file()
        wh = base / "upper" / "a"
        whiteout = bool(res.get("whiteout")) and os.path.lexists(wh)
    finally:
        _rmtree(base)
    data = {"fstype": fstype, **res}
    if not res.get("ok"):
        from .linux import remedies

        env = remedies.detect()
        err = int(res.get("errno") or 0)
        rem = _remedy_for(str(res.get("step") or ""), err, env) or remedies.overlay(err, env, str(state))
        return Probe("overlay", "missing",
                     f"{res.get('step') or 'mount overlay'} on {fstype} ({state}): {res.get('error')}: {rem.cause}",
                     rem.fix, data, cause=rem.cause, environment=env.describe())
    if not upper_ok:
        return Probe("overlay", "missing", "overlay mounted but writes did not reach the upper dir", None, data)
    if not whiteout:
        return Probe("overlay", "degraded",
                     f"overlay works on {fstype} but deleting a lower file failed (no whiteouts)",
                     "use a newer kernel (5.11+) or an ext4/xfs state dir", data)
    return Probe("overlay", "ok", f"overlay in a user namespace works on {fstype} ({state}; options: {res.get('options')})",
                 None, data)


def landlock_abi() -> tuple[int, int]:
    """(ABI version or -1, errno)."""
    rc = libc.landlock_abi_version()
    return (rc, 0) if rc >= 0 else (-1, libc.errno())


def analyze_landlock(abi: int, err: int, lsm: str | None) -> Probe:
    data = {"abi": abi, "lsm": lsm}
    if abi < 1:
        from .linux import remedies

        env = remedies.detect()
        rem = remedies.landlock(err, env)
        return Probe("landlock", "missing", rem.cause, rem.fix, data, cause=rem.cause, environment=env.describe())
    feats = ["fs"]
    if abi >= 2:
        feats.append("refer")
    if abi >= 3:
        feats.append("truncate")
    if abi >= 4:
        feats.append("tcp")
    if abi >= 5:
        feats.append("ioctl-dev")
    if abi >= 6:
        feats.append("scopes")
    if abi < 3:
        return Probe("landlock", "degraded", f"ABI {abi} ({', '.join(feats)}): truncate is not restricted",
                     "a 6.2+ kernel gives ABI 3", data)
    return Probe("landlock", "ok", f"ABI {abi} ({', '.join(feats)})", None, data)


def probe_landlock() -> Probe:
    abi, err = landlock_abi()
    return analyze_landlock(abi, err, _read(Path("/sys/kernel/security/lsm")))


def probe_seccomp() -> Probe:
    mode = libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0)
    data: dict[str, Any] = {"mode": mode}
    rc = libc.seccomp_action_avail(SECCOMP_RET_KILL_PROCESS)
    avail = None if rc is None else rc == 0
    if avail is not None:
        data["kill_process"] = avail
    lib = ctypes.util.find_library("seccomp")
    data["libseccomp"] = lib
    if mode < 0:
        return Probe("seccomp", "missing", "the kernel has no seccomp (CONFIG_SECCOMP)",
                     "use a kernel built with CONFIG_SECCOMP_FILTER", data)
    if avail is False:
        return Probe("seccomp", "missing", "seccomp filters are unavailable (SECCOMP_GET_ACTION_AVAIL failed)",
                     "use a kernel built with CONFIG_SECCOMP_FILTER", data)
    if lib is None:
        return Probe("seccomp", "missing", "libseccomp.so.2 not found (profiles are compiled with it)",
                     "sudo apt-get install libseccomp2 (dnf install libseccomp)", data)
    note = " (this process already runs under a filter)" if mode == 2 else ""
    return Probe("seccomp", "ok", f"filters available, {lib}{note}", None, data)


SECCOMP_RET_USER_NOTIF = 0x7FC00000


def landlock_audit_line(abi: int) -> tuple[str, bool]:
    """What `run --observe` gets of Landlock's own denial records here, and whether it
    reads them (linux/audit_netlink.py says why not)."""
    from .linux.audit_netlink import unavailable

    why = unavailable(abi)
    if why is None:
        return ("Landlock denial audit: yes, used by observe mode (ABI 7, kernel audit on, root): each run's "
                "Landlock denials come from the kernel's own records (basis kernel in `stockade log --observed`), "
                "and its end is marked by one record of stockade's in the host's audit log (type TRUSTED_APP, "
                "'stockade observe: end of run')"), True
    off = "kernel audit is off" in why
    return (f"Landlock denial audit: no ({why})" + ("" if off or abi < 7 else
            "; observe mode predicts Landlock's denials from the plan instead")
            + ("; observe mode uses them once it is on (stockade never turns it on itself)" if off else "")), False


def probe_observe() -> Probe:
    """`run --observe`: seccomp user notification (answered CONTINUE, Linux 5.5+), and
    whether Landlock's own denial records (kernel audit, Landlock ABI 7, Linux 6.15+)
    could add the denials seccomp cannot see. Informational: no run needs it."""
    from .cgroups.rlimit import kernel_version
    from .linux.seccomp.observe import supported

    data: dict[str, Any] = {}
    rel = kernel_version()
    rc = libc.seccomp_action_avail(SECCOMP_RET_USER_NOTIF)
    arch = supported()
    if arch is not None:
        seccomp_line, ok = f"observe via seccomp: no ({arch})", False
    elif rc is not None and rc != 0:
        seccomp_line, ok = "observe via seccomp: no (the kernel has no SECCOMP_RET_USER_NOTIF)", False
    elif rel < (5, 5):
        seccomp_line, ok = f"observe via seccomp: no (Linux {os.uname().release}: CONTINUE needs 5.5+)", False
    else:
        mode = libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0)
        seccomp_line, ok = "observe via seccomp: yes (user notification, answered CONTINUE)", True
        # what each observed call costs here (the run's observed-summary says what it got)
        if rel >= (6, 11):
            seccomp_line += ("; each call is handed over on one CPU and the loop waits in the receive "
                             "(Linux 6.11+: the cheapest round trip)")
        elif rel >= (6, 6):
            seccomp_line += "; each call is handed over on one CPU (Linux 6.6+), the loop polls before each receive"
        else:
            seccomp_line += (f"; Linux {os.uname().release} has no synchronous hand-over (6.6+): each call wakes "
                             "the supervisor on another CPU and back, several times the cost per call")
        data["observe_wakeup"] = "same-cpu" if rel >= (6, 6) else "usual"
        scope = _read(Path("/proc/sys/kernel/yama/ptrace_scope"))
        if scope is not None and scope.strip() in ("2", "3") and os.geteuid() != 0:
            seccomp_line += (f"; but Yama's ptrace_scope={scope.strip()} keeps an unprivileged supervisor from "
                             "reading a process's memory: paths and addresses are logged as unreadable (run as root, "
                             "or sysctl kernel.yama.ptrace_scope=1)")
        if mode == 2:
            seccomp_line += "; this process already runs under a filter: a listener above it would refuse ours (EBUSY)"
    data["seccomp"] = ok
    abi, _err = landlock_abi()
    ll, data["landlock_audit"] = landlock_audit_line(abi)
    data.update({"landlock_abi": abi, "kernel_audit": os.path.exists("/proc/self/loginuid"), "root": os.geteuid() == 0})
    return Probe("observe", "ok" if ok else "info", seccomp_line + "\n" + ll, None, data)


def probe_cgroups() -> Probe:
    import importlib

    try:
        det: Any = importlib.import_module("stockade.cgroups.detect")
    except ImportError:
        return Probe("cgroups", "degraded", "cgroup detection is not installed; limits use rlimits only")
    try:
        d = det.detection()
    except Exception as e:  # a forced, unusable backend is an error worth showing, not a crash
        return Probe("cgroups", "missing", str(e), "unset STOCKADE_CGROUP or fix the delegation")
    kind = getattr(d.manager, "kind", "unknown")
    try:
        desc = d.manager.describe()
    except Exception:  # describe is informational
        desc = {}
    data = {"kind": kind, "reasons": list(d.reasons), "describe": {k: str(v) for k, v in desc.items()}}
    if kind == "none":
        from .linux import remedies

        env = remedies.detect()
        # the command is the user's: a run's refusal repeats the one it was given
        rem = remedies.cgroup_delegation(env, "stockade run -- <command>")
        return Probe("cgroups", "degraded",
                     # each reason whole, one a line (a cut at a length garbled the last one)
                     "no delegated cgroup: memory/pids/CPU limits fall back to rlimits"
                     + "".join(f"\n- {r}" for r in d.reasons),
                     rem.fix, data, cause=rem.cause, environment=env.describe())
    return Probe("cgroups", "ok", f"backend {kind}", None, data)


def probe_disk(state: Path) -> Probe:
    """How --disk is held on this host: tmpfs caps, and for the layers a project quota
    where the state dir's filesystem and our privileges allow one, else a watchdog."""
    from .core import diskwatch
    from .explain import disk_mechanism_of

    mp, fstype, opts = diskwatch.filesystem_of(str(state))
    line, how = disk_mechanism_of(str(state), free=False)
    return Probe("disk", "info", line, data={"mount": mp, "fstype": fstype, "options": opts, "mechanism": how})


def probe_environment(proc: Path = Path("/proc"), root: Path = Path("/")) -> Probe:
    """What this process runs in: every fix above is chosen for it."""
    from .linux import remedies

    env = remedies.detect(proc, root)
    return Probe("environment", "info", env.describe(), data=env.to_json(), environment=env.describe())


def probe_capabilities() -> Probe:
    try:
        import prctl  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        status = _read(Path("/proc/self/status")) or ""
        caps = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in status.splitlines() if ln.startswith("Cap")}
        return Probe("capabilities", "info", f"effective {caps.get('CapEff', '?')} (python-prctl not installed)",
                     data={"caps": caps})
    eff = _prctl_caps(prctl, prctl.cap_effective)
    bnd = _prctl_caps(prctl, prctl.capbset)
    nnp = bool(prctl.get_no_new_privs())
    detail = f"uid {os.getuid()}, {len(eff)} effective capabilities, {len(bnd)} in the bounding set"
    if nnp:
        detail += ", no_new_privs already set"
    return Probe("capabilities", "info", detail, data={"effective": eff, "bounding": len(bnd), "no_new_privs": nnp})


def _prctl_caps(prctl: Any, capset: Any) -> list[str]:
    out = []
    for full in prctl.ALL_CAP_NAMES:
        name = str(full).lower().removeprefix("cap_")
        if name == "last_cap":
            continue
        try:
            if getattr(capset, name) is True:
                out.append(name)
        except (OSError, AttributeError, TypeError, ValueError):
            continue
    return out


def probe_id_range(etc: Path = Path("/etc"), proc: Path = Path("/proc"), euid: int | None = None) -> Probe:
    """Which ids exist inside a sandbox (linux/idmap.py): a range, where from, or why
    none and what that breaks."""
    from .linux import idmap

    uid = os.geteuid() if euid is None else euid
    ur, gr, why = idmap.ranges(uid, etc=etc, proc=proc)
    if ur and gr:
        how = f", written by {ur.helper}" if ur.helper else ""
        return Probe("id range", "ok",
                     f"65536 ids inside: host uids {ur.start}+id and gids {gr.start}+id (from {ur.source}{how}); "
                     "root inside (--root, or a real root's own project) keeps chown/setuid/setgid capabilities "
                     "in its own namespace", None,
                     {"mapped": "range", "uid_start": ur.start, "gid_start": gr.start, "source": ur.source,
                      "helper": ur.helper})
    if uid == 0:
        fix = "run from the host's own user namespace to get a range of ids inside"
    elif "newuidmap" in why:
        fix = "apt-get install uidmap (newuidmap/newgidmap)"
    else:
        fix = (f"add a range for this user, as root: usermod --add-subuids 100000-165535 --add-subgids 100000-165535 "
               f"{_user_name(uid)} (any free block of 65536 ids); or run without --root, or pass tar --no-same-owner")
    return Probe("id range", "info",
                 f"none ({why}) — only the sandbox user's id is mapped inside: chown to another id and "
                 "setuid/setgid give EINVAL, setgroups EPERM (GNU tar as root exits 2)",
                 fix, {"mapped": "single", "why": why, "newuidmap": shutil.which("newuidmap")})


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def probe_apparmor(proc: Path = Path("/proc")) -> Probe:
    aa = _read(proc / "sys" / APPARMOR_SYSCTL)
    enabled = _read(Path("/sys/module/apparmor/parameters/enabled"))
    data = {"restrict_unprivileged_userns": aa, "enabled": enabled}
    if aa == "1":
        return Probe("apparmor", "info", "restricts unprivileged user namespaces",
                     "stockade doctor --apparmor > /etc/apparmor.d/stockade && sudo apparmor_parser -r /etc/apparmor.d/stockade",
                     data)
    return Probe("apparmor", "info", "enabled" if enabled == "Y" else "not enabled or no userns restriction", None, data)


def closed_dir(path: str) -> str | None:
    """The first directory on the way to ``path`` that other users cannot enter."""
    d = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            if not os.stat(d).st_mode & 0o001:
                return d
        except OSError:
            return d
        if d == "/":
            return None
        d = os.path.dirname(d)


def probe_interpreter(python: str | None = None) -> Probe:
    """A venv runs the interpreter it was made from: under a 0700 home (a pyenv), no
    other user (uid 65534, `--user`, a CI build user) can start this stockade."""
    exe = os.path.realpath(python or sys.executable)
    closed = closed_dir(exe)
    if closed is None:
        return Probe("interpreter", "info", f"{exe} (other users can run it)")
    return Probe("interpreter", "info", f"{exe} is under {closed}, which other users cannot enter: "
                 "only its owner can run this stockade",
                 "build a venv from a system interpreter: make clean && PYTHON=/usr/bin/python3 make run",
                 {"closed": closed})


# --------------------------------------------------------------------------- network


CONNECTOR = Path(__file__).resolve().parent / "stockade-connect"  # plan.connector_path's file
_NET_PORTS = ((socket.SOCK_DGRAM, 53, "udp"), (socket.SOCK_STREAM, 53, "tcp"), (socket.SOCK_STREAM, 3128, "tcp"))


def _net_holder() -> dict[str, Any]:
    """Child A: a sandbox's network side, as the launcher makes it: a new user and
    network namespace, lo brought up over netlink (pyroute2)."""
    _enter_userns(CLONE_NEWNET)
    try:
        from pyroute2 import IPRoute
    except ImportError as e:
        return {"ok": False, "step": "import pyroute2", "errno": 0, "error": str(e)}
    try:
        with IPRoute() as ipr:
            links = {str(link.get_attr("IFLA_IFNAME")): link for link in ipr.get_links()}
            lo = links.get("lo")
            if lo is None:
                return {"ok": False, "step": "netlink: find lo", "errno": 0, "error": "no lo in a new network namespace"}
            ipr.link("set", index=lo["index"], state="up")
            up = bool(ipr.get_links(lo["index"])[0]["flags"] & 1)  # IFF_UP
            routes = [r.get_attr("RTA_DST") for fam in (socket.AF_INET, socket.AF_INET6)
                      for r in ipr.get_routes(family=fam, table=254) if r.get_attr("RTA_OIF") != lo["index"]]
    except OSError as e:
        return {"ok": False, "step": "netlink: bring lo up", "errno": e.errno or 0, "error": e.strerror or str(e)}
    if not up:
        return {"ok": False, "step": "netlink: bring lo up", "errno": 0, "error": "lo is still down after RTM_NEWLINK"}
    return {"ok": True, "links": sorted(links), "routes_out": [str(r) for r in routes]}


def _net_join(pid: int) -> dict[str, Any]:
    """Child B, a sibling of A and of this uid: net/netns.py's helper. Joins A's user and
    network namespaces (a pidfd, else the namespace files), binds the proxy's and DNS's
    ports there and connects to one over lo."""
    import errno as E

    before = os.stat("/proc/self/ns/net").st_ino
    how = "a pidfd"
    try:
        fd = os.pidfd_open(pid)
    except OSError as e:
        if e.errno != E.ENOSYS:
            _check_errno(e.errno or 0, f"pidfd_open({pid})")
        fd = -1
    rc = libc.setns(fd, CLONE_NEWUSER | CLONE_NEWNET) if fd >= 0 else -1
    err = libc.errno() if fd >= 0 else E.EINVAL
    if fd >= 0:
        os.close(fd)
    if rc != 0:
        if err != E.EINVAL:
            _check_errno(err, "setns(pidfd, CLONE_NEWUSER|CLONE_NEWNET)")
        how = "the namespace files"  # a kernel before 5.8 takes no pidfd: user first, then net
        for kind, flag in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)):
            nsfd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _check(libc.setns(nsfd, flag), f"setns(/proc/{pid}/ns/{kind})")
            finally:
                os.close(nsfd)
    if os.stat("/proc/self/ns/net").st_ino == before:
        return {"ok": False, "step": "setns", "errno": 0, "error": "still in another network namespace after setns"}
    socks = []
    try:
        for typ, port, proto in _NET_PORTS:
            s = socket.socket(socket.AF_INET, typ)
            socks.append(s)
            try:
                s.bind(("127.0.0.1", port))
                if typ == socket.SOCK_STREAM:
                    s.listen(1)
            except OSError as e:
                return {"ok": False, "step": f"bind 127.0.0.1:{port}/{proto}", "port": port, "how": how,
                        "errno": e.errno or 0, "error": e.strerror or str(e)}
        try:
            c = socket.create_connection(("127.0.0.1", 3128), timeout=5)
            c.close()
        except OSError as e:
            return {"ok": False, "step": "connect 127.0.0.1:3128 over lo", "port": 3128, "how": how,
                    "errno": e.errno or 0, "error": e.strerror or str(e)}
    finally:
        for s in socks:
            s.close()
    return {"ok": True, "how": how, "ports": [f"{port}/{proto}" for _t, port, proto in _NET_PORTS]}


def _net_live() -> tuple[dict[str, Any], dict[str, Any]]:
    """Child A holds a namespace like a sandbox's until child B, its sibling, has tried to
    join it: (A's result, B's result)."""
    ra, wa = os.pipe()  # A -> us: its result
    rg, wg = os.pipe()  # us -> A: EOF when it may end
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ra)
            os.close(wg)
            try:
                res = _net_holder()
            except OSError as e:
                res = {"ok": False, "errno": e.errno, "error": f"{e.strerror}", "step": getattr(e, "step", "")}
            except BaseException as e:  # report anything, never return into the parent's code
                res = {"ok": False, "errno": 0, "error": repr(e), "step": ""}
            os.write(wa, json.dumps(res).encode())
            os.close(wa)
            os.read(rg, 1)  # hold the namespace for the sibling
        finally:
            os._exit(0)
    os.close(wa)
    os.close(rg)
    try:
        chunks = []
        while b := os.read(ra, 65536):
            chunks.append(b)
        try:
            a: dict[str, Any] = json.loads(b"".join(chunks) or b"{}")
        except ValueError:
            a = {}
        if not a:
            a = {"ok": False, "error": "probe child died", "errno": 0, "step": ""}
        b_res = _child_result(lambda: _net_join(pid)) if a.get("ok") else {"ok": False, "skipped": True}
    finally:
        os.close(ra)
        os.close(wg)
        os.waitpid(pid, 0)
    return a, b_res


def analyze_network(a: dict[str, Any], b: dict[str, Any], env: Any, *, uid: int,
                    max_net: str | None = None) -> list[Probe]:
    """The three live network probes from the two children's results (pure given
    ``env``; unit-tested): each failure names its cause and fix (linux/remedies.py)."""
    import errno as E

    from .linux import remedies

    where = env.describe()

    def failed(name: str, live: dict[str, Any], rem: Any) -> Probe:
        err = int(live.get("errno") or 0)
        ename = E.errorcode.get(err, str(err)) if err else (live.get("error") or "failed")
        return Probe(name, "missing", f"{live.get('step') or name}: {ename}: {rem.cause}", rem.fix, {"live": live},
                     cause=rem.cause, environment=where, section=NETWORK)

    def not_tried(name: str, what: str, because: str) -> Probe:
        return Probe(name, "missing", f"{what}: not tried, {because}", None, {}, environment=where, section=NETWORK)

    out = []
    step = str(a.get("step") or "")
    err = int(a.get("errno") or 0)
    if a.get("ok"):
        out.append(Probe("net-ns", "ok", "a new network namespace (in a new user namespace) gets lo up over netlink "
                         f"(pyroute2); links: {', '.join(a.get('links') or [])}", None, {"live": a},
                         environment=where, section=NETWORK))
    else:
        if step == "import pyroute2":
            rem = remedies.pyroute2_missing(str(a.get("error")))
        elif step.startswith("netlink"):
            rem = remedies.netlink(err, env)
        elif step.startswith("unshare"):
            rem = remedies.netns(err, env, max_net)
        else:
            rem = _remedy_for(step, err, env) or remedies.netns(err, env, max_net)
        out.append(failed("net-ns", a, rem))
        return [*out, not_tried("net-setns", "join a sandbox's namespaces", "no namespace to join (net-ns)"),
                not_tried("net-ports", "bind 127.0.0.1:53 and :3128 inside", "no namespace to join (net-ns)")]
    step = str(b.get("step") or "")
    err = int(b.get("errno") or 0)
    if b.get("ok") or step.startswith(("bind", "connect")):
        out.append(Probe("net-setns", "ok", f"a process of uid {uid} joins a sandbox's user and network namespaces "
                         f"(setns with {b.get('how')}), as --net allow's helper does", None, {"live": b},
                         environment=where, section=NETWORK))
    else:
        out.append(failed("net-setns", b, remedies.setns(err, env)))
        return [*out, not_tried("net-ports", "bind 127.0.0.1:53 and :3128 inside", "the namespace was not joined "
                                "(net-setns)")]
    if b.get("ok"):
        out.append(Probe("net-ports", "ok", "127.0.0.1:53 (UDP, TCP) and 127.0.0.1:3128 bind in the joined namespace "
                         "(CAP_NET_BIND_SERVICE there), and a connection over its lo reaches them", None, {"live": b},
                         environment=where, section=NETWORK))
    elif step.startswith("connect"):
        out.append(failed("net-ports", b, remedies.netlink(err, env)))
    else:
        out.append(failed("net-ports", b, remedies.low_port(err, env, int(b.get("port") or 0))))
    return out


def probe_network(env: Any = None) -> list[Probe]:
    from .linux import remedies

    env = env or remedies.detect()
    a, b = _net_live()
    return analyze_network(a, b, env, uid=os.getuid(), max_net=_read(Path("/proc/sys/user/max_net_namespaces")))


def _elf_interp(path: Path) -> bool | None:
    """Whether an ELF executable names a program interpreter (dynamic), None: not ELF."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only; others: unknown
                return None
            end = "<" if head[5] == 1 else ">"
            phoff, = struct.unpack_from(end + "Q", head, 0x20)
            phentsize, phnum = struct.unpack_from(end + "HH", head, 0x36)
            f.seek(phoff)
            ph = f.read(phentsize * phnum)
    except (OSError, struct.error):
        return None
    return any(struct.unpack_from(end + "I", ph, i * phentsize)[0] == 3 for i in range(phnum))  # PT_INTERP


def probe_connector(path: Path = CONNECTOR) -> Probe:
    """stockade-connect, which a --net allow sandbox gets as /run/stockade/connect (ssh's
    ProxyCommand, git's GIT_PROXY_COMMAND): present, and it runs (its usage error)."""
    import subprocess

    fix = ("rebuild stockade's native parts: `make native` in a checkout (or "
           "`python setup.py build_ext --inplace`), else reinstall the package")
    if not path.exists():
        return Probe("net-connect", "missing", f"{path} is missing: --net allow refuses to start without it", fix,
                     section=NETWORK)
    if not os.access(path, os.X_OK):
        return Probe("net-connect", "missing", f"{path} is not executable by uid {os.getuid()}",
                     f"`chmod 755 {path}`, or {fix}", section=NETWORK)
    try:
        r = subprocess.run([str(path)], capture_output=True, timeout=10, env={})
    except (OSError, subprocess.TimeoutExpired) as e:
        return Probe("net-connect", "missing", f"{path} does not run: {e}", fix, section=NETWORK)
    if r.returncode != 2 or not r.stderr.startswith(b"stockade-connect: "):
        return Probe("net-connect", "missing", f"{path} does not behave as stockade-connect (exit {r.returncode}, "
                     f"{r.stderr[:120]!r})", fix, section=NETWORK)
    dynamic = _elf_interp(path)
    kind = {True: "dynamically linked: it uses the libc the sandbox sees in /usr", False: "static",
            None: "not an ELF file"}[dynamic]
    return Probe("net-connect", "ok", f"{path} runs ({kind})", None, {"path": str(path), "dynamic": dynamic},
                 section=NETWORK)


def run_self_test(timeout: float = 30.0) -> Probe:
    """A short real sandbox: `true` through stockade.api.run. Always live."""
    try:
        from . import api
    except ImportError as e:
        return Probe("self-test", "missing", f"the runtime is not available: {e}", "reinstall stockade")
    run = getattr(api, "run", None)
    if run is None:
        return Probe("self-test", "missing", "stockade.api.run is not available", "reinstall stockade")
    from .session import store

    base = Path(tempfile.mkdtemp(prefix="stockade-doctor-"))
    os.chmod(base, 0o755)
    name = f"doctor-{os.getpid()}-{int(time.time())}"
    t0 = time.monotonic()
    try:
        res = run(["true"], project=str(base), session=name, capture_output=True, timeout=timeout)
        ms = (time.monotonic() - t0) * 1000
        if res.returncode != 0:
            err = (res.stderr or b"")[-300:]
            return Probe("self-test", "missing", f"`true` exited {res.returncode} in the sandbox: {err!r}",
                         "run `stockade run -- true` to see the failing step", {"ms": round(ms, 1)})
        return Probe("self-test", "ok", f"`true` ran sandboxed in {ms:.0f} ms",
                     None, {"ms": round(ms, 1), "degraded": list(getattr(res, "degraded", ()) or ())})
    except Exception as e:  # report the failing step; doctor must not crash
        remedy = getattr(e, "remedy", None)
        return Probe("self-test", "missing", f"{type(e).__name__}: {e}", remedy or "see the message above",
                     cause=getattr(e, "detail", None))
    finally:
        _rmtree(base)
        _rmtree(store.sessions_dir() / name)


def _rmtree(path: Path) -> None:
    """rm -rf that also removes overlayfs' mode-000 ``work/work`` dirs we own."""

    def onerror(func: Any, p: str, exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=onerror)


# --------------------------------------------------------------------------- run


def _cache_key(state: Path) -> dict[str, Any]:
    sc = sysctls()
    from .linux import remedies

    # the environment decides every fix: a nested namespace or a filter is another machine;
    # the probes' own code, what they say (an upgrade of stockade is not a reboot)
    here = os.stat(__file__)
    return {"version": CACHE_VERSION, "code": [here.st_mtime_ns, here.st_size, here.st_ino],
            "boot_id": sc.get("kernel/random/boot_id"),
            "release": os.uname().release, "uid": os.getuid(), "state": str(state),
            "env": remedies.detect().to_json(),
            "sysctls": {k: v for k, v in sc.items() if k != "kernel/random/boot_id"}}


def cached_probes(state: Path, *, refresh: bool = False) -> tuple[list[Probe], bool]:
    path = state / "doctor.json"
    key = _cache_key(state)
    if not refresh:
        try:
            doc = json.loads(path.read_text())
            if doc.get("key") == key:
                return [Probe(**p) for p in doc["probes"]], True
        except (OSError, ValueError, KeyError, TypeError):
            pass
    from .linux import remedies

    env = remedies.detect()
    probes = [probe_environment(), *probe_userns(), probe_clone3(env), probe_setgroups(env), probe_proc(env),
              probe_hostname(env), probe_overlay(state), probe_landlock(), probe_seccomp(), probe_observe(),
              probe_cgroups(), probe_disk(state), probe_apparmor(), probe_capabilities(), *probe_network(env)]
    try:
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".doctor.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "probes": [asdict(p) for p in probes]}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return probes, False


def run(*, refresh: bool = False, self_test: bool = True) -> Report:
    """Every probe (cached unless ``refresh``) plus the live self-test."""
    from .paths import state_dir

    found, cached = cached_probes(Path(state_dir()), refresh=refresh)
    probes = [p for p in found if p.section != NETWORK]
    probes.append(probe_interpreter())
    probes.append(probe_id_range())
    if self_test:
        probes.append(run_self_test())
    # the network section last, its live connector check with it
    probes += [p for p in found if p.section == NETWORK]
    probes.append(probe_connector())
    return Report(probes, cached)


def apparmor_profile(python: str | None = None) -> str:
    """An AppArmor profile letting the interpreter that runs stockade create user namespaces."""
    exe = os.path.realpath(python or sys.executable)
    return f"""# AppArmor profile for stockade (Ubuntu 23.10+ restricts unprivileged user namespaces).
# It allows user namespaces for every program run by this interpreter:
#   {exe}
# To narrow it, run stockade from a venv whose python is a copy (python -m venv --copies).
# Install:
#   sudo install -m 644 /dev/stdin /etc/apparmor.d/stockade <<'EOF' ... EOF  (or save this output there)
#   sudo apparmor_parser -r /etc/apparmor.d/stockade
abi <abi/4.0>,
include <tunables/global>

profile stockade {exe} flags=(unconfined) {{
  userns,

  # Site-specific additions and overrides.
  include if exists <local/stockade>
}}
"""
