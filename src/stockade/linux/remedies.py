"""The cause and the fix of each step a run can fail at, for the environment it runs in.

`stockade doctor` (its probes) and a run's errors (linux/native.py) both take their
words from here, so the two always name the same cause and the same fix. Each
function takes the errno of the failing step and the detected :class:`Env` and
returns a :class:`Remedy`; :func:`detect` reads the environment (nested user
namespace, container engine and which of its options, seccomp filter, AppArmor,
sysctls, systemd) from a ``proc`` and a ``root`` path that tests point at fake
trees. Only error paths and doctor import this module.
"""

from __future__ import annotations

import errno as E
import os
import re
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# the initial user namespace maps every id: 0 0 4294967295
_FULL_MAP = "0 0 4294967295"
# overmounts under /proc that never stop a new procfs (empty dirs the kernel keeps for them)
_PROC_EMPTY_DIRS = ("/proc/sys/fs/binfmt_misc",)


@dataclass(frozen=True)
class Env:
    """What this process runs in, as far as a failing step is concerned."""

    uid: int
    uid_map: str  # first line of /proc/self/uid_map, spaces collapsed
    setgroups: str | None  # /proc/self/setgroups: allow | deny
    engine: str | None  # podman | docker | kubernetes | lxc | <container=> | None
    engine_evidence: str | None
    masked_proc: tuple[str, ...]  # paths under /proc with something mounted over them
    seccomp: int | None  # /proc/self/status Seccomp: 0 none, 1 strict, 2 filter
    apparmor_label: str | None  # this process's AppArmor confinement, e.g. "docker-default (enforce)"
    apparmor_restrict: str | None  # kernel.apparmor_restrict_unprivileged_userns
    max_user_namespaces: str | None
    unprivileged_userns_clone: str | None
    systemd: bool  # a systemd manager runs here (/run/systemd/system): systemd-run works
    cap_eff: int | None = None  # /proc/self/status CapEff

    @property
    def setfcap(self) -> bool:
        """CAP_SETFCAP: only its holder may map this namespace's uid 0 into a new one."""
        return self.cap_eff is not None and bool(self.cap_eff >> 31 & 1)

    @property
    def nested(self) -> bool:
        """Not the initial user namespace (its map is the full 0 0 4294967295)."""
        return bool(self.uid_map) and self.uid_map != _FULL_MAP

    def describe(self) -> str:
        """One line naming everything detected that changes a fix."""
        parts = []
        if self.nested:
            parts.append(f"nested user namespace (uid_map '{self.uid_map}', setgroups {self.setgroups or '?'})")
        else:
            parts.append("initial user namespace")
        if self.engine:
            parts.append(f"{self.engine} container ({self.engine_evidence})")
        if self.masked_proc:
            parts.append(f"/proc paths masked ({', '.join(self.masked_proc[:4])}"
                         + (f" and {len(self.masked_proc) - 4} more)" if len(self.masked_proc) > 4 else ")"))
        if self.seccomp == 2:
            parts.append("seccomp filter on this process (Seccomp: 2)")
        if self.apparmor_label and self.apparmor_label != "unconfined":
            parts.append(f"AppArmor profile {self.apparmor_label}")
        if self.apparmor_restrict == "1":
            parts.append("kernel.apparmor_restrict_unprivileged_userns = 1")
        if self.max_user_namespaces is not None:
            parts.append(f"user.max_user_namespaces = {self.max_user_namespaces}")
        if self.unprivileged_userns_clone == "0":
            parts.append("kernel.unprivileged_userns_clone = 0")
        parts.append("systemd" if self.systemd else "no systemd")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "nested": self.nested, "masked_proc": list(self.masked_proc)}


