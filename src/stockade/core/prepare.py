"""From a request to a Plan: policy, environment, confinement, masks, limits.

Two steps. ``resolve`` weighs the options against the policy and the host: the
merged policy, the filtered environment, the secret scan, the compiled seccomp
profile, the cgroup backend and limits. What comes out (``Resolved``) does not
depend on the command or on the session's layers, so it can be kept: in this
process its parts are cached and revalidated (``policy.load_cached``, the secret
scan per directory, profiles by file identity, host facts by ``lstat``), and a
speed layer may keep it across processes through the ``PreparedCache`` hook.
``finish`` then adds what is the run's own (the session's layers and mask layer,
the command, whether stdin is a socket) and builds the Plan with ``plan.build``,
once: a plan is never edited after it is built. Equal inputs give the same plan
object (memoised by value).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .. import plan as planmod
from ..errors import SandboxError, UsageError
from ..session import store
from .request import CliSpec, RunRequest, argv_of

if TYPE_CHECKING:
    from ..audit import MaskedFact, PolicyFacts
    from ..cgroups.base import Limits, Manager
    from ..policy import CliPolicy, Effective
    from ..policy.network import NetPolicy

# proc, hostname: walls a container engine can refuse (linux/walls.py)
_DEGRADABLE = frozenset({"landlock", "seccomp", "limits", "cgroups", "proc", "hostname"})

# The code that decides what ``resolve`` gives (package-relative): a cache kept across
# processes must compare it (and its own). Whole packages are listed by directory, so a
# module split out of one cannot be missed.
_CODE = ("plan.py", "sandbox_fs.py", "pathsig.py", "redact.py", "core/prepare.py", "core/request.py",
         "session/masklayer.py")
_CODE_DIRS = ("policy", "cgroups", "linux/seccomp")
_code_files: list[tuple[str, ...]] = []


def code_files() -> tuple[str, ...]:
    """Every source file (package-relative) whose code decides what ``resolve`` gives."""
    if not _code_files:
        pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        found = list(_CODE)
        for d in _CODE_DIRS:
            try:
                found += sorted(f"{d}/{n}" for n in os.listdir(os.path.join(pkg, d)) if n.endswith(".py"))
            except FileNotFoundError:  # a module, not (yet) a package
                found.append(f"{d}.py")
        _code_files.append(tuple(found))
    return _code_files[0]


Sig = tuple[int, ...]
MaskItem = tuple[str, bool, bool]  # (host path, is_dir, is_symlink) for session.masklayer


@dataclass(frozen=True)
class AuditFacts:
    """What the run's audit events say of its preparation."""

    policy: PolicyFacts
    masked: tuple[MaskedFact, ...]  # the project's and the grants' masked paths
    removed: tuple[str, ...]  # environment variables filtered out (names only)
    read_only: bool
    project: str
    unenforced: tuple[str, ...]  # limits no backend enforces for the whole sandbox


@dataclass(frozen=True)
class Deps:
    """Everything a ``Resolved`` was made from, to revalidate it (same meanings as the
    in-process caches' checks). Process state (environment, cwd, ids, cgroup, code)
    is the cache's to record."""

    policy_files: tuple[tuple[str, object], ...]  # (tier file, its stat signature); signatures: compared only
    session_policy: tuple[str, Sig | None] | None  # (session dir, its policy.json's signature)
    policy_dirs: Mapping[str, tuple[object, tuple[object, ...]]]  # for pathsig.paths_hold
    policy_resolved: tuple[tuple[str, str], ...]  # (path as written, realpath)
    policy_exists: tuple[tuple[str, bool], ...]
    scans: Mapping[str, tuple[tuple[tuple[str, int, int], ...], tuple[tuple[str, bool, bool, bool], ...]]]
    etc: planmod.FactsSig  # /etc's signature, and each file copied in
    passwd: tuple[object, ...]  # /etc/passwd's and /etc/group's
    owner: tuple[int, int] | None  # the project's owner (real root: the sandbox user)
    seccomp: tuple[str, Sig] | None  # (profile file, signature)
    rlimits: tuple[tuple[int, int], ...]  # (resource, hard limit) the plan's are clamped to
    landlock: int  # the kernel's Landlock ABI