@dataclass(frozen=True)
class Remedy:
    cause: str
    fix: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def masked_proc(mountinfo: str) -> tuple[str, ...]:
    """Mount points strictly under /proc (what engines mask /proc paths with): the
    kernel refuses a new procfs in a user namespace while any hides part of /proc."""
    out = []
    for line in mountinfo.splitlines():
        f = line.split(" ")
        if len(f) < 5:
            continue
        mp = _unescape(f[4])
        if mp.startswith("/proc/") and mp not in _PROC_EMPTY_DIRS and mp not in out:
            out.append(mp)
    return tuple(out)


def _engine(proc: Path, root: Path) -> tuple[str | None, str | None]:
    if (root / "run/.containerenv").exists():
        # podman writes the engine and whether the container is rootless into it
        text = _read(root / "run/.containerenv") or ""
        return "podman", "/run/.containerenv" + (", rootless" if "rootless=1" in text else "")
    if (root / ".dockerenv").exists():
        return "docker", "/.dockerenv"
    if (root / "var/run/secrets/kubernetes.io").exists():
        return "kubernetes", "/var/run/secrets/kubernetes.io"
    try:
        env1 = (proc / "1/environ").read_bytes().split(b"\0")
    except OSError:
        env1 = []
    for item in env1:
        if item.startswith(b"container="):
            name = item.split(b"=", 1)[1].decode(errors="replace")
            return name, f"container={name} in /proc/1/environ"
    return None, None


def detect(proc: Path = Path("/proc"), root: Path = Path("/")) -> Env:
    uid_map = " ".join((_read(proc / "self/uid_map") or "").split("\n")[0].split())
    status = _read(proc / "self/status") or ""
    m = re.search(r"^Seccomp:\s*(\d+)", status, re.M)
    caps = re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M)
    label = _read(proc / "self/attr/apparmor/current") or _read(proc / "self/attr/current")
    engine, evidence = _engine(proc, root)
    return Env(
        uid=os.getuid(),
        uid_map=uid_map,
        setgroups=_read(proc / "self/setgroups"),
        engine=engine,
        engine_evidence=evidence,
        masked_proc=masked_proc(_read(proc / "self/mountinfo") or ""),
        seccomp=int(m.group(1)) if m else None,
        apparmor_label=label,
        apparmor_restrict=_read(proc / "sys/kernel/apparmor_restrict_unprivileged_userns"),
        max_user_namespaces=_read(proc / "sys/user/max_user_namespaces"),
        unprivileged_userns_clone=_read(proc / "sys/kernel/unprivileged_userns_clone"),
        systemd=(root / "run/systemd/system").is_dir(),
        cap_eff=int(caps.group(1), 16) if caps else None,
    )


# --------------------------------------------------------------------------- shared phrases


def _engine_flag(env: Env, podman: str, docker: str, kube: str) -> str:
    """The engine option, for the engine detected (all three when none is)."""
    if env.engine == "podman":
        return f"run the container with `podman run {podman}`"
    if env.engine == "docker":
        return f"run the container with `docker run {docker}`"
    if env.engine == "kubernetes":
        return f"set the pod's {kube}"
    return f"start it with `podman run {podman}` / `docker run {docker}` (Kubernetes: {kube})"


def _nested_where(env: Env) -> str:
    return (f"the user namespace this runs in (nested: uid_map '{env.uid_map}', made by `unshare -U`, "
            "bwrap, a rootless container or CI runner)")


def seccomp_remedy(env: Env, what: str) -> Remedy:
    """``what`` (a syscall description) is refused by a seccomp filter on this process."""
    cause = f"a seccomp filter on this process refuses {what} (Seccomp: 2 in /proc/self/status"
    if env.engine:
        cause += f"; {env.engine} container: its default profile does this)"
        fix = (_engine_flag(env, "--security-opt seccomp=unconfined", "--security-opt seccomp=unconfined",
                            "securityContext.seccompProfile.type: Unconfined")
               + " (or a profile that allows it)")
    else:
        cause += "; installed by the program that started this one)"
        fix = ("start stockade outside the filtering parent (a container engine, another sandbox, systemd's "
               "SystemCallFilter=/RestrictNamespaces=), or give it a profile that allows "
               f"{what}; in a container: `--security-opt seccomp=unconfined`")
    return Remedy(cause, fix)