@dataclass(frozen=True)
class PlanInputs:
    """Every ``plan.Request`` field but the run's own (command, layers, stdin), and the
    mask layer's contents."""

    project: Path
    cwd: Path
    env: Mapping[str, str]
    root: bool
    user: int | None
    read_only: bool
    network: str
    forward: tuple[int, ...]  # host loopback ports the sandbox reaches (through the proxy's listeners)
    keep_fds: tuple[int, ...]
    masked: tuple[tuple[str, bool], ...]
    grants: tuple[tuple[str, bool], ...]
    exec_allow: tuple[str, ...] | None
    etc_extra: tuple[str, ...]
    landlock: bool
    seccomp_name: str | None
    seccomp_bpf: bytes
    rlimits: tuple[tuple[int, int, int], ...]
    degraded: tuple[str, ...]
    mask_items: tuple[MaskItem, ...]  # the project's secrets: the session's mask layer
    mask_mode: str
    tmpfs_size: int | None = None  # size= of each writable tmpfs (limits.disk_tmpfs)


@dataclass(frozen=True)
class Resolved:
    """The options weighed against policy and host: all a run needs but its own parts."""

    inputs: PlanInputs
    cg_manager: Manager
    limits: Limits
    timeout: float | None
    audit: AuditFacts
    deps: Deps | None = None  # None: cannot be revalidated, so never kept across processes
    net: NetPolicy | None = None  # as Prepared.net
    observe: bool = False  # as Prepared.observe


@dataclass(frozen=True)
class Prepared:
    """What a run executes: the plan, its cgroup backend and limits, the audit facts."""

    plan: planmod.Plan
    cg_manager: Manager
    limits: Limits
    timeout: float | None
    audit: AuditFacts
    # the run's proxy policy: mode allow, or mode none with forwarded ports; None: no proxy
    net: NetPolicy | None = None
    observe: bool = False  # observe mode: log what the command tried (core/observe.py)


# --------------------------------------------------------------------------- the cache hook

CacheKey = tuple[object, ...]  # marshal-able; the options, never the command or the session


class PreparedCache(Protocol):
    """A store of ``Resolved`` kept across processes (the CLI's speed layer).

    ``load`` returns one only while all of its ``deps`` and the process state it was
    made in hold; it never raises for a missing or bad entry. ``save`` gets only
    those with ``deps``."""

    def load(self, key: CacheKey, sess: store.Session) -> Resolved | None: ...

    def save(self, key: CacheKey, resolved: Resolved) -> None: ...


_cache: list[PreparedCache] = []


def set_cache(cache: PreparedCache | None) -> None:
    """Install (or, with None, remove) the cross-process cache ``prepare`` consults."""
    _cache[:] = [] if cache is None else [cache]


def _key(req: RunRequest, project: Path) -> CacheKey | None:
    """The cache key of a request whose ``Resolved`` may be kept; None: it may not."""
    if req.limits is not None or req.requested_limits is not None or not (req.policy is None or isinstance(req.policy, CliSpec)):
        return None
    key: CacheKey = (
        "run", str(project), None if req.cwd is None else os.fspath(req.cwd), req.timeout, req.shell, req.root,
        req.user, req.read_only, req.network, tuple(req.pass_fds), req.seccomp, tuple(req.allow_degraded),
        req.landlock, None if req.policy is None else req.policy.key, None if not req.env else tuple(sorted(req.env.items())),
        tuple(req.allow_hosts), tuple(str(p) for p in req.forward), req.observe,
    )
    if not {"proc", "hostname"}.isdisjoint(req.allow_degraded):
        from ..linux import walls

        key += walls.ns_key()  # the probes' answers hold for these namespaces only
    return key