def _apparmor_userns(env: Env, err: int) -> Remedy | None:
    """Ubuntu's restriction lets an unprivileged unshare succeed and then denies the
    namespace every capability: any later step (id map, mount) gets EPERM/EACCES."""
    if env.uid != 0 and env.apparmor_restrict == "1" and err in (E.EPERM, E.EACCES):
        return Remedy("AppArmor restricts unprivileged user namespaces "
                      "(kernel.apparmor_restrict_unprivileged_userns = 1)",
                      "install the profile printed by `stockade doctor --apparmor` "
                      "(or: `sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`)")
    return None


# --------------------------------------------------------------------------- one function per step


def userns(err: int, env: Env) -> Remedy:
    """Creating the sandbox's namespaces (clone3/clone/unshare with CLONE_NEWUSER|...)."""
    if err == E.ENOSPC:
        n = env.max_user_namespaces
        if env.nested:
            where = _nested_where(env)
            if n == "0":
                return Remedy(f"user.max_user_namespaces is 0 in {where}: it forbids further user namespaces "
                              "(bwrap --disable-userns does this)",
                              "raise it inside that namespace as its root: `sysctl -w user.max_user_namespaces=15000` "
                              "(or `echo 15000 > /proc/sys/user/max_user_namespaces`), or run stockade outside it "
                              "(bwrap: drop --disable-userns)")
            # the limit that bites is an enclosing namespace's: bwrap --disable-userns sets 1
            # in the namespace around this one, where nothing inside can raise it
            return Remedy(f"a user namespace enclosing {where} allows no more user namespaces "
                          f"(user.max_user_namespaces is {n} here; bwrap --disable-userns sets 1 around it)",
                          "run stockade outside that sandbox (bwrap: drop --disable-userns), or raise "
                          "user.max_user_namespaces in the namespace that lowered it")
        if n == "0":
            return Remedy("user namespaces are disabled (user.max_user_namespaces = 0)",
                          "`sudo sysctl -w user.max_user_namespaces=15000` (persist it in /etc/sysctl.d/)")
        return Remedy(f"the user namespace limit is reached (user.max_user_namespaces = {n})",
                      "raise it: `sudo sysctl -w user.max_user_namespaces=15000`, or end other sandboxes")
    if err == E.EUSERS:
        return Remedy(f"user namespaces nest at most 32 deep and {_nested_where(env)} is at that depth",
                      "run stockade from a shallower namespace (fewer sandboxes around it)")
    if err == E.ENOSYS:
        if env.seccomp == 2:
            return seccomp_remedy(env, "clone3 with ENOSYS")
        return Remedy("this kernel has no clone3 (Linux < 5.3)", "use a 5.3+ kernel (5.11+ for overlay in a user namespace)")
    if err == E.EINVAL:
        return Remedy("the kernel refused a namespace flag: it lacks user, pid, net, ipc, uts or cgroup namespaces",
                      "use a kernel built with CONFIG_USER_NS, CONFIG_PID_NS, CONFIG_NET_NS, CONFIG_IPC_NS, "
                      "CONFIG_UTS_NS and CONFIG_CGROUPS")
    if err == E.EPERM:
        aa = _apparmor_userns(env, err)
        if aa is not None:
            return aa
        if env.uid != 0 and env.unprivileged_userns_clone == "0":
            return Remedy("unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0, Debian)",
                          "`sudo sysctl -w kernel.unprivileged_userns_clone=1`")
        if env.seccomp == 2:
            return seccomp_remedy(env, "creating namespaces (clone3/clone/unshare)")
        if env.apparmor_label and env.apparmor_label not in ("unconfined",) and "unconfined" not in env.apparmor_label:
            return Remedy(f"this process's AppArmor profile {env.apparmor_label} denies user namespaces",
                          _engine_flag(env, "--security-opt apparmor=unconfined", "--security-opt apparmor=unconfined",
                                       "container.apparmor.security.beta.kubernetes.io annotation: unconfined")
                          if env.engine else "add `userns,` to that profile (see `stockade doctor --apparmor`)")
        if env.nested:
            return Remedy(f"{_nested_where(env)} refuses new user namespaces (EPERM, and neither a sysctl nor a "
                          "seccomp filter explains it: a chroot, or a security module such as SELinux)",
                          "run stockade outside that namespace; `unshare -Ur true` there shows the same refusal")
        return Remedy("creating a user namespace is refused (EPERM, and neither a sysctl nor a seccomp filter "
                      "explains it: a chroot, or a security module such as SELinux)",
                      "run stockade outside the chroot, or allow user_namespace create in the LSM policy; "
                      "`unshare -Ur true` shows the same refusal")
    if err == E.ENOMEM:
        return Remedy("the kernel ran out of memory or pid numbers for a new namespace",
                      "end other processes or raise kernel.pid_max")
    return Remedy(f"creating the sandbox's namespaces failed with {E.errorcode.get(err, err)}",
                  "try `unshare -Urmpf --mount-proc true`: it takes the same steps and shows the kernel's refusal")