def prepare(sess: store.Session, project: Path, req: RunRequest, *, foreign_stdin: bool = False,
            explain_only: bool = False) -> Prepared:
    """The plan and everything else a run of ``req`` in ``sess`` needs.

    ``foreign_stdin``: stdin is an inet socket of the caller's (``RunIO.inet_stdin``)."""
    argv = argv_of(req.args, req.shell)
    key = _key(req, project) if _cache and argv and not explain_only else None
    hit = _cache[0].load(key, sess) if key is not None else None
    resolved = hit if hit is not None else resolve(sess, project, req, argv, explain_only=explain_only)
    prep = finish(resolved, sess, argv, foreign_stdin=foreign_stdin, explain_only=explain_only)
    if hit is None and key is not None and resolved.deps is not None and not resolved.observe:
        # (an observed run classifies what it saw with the merged policy itself: never from a cached copy)
        _cache[0].save(key, resolved)  # once its plan was built: bad input leaves nothing behind
    return prep


# --------------------------------------------------------------------------- finish: the run's own parts, the plan


def finish(resolved: Resolved, sess: store.Session, argv: tuple[str, ...], *, foreign_stdin: bool = False,
           explain_only: bool = False) -> Prepared:
    """Add the run's own parts (``sess``'s layers and mask layer, the command, stdin)
    and build its plan."""
    i = resolved.inputs
    lower: list[Path] = [] if i.read_only else sess.layers()[::-1]
    if i.mask_items:
        if explain_only:
            lower.append(sess.dir / "masks" / "(layer)")
        else:
            from ..session.masklayer import ensure_mask_layer

            lower.append(ensure_mask_layer(sess, list(i.mask_items), i.project, i.mask_mode))
    rw = not i.read_only
    plan = _build(_request(i, argv, tuple(lower), sess.upper if rw else None, sess.work if rw else None, foreign_stdin,
                           landlock_log=resolved.observe))
    if not explain_only and rw and os.geteuid() == 0:
        _own_upper(sess, i.project)
    if len(i.keep_fds) > 64:
        raise UsageError(f"--pass-fd: at most 64 descriptors can be passed, not {len(i.keep_fds)}")
    _check_pass_fds(i.keep_fds)
    if i.network == "allow":
        _no_host_sockets(i.keep_fds, foreign_stdin)
    if rw and not explain_only:
        _check_disk(resolved.limits, sess)
        _project_quota(resolved.limits, sess)
    return Prepared(plan, resolved.cg_manager, resolved.limits, resolved.timeout, resolved.audit, resolved.net,
                    resolved.observe)


def _check_disk(lim: Limits, sess: store.Session) -> None:
    """A disk cap other than the default (a flag, the config, the API) must hold what the
    session already holds, or every write would end the run: refused before it starts.
    (Under the default cap the watchdog's first look does it, without a walk per run.)"""
    from ..cgroups.base import DEFAULT_DISK, format_size

    if lim.disk is None or lim.disk == DEFAULT_DISK or not sess.has_layer_entries():
        return
    from .diskwatch import held_bytes

    held = held_bytes(str(sess.dir), [str(sess.upper), *(str(p) for p in sess.layers())])
    if held > lim.disk:
        raise UsageError(
            f"--disk {format_size(lim.disk)} is smaller than the {format_size(held)} session {sess.id} already holds "
            f"in its layers; raise it, or drop its changes (stockade discard --session {sess.id})")


QUOTA_HEADROOM = 1024 * 1024  # the watchdog's SLACK


def _project_quota(lim: Limits, sess: store.Session) -> None:
    """Where the state dir's filesystem enforces project quotas and we are the host's
    root, the kernel holds ``--disk`` on the session's layers: the session directory gets
    a project id of its own (with PROJINHERIT: its upper, work dir and snapshots inherit
    it; what a session made before holds is moved under it once) capped at the limit,
    set again per run (the cap may change). Elsewhere the watchdog alone holds it."""
    if lim.disk is None or os.geteuid() != 0:
        return
    from ..errors import SandboxError
    from ..linux import quota

    support = quota.probe(sess.dir)
    if isinstance(support, str):
        return
    step = f"set the project quota of session {sess.id}"
    try:
        meta = sess.meta()
        pid = meta.get("quota_project") if isinstance(meta, dict) else None
        if not isinstance(pid, int):
            pid = quota.allocate(sess.dir.parent)
            quota.set_project(sess.dir, pid, recursive=True)
            sess.update_meta(quota_project=pid)
        # a session at its cap keeps room for overlayfs's work/work (made again at each
        # mount: without it the overlay comes up read-only) and for removing what it holds;
        # growth past the cap is still the watchdog's to end
        held = quota.usage(support, sess.dir, pid)["curspace"]
        quota.set_limit(support, sess.dir, pid, max(lim.disk, held + QUOTA_HEADROOM))
    except OSError as e:
        raise SandboxError(step, path=str(sess.dir), errno=e.errno or 0,
                           remedy=f"check the project quotas of {support.mount_point} (repquota -P {support.mount_point}) "
                                  "or move the state dir (STOCKADE_STATE_DIR) to a filesystem without them",
                           detail=e.strerror) from e


def base_plan(resolved: Resolved) -> planmod.Plan:
    """A plan of this preparation with placeholders for the run's own parts (command,
    session layers): what a CLI server needs to warm the launcher of its base, which
    leaves those parts to each run. Never run."""
    i = resolved.inputs
    ph = Path("/nonexistent/stockade-base")
    lower = (ph / "masks",) if i.mask_items else ()
    return _build(_request(i, ("true",), lower, None if i.read_only else ph / "upper", None if i.read_only else ph / "work"))


def _request(i: PlanInputs, argv: tuple[str, ...], lower: tuple[Path, ...], upper: Path | None,
             work: Path | None, foreign_stdin: bool = False, landlock_log: bool = False) -> planmod.Request:
    return planmod.Request(
        argv=argv, project=i.project, cwd=i.cwd, env=i.env, lower_layers=lower, upper=upper, work=work,
        foreign_stdin=foreign_stdin,
        root=i.root, user=i.user, read_only=i.read_only, network=i.network, forward=i.forward, keep_fds=i.keep_fds,
        masked=i.masked,
        grants=i.grants, exec_allow=i.exec_allow, etc_extra=i.etc_extra, landlock=i.landlock,
        seccomp_name=i.seccomp_name, seccomp_bpf=i.seccomp_bpf, rlimits=i.rlimits, degraded=i.degraded,
        tmpfs_size=i.tmpfs_size, landlock_log=landlock_log,
    )


_PLANS: dict[tuple[Any, ...], tuple[planmod.HostFacts, planmod.Plan]] = {}


def passwd_sig() -> tuple[Any, ...]:
    """/etc/passwd's and /etc/group's signatures (``Deps.passwd``; the plan's user names come from them)."""
    out: list[Any] = []
    for f in ("/etc/passwd", "/etc/group"):
        try:
            st = os.stat(f)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def _build(req: planmod.Request) -> planmod.Plan:
    """``plan.build(req)``, the same plan object again for an equal request on unchanged
    host facts (a Sandbox's runs of one command)."""
    facts = planmod.host_facts(req.etc_extra)
    owner: Any = None
    if facts.euid == 0 and req.user is None:
        st = os.stat(req.project)
        owner = (st.st_uid, st.st_gid)
    key = (
        req.argv, str(req.project), str(req.cwd), tuple(req.env.items()), req.lower_layers, req.upper, req.work,
        req.root, req.user, req.read_only, req.network, req.forward, req.hostname, req.keep_fds, req.masked, req.grants,
        req.exec_allow, req.etc_extra, req.landlock, req.seccomp_name, req.seccomp_bpf, req.rlimits,
        req.degraded, req.stage_dir, req.foreign_stdin, owner, passwd_sig(), req.tmpfs_size, req.landlock_log,
    )
    hit = _PLANS.get(key)
    if hit is not None and hit[0] == facts:
        return hit[1]
    plan = planmod.build(req, facts)
    if len(_PLANS) > 32:
        _PLANS.clear()
    _PLANS[key] = (facts, plan)
    return plan


def _own_upper(sess: store.Session, project: Path) -> None:
    """As real root, give the session's upper layer the project directory's owner and
    mode. overlayfs shows a directory with its upper-most layer's attributes, and the
    project's root always has the upper one: left root's, a sandbox user other than
    root (the project's owner, ``--user``) could not write where it may on the host.
    Checked per run: a snapshot leaves a fresh upper."""
    try:
        want = os.stat(project)
        st = os.stat(sess.upper)
    except OSError:
        return  # no upper (read-only, or gone): the run reports what it needs
    if (st.st_uid, st.st_gid) != (want.st_uid, want.st_gid):
        os.chown(sess.upper, want.st_uid, want.st_gid)
    mode = want.st_mode & 0o7777
    if st.st_mode & 0o7777 != mode:
        os.chmod(sess.upper, mode)