def setgroups(err: int, env: Env) -> Remedy:
    """setgroups(2) in the sandbox (a root caller's plan drops supplementary groups)."""
    if env.setgroups == "deny" or env.nested:
        return Remedy(f"setgroups is denied in {_nested_where(env)} (/proc/self/setgroups: {env.setgroups or '?'}; "
                      "a namespace whose maps its own unprivileged creator wrote denies it for good)",
                      "run stockade from the initial user namespace, or have the outer namespace's maps written by "
                      "a privileged parent (newuidmap/newgidmap, as rootless podman does) so setgroups stays allowed")
    return Remedy("setgroups was refused in the sandbox's user namespace",
                  "run stockade as an unprivileged user (it then never calls setgroups)")


def id_map(err: int, env: Env, which: str) -> Remedy:
    """Writing the sandbox's uid_map, gid_map or setgroups file (``which``)."""
    aa = _apparmor_userns(env, err)
    if aa is not None:
        return aa
    if which == "uid_map" and env.nested and env.uid == 0 and env.cap_eff is not None and not env.setfcap:
        return map_root(env)
    if env.nested:
        return Remedy(f"{which}: an id the sandbox maps is not mapped in {_nested_where(env)}",
                      "run as an id mapped there without --user, or from the initial user namespace; "
                      "`stockade explain` shows the maps")
    return Remedy(f"the kernel refused the sandbox's {which} ({E.errorcode.get(err, err)})",
                  "an unprivileged caller may map only its own id: drop --user, or run as root; "
                  "`stockade explain` shows the maps")


def map_root(env: Env) -> Remedy:
    """Root of a nested namespace without CAP_SETFCAP maps its uid 0 into a new one
    (plan.py refuses such a run before it starts with these words)."""
    return Remedy("this process is root inside a user namespace without CAP_SETFCAP (bubblewrap's --uid 0 drops "
                  "it), and only a holder of CAP_SETFCAP may map that namespace's uid 0 into a new one",
                  "give it back to the outer sandbox (bwrap --cap-add CAP_SETFCAP), or start it as another uid "
                  "(bwrap --uid 1000)")


def proc(err: int, env: Env) -> Remedy:
    """Mounting the sandbox's own procfs."""
    aa = _apparmor_userns(env, err)
    if aa is not None and not env.masked_proc:
        return aa
    if env.masked_proc:
        shown = ", ".join(env.masked_proc[:4]) + (f" and {len(env.masked_proc) - 4} more" if len(env.masked_proc) > 4 else "")
        cause = (f"the kernel refuses a new procfs while /proc has paths mounted over it ({shown}"
                 + (f": the {env.engine} engine masks them)" if env.engine else ")"))
        if env.engine:
            fix = _engine_flag(env, "--security-opt unmask=ALL", "--security-opt systempaths=unconfined",
                               "securityContext.procMount: Unmasked (with hostUsers: false)")
        else:
            fix = f"unmount them (`umount {env.masked_proc[0]}` ...), or run stockade outside the sandbox that mounted them"
        return Remedy(cause, fix + ", or pass --allow-degraded proc (an empty /proc inside)")
    if env.seccomp == 2 and err == E.EPERM:
        return seccomp_remedy(env, "mount")
    return Remedy(f"the kernel refused a new procfs ({E.errorcode.get(err, err)}): /proc is not fully visible here "
                  "or a security module denies mount",
                  "run stockade where /proc is a plain procfs mount (`grep ' /proc' /proc/self/mountinfo` shows what is over it)")