def _check_pass_fds(pass_fds: Sequence[int]) -> None:
    """Each fd must be the caller's (a CLI server's supervisor holds its client's
    under other numbers: ``callerfds``), never just any fd of this process."""
    from ..callerfds import source

    for fd in pass_fds:
        if source(fd) is None:
            raise UsageError(f"--pass-fd {fd}: not an open file descriptor")


def _no_host_sockets(pass_fds: Sequence[int], foreign_stdin: bool) -> None:
    """--net allow: an IPv4/IPv6 socket of the caller's network handed in would reach any
    address past the proxy (it may be disconnected and connected again; Landlock's TCP
    rules name ports, never addresses, and UDP has none)."""
    from ..callerfds import source
    from .request import inet_socket

    for n in pass_fds:
        fd = source(n)
        if fd is not None and inet_socket(fd):
            raise UsageError(f"--pass-fd {n} is an IPv4/IPv6 socket of the host's network, which reaches any address "
                             "past --net allow's proxy: pass a pipe or a Unix socket instead, or use --net host")
    if foreign_stdin:
        raise UsageError("stdin is an IPv4/IPv6 socket of the host's network, which reaches any address past --net "
                         "allow's proxy: pipe it in instead (`... | stockade run ...`), or use --net host")


# --------------------------------------------------------------------------- seccomp

_SECCOMP: dict[str, tuple[Any, str, tuple[int, int, int, int, int]]] = {}


def _seccomp(spec: str, degraded_ok: frozenset[str], degraded: list[str]) -> tuple[bytes, str | None]:
    """Compiled BPF for a profile; a builtin profile is reused while its file is unchanged."""
    hit = _SECCOMP.get(spec)
    if hit is not None:
        compiled, path, sig = hit
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == sig:
            return compiled.bpf, f"{compiled.name} (sha256 {compiled.digest[:12]})"
    from ..linux import seccomp as sc

    try:
        if "/" in spec or spec.endswith(".json") or spec == "off":
            compiled = sc.compile_profile(spec)
        else:
            _name, path_p = sc.profile_path(spec)
            path = str(path_p)
            st0 = os.stat(path)
            compiled = sc.compile_profile(spec)
            _SECCOMP[spec] = (compiled, path, (st0.st_dev, st0.st_ino, st0.st_size, st0.st_mtime_ns, st0.st_ctime_ns))
    except OSError as e:
        raise SandboxError("read seccomp profile", path=spec, errno=e.errno or 0) from None
    except SandboxError as e:  # e.g. libseccomp.so.2 missing
        if "seccomp" not in degraded_ok:
            raise
        degraded.append(f"seccomp ({e.one_line()})")
        return b"", None
    return compiled.bpf, f"{compiled.name} (sha256 {compiled.digest[:12]})"


# --------------------------------------------------------------------------- limits

_LIMITS: dict[tuple[Any, ...], tuple[list[str], list[str], tuple[tuple[int, int, int], ...], tuple[tuple[int, int], ...]]] = {}
_DEFAULT_LIMITS: list[Limits] = []


def _limits(limits: Limits | None, requested: set[str] | None, allow: bool) -> tuple[
        Limits, Manager, list[str], list[str], tuple[tuple[int, int, int], ...], tuple[tuple[int, int], ...]]:
    """(limits, cgroup manager, unenforced and refused-unless-allowed, degraded, rlimits,
    the hard limits those are clamped to)."""
    import resource

    from ..cgroups import base as cgbase
    from ..cgroups import detect as cgdetect
    from ..cgroups import rlimit as cgrlimit

    if limits is not None and requested is None:
        requested = {n for n in ("memory", "cpus", "pids") if getattr(limits, n) is not None}
    if limits is None:
        if not _DEFAULT_LIMITS:
            _DEFAULT_LIMITS.append(cgbase.Limits.defaults())
        limits = _DEFAULT_LIMITS[0]
    manager = cgdetect.detect()
    req = frozenset(requested or ())
    key = (limits, id(manager), req, allow)
    hit = _LIMITS.get(key)
    # rlimits are clamped to this process's hard limits, which it may lower at any time
    if hit is None or any(resource.getrlimit(r)[1] != h for r, h in hit[3]):
        checked = cgbase.check_enforceable(limits, manager, requested=set(req), allow_degraded=allow)
        unenforced = cgbase.degraded_limits(limits, manager)
        hard = tuple((r, resource.getrlimit(r)[1]) for r, _s, _h in cgrlimit.rlimits_for(limits, manager))
        rl = tuple(cgrlimit.rlimits_for(limits, manager))
        hit = (checked, unenforced, rl, hard)
        if len(_LIMITS) > 64:
            _LIMITS.clear()
        _LIMITS[key] = hit
    return limits, manager, hit[0], hit[1], hit[2], hit[3]


def disk_tmpfs(lim: Limits) -> int | None:
    """The size= of each writable tmpfs: the disk cap, but never more than the memory
    limit (tmpfs pages are RAM, charged to the run's memory cgroup: past that a write
    would be an OOM kill rather than ENOSPC)."""
    if lim.disk is None:
        return None
    return lim.disk if lim.memory is None else min(lim.disk, lim.memory)


def clear_caches() -> None:
    """Forget every cached plan, policy, scan and profile (tests)."""
    from .. import policy

    _PLANS.clear()
    _LIMITS.clear()
    _SECCOMP.clear()
    _DEFAULT_LIMITS.clear()
    policy.clear_cache()


# --------------------------------------------------------------------------- resolve: the policy step


def load_policy(project: Path, sess: store.Session | None, cli: CliSpec | CliPolicy | None,
                env: Mapping[str, str] | None, req: RunRequest | None = None) -> Effective:
    """The merged policy; ``req``'s network options are its command-line tier (as --env's)."""
    from .. import policy as polmod

    if isinstance(cli, CliSpec):
        cli = cli.build()
    if cli is None:
        cli = polmod.CliPolicy(env=dict(env)) if env else None
    elif env:
        cli = dataclasses.replace(cli, env={**cli.env, **env})
    if req is not None and (req.network is not None or req.allow_hosts or req.forward):
        cli = dataclasses.replace(cli or polmod.CliPolicy(), net_mode=req.network, allow_hosts=tuple(req.allow_hosts),
                                  forward=tuple(req.forward))
    return polmod.load_cached(project, sess.dir if sess is not None else None, cli)


def _check_options(req: RunRequest, argv: tuple[str, ...]) -> frozenset[str]:
    """Bad options: a one-line UsageError before anything is read or made."""
    if req.network not in (None, "none", "allow", "host"):
        raise UsageError(f"--net {req.network!r} is not a network mode; use none, allow or host")
    if isinstance(req.allow_hosts, str) or isinstance(req.forward, str | int):
        raise UsageError("allow_hosts and forward take a list (allow_hosts=['pypi.org'], forward=[5432])")
    degraded_ok = frozenset(req.allow_degraded)
    unknown = degraded_ok - _DEGRADABLE
    if unknown:
        raise UsageError(f"--allow-degraded {','.join(sorted(unknown))}: unknown; accepted: landlock, seccomp, limits, proc, hostname")
    if not req.landlock and "landlock" not in degraded_ok:
        raise UsageError("turning Landlock off needs --allow-degraded landlock")
    if req.observe:
        check_observe(True, req.seccomp)
    if req.seccomp == "off" and "seccomp" not in degraded_ok:
        raise UsageError("--seccomp off needs --allow-degraded seccomp")
    if not argv:
        raise UsageError("no command given; usage: stockade run [OPTIONS] -- CMD [ARGS...]")
    return degraded_ok