def hostname(err: int, env: Env) -> Remedy:
    """sethostname(2) in the sandbox's new UTS namespace."""
    aa = _apparmor_userns(env, err)
    if aa is not None:
        return aa
    if env.seccomp == 2:
        r = seccomp_remedy(env, "sethostname")
        return Remedy(r.cause, r.fix + ", or pass --allow-degraded hostname to keep the container's hostname")
    return Remedy(f"sethostname was refused in the sandbox's new UTS namespace ({E.errorcode.get(err, err)}): "
                  "a security module denies it",
                  "run stockade outside that security module's confinement")


def fstype(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (absolute, resolved)."""
    best, fstype = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                mp = _unescape(parts[4])
                if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                    best, fstype = mp, parts[parts.index("-") + 1]
    except (OSError, ValueError, IndexError):
        pass
    return fstype


def overlay(err: int, env: Env, state: str | None = None) -> Remedy:
    """overlayfs for the project, its upper dir in the state dir."""
    fs = fstype(os.path.realpath(state)) if state else "unknown"
    on = f" ({state} is on {fs})" if state else ""
    if fs in {"overlay", "nfs", "nfs4", "fuse", "cifs", "zfs", "9p"} or err == E.EINVAL:
        fix = "put the state dir on ext4, xfs, btrfs or tmpfs: STOCKADE_STATE_DIR=/path/on/such/fs"
        if env.engine and fs == "overlay":
            fix += f" (a volume: `{env.engine if env.engine in ('podman', 'docker') else 'podman'} run -v /host/dir:/state` and STOCKADE_STATE_DIR=/state, or a tmpfs)"
        return Remedy(f"overlayfs refused the session directory{on}: its upper dir cannot be on that filesystem", fix)
    aa = _apparmor_userns(env, err)
    if aa is not None:
        return aa
    if err == E.EPERM and env.seccomp == 2:
        return seccomp_remedy(env, "mount")
    return Remedy(f"overlayfs refused the session directory{on} ({E.errorcode.get(err, err)})",
                  "a 5.11+ kernel mounts overlay in a user namespace; `dmesg | grep overlayfs` shows the kernel's reason")


def mount(err: int, env: Env) -> Remedy:
    """Any other mount of the plan."""
    aa = _apparmor_userns(env, err)
    if aa is not None:
        return aa
    if err == E.EPERM and env.seccomp == 2:
        return seccomp_remedy(env, "mount")
    if err in (E.EPERM, E.EACCES) and env.apparmor_label and "unconfined" not in env.apparmor_label:
        return Remedy(f"this process's AppArmor profile {env.apparmor_label} denies mount",
                      _engine_flag(env, "--security-opt apparmor=unconfined", "--security-opt apparmor=unconfined",
                                   "container.apparmor.security.beta.kubernetes.io annotation: unconfined"))
    return Remedy(f"a mount the plan needs failed ({E.errorcode.get(err, err)})",
                  "`stockade explain` prints the plan's mounts in order; the path above is the one refused")


def pivot_root(err: int, env: Env) -> Remedy:
    return Remedy("pivot_root needs the new root to be a mount point in a private mount namespace, "
                  "and refuses when this process's / is an initramfs (rootfs)",
                  "run stockade from a real root filesystem (not from an initramfs shell or a chroot)")


def landlock(err: int, env: Env) -> Remedy:
    if err == E.EOPNOTSUPP:
        return Remedy("Landlock is built in but not enabled",
                      "add landlock to the lsm= boot parameter (e.g. lsm=landlock,lockdown,yama,apparmor,bpf), "
                      "or pass --allow-degraded landlock")
    if err == E.ENOSYS:
        if env.seccomp == 2:
            return seccomp_remedy(env, "landlock_create_ruleset")
        return Remedy("the kernel has no Landlock (needs 5.13+ with CONFIG_SECURITY_LANDLOCK)",
                      "use a kernel with Landlock, or pass --allow-degraded landlock")
    return Remedy(f"Landlock refused the ruleset ({E.errorcode.get(err, err)})",
                  "pass --allow-degraded landlock to run without it")


def seccomp(err: int, env: Env) -> Remedy:
    if err == E.ENOMEM:
        return Remedy("the kernel refused another seccomp filter: the filters already stacked on this process "
                      "reach its limit (Seccomp: 2)",
                      "start stockade outside the filtering parent, or pass --allow-degraded seccomp")
    if err == E.EINVAL:
        return Remedy("the kernel has no seccomp filters (CONFIG_SECCOMP_FILTER)",
                      "use a kernel built with CONFIG_SECCOMP_FILTER, or pass --allow-degraded seccomp")
    return Remedy(f"the kernel refused the seccomp filter ({E.errorcode.get(err, err)})",
                  "pass --allow-degraded seccomp to run without it")


def user_command() -> str:
    """The command the user ran, to repeat it in a fix: the stockade CLI's own words
    (the served path's server sees ``stockade`` and the client's arguments), else the
    interpreter's command line (a program using the API)."""
    argv = sys.argv
    if argv and os.path.basename(argv[0]) in ("stockade", "__main__.py") and argv[1:]:
        return shlex.join(["stockade", *argv[1:]])
    orig = getattr(sys, "orig_argv", None) or argv
    return shlex.join(orig) if orig else "stockade run -- ..."


def cgroup_delegation(env: Env, command: str | None = None) -> Remedy:
    """No cgroup of its own to limit a run's tree (the limits fall back to rlimits)."""
    cmd = command or user_command()
    who = "this user" if env.uid != 0 else "root"
    if env.systemd:
        scope = "systemd-run --user --scope" if env.uid != 0 else "systemd-run --scope"
        return Remedy(f"no cgroup is delegated to {who}",
                      f"`{scope} -p Delegate=yes -- {cmd}`")
    if env.engine:
        # podman mounts the container's own cgroup read-write in systemd mode; docker
        # mounts it read-only unless privileged (moby#42040)
        return Remedy(f"no cgroup is delegated to {who} inside this {env.engine} container",
                      _engine_flag(env, "--systemd=always", "--cgroupns=private --privileged",
                                   "securityContext.privileged: true")
                      + " on a cgroup v2 host, so the container's own cgroup is writable")
    return Remedy(f"no cgroup is delegated to {who}, and no systemd runs here to delegate one",
                  f"where systemd runs: `systemd-run --user --scope -p Delegate=yes -- {cmd}`; else root makes one: "
                  f"`mkdir /sys/fs/cgroup/stockade-{env.uid} && chown -R {env.uid} /sys/fs/cgroup/stockade-{env.uid}` "
                  "and starts stockade from it")


def cgroup_join(err: int, env: Env) -> Remedy:
    return Remedy("the sandbox could not enter its cgroup (removed, or not writable by this user)",
                  "check that the cgroup still exists and is writable by this user, or run with "
                  "STOCKADE_CGROUP=none (rlimits only)")


def launcher(err: int, env: Env) -> Remedy:
    return Remedy("the sandbox launcher could not start",
                  "set STOCKADE_LAUNCHER=0 to start each sandbox directly (its error names the failing step)")


def release(err: int, env: Env) -> Remedy:
    return Remedy("the sandbox's init died before starting and reported no step",
                  "rerun with STOCKADE_LAUNCHER=0 (its error names the failing step); `dmesg` shows a kernel kill "
                  "(OOM, seccomp)")


_BY_STEP = {
    "clone": userns,
    "unshare": userns,
    "setgroups": setgroups,
    "hostname": hostname,
    "pivot-root": pivot_root,
    "landlock": landlock,
    "seccomp": seccomp,
    "cgroup-join": cgroup_join,
    "launcher": launcher,
}


def for_step(step: str, err: int, env: Env | None = None, *, op_kind: str | None = None,
             state: str | None = None) -> Remedy | None:
    """The remedy for a failing step of a run (``op_kind``: a mount op's kind,
    ``state``: an overlay's upper dir); None for the steps native.py words itself."""
    env = env or detect()
    if step in ("uid-map", "gid-map", "setgroups-file"):
        return id_map(err, env, step.replace("-map", "_map").replace("-file", ""))
    if step == "mount":
        if op_kind == "proc":
            return proc(err, env)
        if op_kind == "overlay":
            return overlay(err, env, state)
        return mount(err, env)
    fn = _BY_STEP.get(step)
    if fn is not None:
        return fn(err, env)
    if step in _OWN_WORDS:
        return None
    return other(step, err, env)


# steps whose words need no environment (linux/native.py's REMEDIES)
_OWN_WORDS = frozenset({"chdir", "lo-up", "rlimit", "observe"})


def other(step: str, err: int, env: Env) -> Remedy:
    """A step with no rule of its own (setuid, caps, stdio, ...)."""
    if err == E.EPERM and env.seccomp == 2:
        return seccomp_remedy(env, f"the sandbox's {step} step")
    if step in ("setuid", "setgid") and err in (E.EINVAL, E.EPERM):
        return Remedy(f"{step}: the id is not mapped in the sandbox's user namespace",
                      "drop --user (or pick an id `stockade explain` shows mapped)")
    return Remedy(f"the sandbox's {step} step failed ({E.errorcode.get(err, err)})",
                  "`strace -f -e trace=%process,%file stockade run ...` shows the refused call; "
                  "`stockade explain` prints the plan")


# --------------------------------------------------------------------------- network (--net allow, --forward)
# The steps of net/netns.py's helper: join the sandbox's user and network namespaces,
# bring lo up with netlink (pyroute2), bind the proxy's and DNS's ports there.
# `stockade doctor` tries each step for real and words a failure with these.


def netns(err: int, env: Env, max_net: str | None = None) -> Remedy:
    """unshare(CLONE_NEWNET) (with a new user namespace, as a sandbox's)."""
    if err == E.ENOSPC:
        if max_net == "0":
            return Remedy("network namespaces are disabled (user.max_net_namespaces = 0)",
                          "`sudo sysctl -w user.max_net_namespaces=15000` (persist it in /etc/sysctl.d/), "
                          "or run with --net host")
        return Remedy(f"the network namespace limit is reached (user.max_net_namespaces = {max_net or '?'})",
                      "raise it: `sudo sysctl -w user.max_net_namespaces=15000`, or end other sandboxes")
    if err == E.EINVAL:
        return Remedy("the kernel has no network namespaces (CONFIG_NET_NS)",
                      "use a kernel built with CONFIG_NET_NS, or run with --net host")
    return userns(err, env)


def netlink(err: int, env: Env) -> Remedy:
    """Bringing lo up and reading links and routes over rtnetlink (pyroute2), in the
    sandbox's namespace."""
    if err in (E.EAFNOSUPPORT, E.EPROTONOSUPPORT):
        if env.seccomp == 2:
            return seccomp_remedy(env, "netlink sockets (AF_NETLINK)")
        return Remedy("this kernel offers no rtnetlink sockets (AF_NETLINK, NETLINK_ROUTE)",
                      "run where the kernel has netlink (gVisor-like kernels lack it), or use --net none / --net host")
    if err in (E.EPERM, E.EACCES):
        aa = _apparmor_userns(env, err)
        if aa is not None:
            return aa
        if env.seccomp == 2:
            return seccomp_remedy(env, "netlink requests (bringing lo up)")
        return Remedy(f"bringing lo up was refused ({E.errorcode.get(err, err)}): a security module denies "
                      "CAP_NET_ADMIN in the sandbox's own network namespace",
                      "run stockade outside that confinement, or use --net none / --net host")
    return Remedy(f"a netlink request in the sandbox's network namespace failed ({E.errorcode.get(err, err)})",
                  "`unshare -Urn ip link set lo up` takes the same step and shows the kernel's refusal")


def pyroute2_missing(error: str) -> Remedy:
    """pyroute2 (the netlink library, a dependency) cannot be imported."""
    return Remedy(f"pyroute2, which does the netlink work of --net allow and --forward, cannot be imported ({error})",
                  f"install it into stockade's environment: {sys.executable} -m pip install 'pyroute2>=0.7' "
                  "(or reinstall stockade, which depends on it)")


def setns(err: int, env: Env) -> Remedy:
    """A helper of this uid joining the sandbox's user and network namespaces (setns)."""
    if err == E.EPERM or err == E.EACCES:
        aa = _apparmor_userns(env, err)
        if aa is not None:
            return aa
        if env.seccomp == 2:
            return seccomp_remedy(env, "setns")
        if env.apparmor_label and "unconfined" not in env.apparmor_label:
            return Remedy(f"this process's AppArmor profile {env.apparmor_label} denies joining namespaces (setns)",
                          _engine_flag(env, "--security-opt apparmor=unconfined", "--security-opt apparmor=unconfined",
                                       "container.apparmor.security.beta.kubernetes.io annotation: unconfined")
                          if env.engine else "allow setns (`userns,` and `capability sys_admin,`) in that profile")
        return Remedy(f"joining the sandbox's user namespace was refused ({E.errorcode.get(err, err)}): "
                      "a security module (SELinux, Yama, an LSM policy) denies setns to a process of this uid",
                      "allow it in that policy, or use --net none / --net host; "
                      "`nsenter -U -n -t <pid> --preserve-credentials true` takes the same step")
    if err == E.ENOSYS:
        if env.seccomp == 2:
            return seccomp_remedy(env, "setns")
        return Remedy("this kernel has no setns", "use a 5.8+ kernel")
    if err == E.EINVAL:
        return Remedy("the kernel refused setns into the user namespace (EINVAL: a pidfd is not taken before "
                      "Linux 5.8, and a multithreaded process may not join a user namespace)",
                      "use a 5.8+ kernel; `stockade doctor --json` shows the failing call")
    return Remedy(f"joining the sandbox's namespaces failed ({E.errorcode.get(err, err)})",
                  "`nsenter -U -n -t <pid> --preserve-credentials true` takes the same step and shows the refusal")


def low_port(err: int, env: Env, port: int) -> Remedy:
    """Binding 127.0.0.1:``port`` (53, 3128, a forwarded port) in the sandbox's namespace."""
    if err in (E.EACCES, E.EPERM):
        if env.seccomp == 2 and err == E.EPERM:
            return seccomp_remedy(env, "bind")
        return Remedy(f"binding 127.0.0.1:{port} in the sandbox's network namespace was refused: the helper that "
                      "joined it lacks CAP_NET_BIND_SERVICE there, or a security module (SELinux name_bind) "
                      "denies the port",
                      "allow the bind in that policy, or use --net none / --net host")
    if err == E.EADDRINUSE:
        return Remedy(f"127.0.0.1:{port} is already taken in the sandbox's network namespace",
                      "pick another --forward port (3128 and 53 are the proxy's and DNS's)")
    return Remedy(f"binding 127.0.0.1:{port} in the sandbox's network namespace failed ({E.errorcode.get(err, err)})",
                  "use --net none / --net host, and report this with `stockade doctor --json`")