def check_observe(observe: bool, seccomp: str, *, origin: str = "--observe") -> None:
    """Bad input, before anything is made: observe mode stacks its filter on the
    policy's seccomp filter, so it needs one."""
    if not observe:
        return
    if seccomp == "off":
        fix = "drop --seccomp off, or run without --observe" if origin == "--observe" else \
            "drop --seccomp off, or pass --no-observe"
        raise UsageError(f"{origin} needs seccomp (observe mode stacks its own filter on the policy's); {fix}")
    from ..linux.seccomp.observe import supported

    why = supported()
    if why is not None:
        raise UsageError(f"{origin}: {why}")


def _cwd(project: Path, cwd: str | os.PathLike[str] | None) -> Path:
    if cwd is None:
        # getcwd() is already canonical (the kernel's path, no symlinks)
        try:
            here = os.getcwd()
        except OSError:
            return project
        proj = str(project)
        if here == proj:
            return project
        if here.startswith(proj.rstrip("/") + "/"):
            return Path(here)
        return project
    return planmod.resolve_cwd(project, cwd)


def resolve(sess: store.Session, project: Path, req: RunRequest, argv: tuple[str, ...], *,
            explain_only: bool = False) -> Resolved:
    """The full preparation: options, policy, environment, confinement, masks, limits."""
    degraded_ok = _check_options(req, argv)
    wd = _cwd(project, req.cwd)
    degraded: list[str] = []
    read_only = req.read_only

    # environment
    has_session = not explain_only or os.path.exists(os.path.join(sess.dir, "meta.json"))
    pol = load_policy(project, sess if has_session else None, req.policy, req.env, req)
    net = _network(pol, req)
    run_env, removed = pol.env(os.environ)
    if pol.read_only:
        read_only = True
    reason = pol.check_command(list(argv))
    if reason:
        if not explain_only:
            from ..audit import AuditLog

            try:
                AuditLog(sess).command_refused(None, list(argv), reason)
            except OSError:
                pass
        raise UsageError(f"command refused by policy: {reason}")

    # confinement: Landlock and seccomp, fail closed
    use_landlock = req.landlock
    if use_landlock and planmod.landlock_abi() == 0:
        if "landlock" in degraded_ok:
            use_landlock = False
            degraded.append("landlock (kernel has none)")
        else:
            raise SandboxError(
                "landlock_create_ruleset",
                errno=95,
                remedy="this kernel has no Landlock (needs 5.13+ with lsm=landlock); pass --allow-degraded landlock to run without it",
            )
    elif not use_landlock:
        degraded.append("landlock (turned off)")
    seccomp_name: str | None = None
    bpf = b""
    if req.seccomp != "off":
        bpf, seccomp_name = _seccomp(req.seccomp, degraded_ok, degraded)
    else:
        degraded.append("seccomp (turned off)")
    if "proc" in degraded_ok or "hostname" in degraded_ok:
        from ..linux import walls

        degraded.extend(walls.degraded(degraded_ok))  # only those this environment refuses

    # Secrets in the project are overlay content (a lower layer of whiteouts or empty
    # files: session/masklayer.py, made by ``finish``), never mounts. Those in grants,
    # and denied system and /etc paths, are mounted after the host is detached.
    masked_l = list(pol.masked(project))
    grant_masks = []
    for g in pol.grants:
        grant_masks.extend(pol.masked(g.host_path))
    grant_masks.extend(pol.outside_masks())
    mask_items = tuple((str(m.path), bool(m.is_dir), bool(m.is_symlink)) for m in masked_l)

    # limits
    limits, requested = pol.limits_over(req.limits, set(req.requested_limits) if req.requested_limits is not None else None)
    lim, cg_manager, refused, unenforced, rlimits, hard = _limits(limits, requested, "limits" in degraded_ok)
    if refused:
        degraded.append("limits not enforced for the whole sandbox: " + ", ".join(refused))
    timeout = req.timeout
    if timeout is None and lim.timeout is not None:
        timeout = lim.timeout

    inputs = PlanInputs(
        project=project, cwd=wd, env=run_env, root=req.root, user=req.user, read_only=read_only,
        network=net.mode, forward=net.forward if net.mode != "host" else (), keep_fds=tuple(req.pass_fds),
        masked=tuple((str(m.path), bool(m.is_dir)) for m in grant_masks if not m.is_symlink),
        grants=tuple((str(g.host_path), bool(g.writable)) for g in pol.grants),
        exec_allow=tuple(pol.exec_allow) if pol.exec_allow is not None else None,
        etc_extra=tuple(pol.etc_extra), landlock=use_landlock, seccomp_name=seccomp_name, seccomp_bpf=bpf,
        rlimits=rlimits, degraded=tuple(degraded), mask_items=mask_items, mask_mode=pol.mask_mode,
        tmpfs_size=disk_tmpfs(lim),
    )
    audit = AuditFacts(policy=pol, masked=tuple(masked_l + grant_masks), removed=tuple(removed), read_only=read_only,
                       project=str(project), unenforced=tuple(unenforced))
    deps = None if explain_only else _deps(pol, project, req.seccomp, hard)
    proxied = net.mode == "allow" or (net.mode == "none" and bool(net.forward))
    observe = req.observe if req.observe is not None else pol.observe
    if observe and req.observe is None:
        check_observe(True, req.seccomp, origin=f"[audit] observe = true (from {pol.observe_origin})")
    return Resolved(inputs, cg_manager, lim, timeout, audit, deps, net if proxied else None, bool(observe))


def _network(pol: Effective, req: RunRequest) -> NetPolicy:
    """The run's network policy (every tier, the request's options on top), refusing
    options that cannot take effect: host rules given for a run without ``--net allow``,
    ports forwarded into a run with the host's network."""
    net = pol.network
    if req.allow_hosts and net.mode != "allow":
        raise UsageError(f"--allow-host needs --net allow (the network mode is {net.mode}); "
                         "add --net allow, or set [network] mode = \"allow\"")
    if req.forward and net.mode == "host":
        raise UsageError("--forward: the host's network already reaches its ports; forward with --net none or allow")
    return net


def _deps(pol: Effective, project: Path, seccomp: str, hard: tuple[tuple[int, int], ...]) -> Deps | None:
    """What ``pol`` and the host facts were made from; None when some of it cannot be
    checked later by signatures (a file changed within the timestamp granularity, a
    directory changed so recently that a scan would list it again, conditional secret
    files, command rules, a seccomp profile given as a path)."""
    from ..pathsig import RACY_NS, file_sig

    entry = pol.cached_by
    if entry is None or pol.command_entries or any(c is not None for _f, _s, c in entry.files):
        return None
    scans: dict[str, tuple[tuple[tuple[str, int, int], ...], tuple[tuple[str, bool, bool, bool], ...]]] = {}
    for root, (scan, deny_facts, errors) in pol.scan_deps.items():
        if errors:
            return None
        racy_before = int(scan.get("scanned_ns", 0)) - RACY_NS
        dirs = []
        for rel, ent in scan.get("dirs", {}).items():
            if ent[4] or ent[0] >= racy_before:  # conditional files, or a directory changed too recently
                return None
            dirs.append((rel, ent[0], ent[1]))
        scans[root] = (tuple(dirs), tuple(deny_facts))
    planmod.host_facts(tuple(pol.etc_extra))  # what the plan will be built on (memoised)
    facts = planmod.facts_sig(tuple(pol.etc_extra))
    if facts is None:
        return None
    sc = None
    if seccomp != "off":
        hit = _SECCOMP.get(seccomp)
        if hit is None:
            return None
        sc = (hit[1], hit[2])
    owner = None
    if os.geteuid() == 0:
        st = os.stat(project)
        owner = (st.st_uid, st.st_gid)
    sd = pol.session_dir
    return Deps(
        policy_files=tuple((f, s) for f, s, _c in entry.files),
        # the session tier: a run in another session reuses this only if that one has no
        # policy file either (or is this session, with this file)
        session_policy=(str(sd), file_sig(os.path.join(sd, "policy.json"))) if sd else None,
        policy_dirs={k: (v[0], tuple(v[1])) for k, v in entry.dirs.items()},
        policy_resolved=tuple(entry.resolved),
        policy_exists=tuple(entry.exists),
        scans=scans,
        etc=facts,
        passwd=passwd_sig(),
        owner=owner,
        seccomp=sc,
        rlimits=hard,
        landlock=planmod.landlock_abi(),
    )
