"""From a request to a Plan: policy, environment, confinement, masks, limits.

``prepare`` runs before every sandboxed command, so what it reads is cached and
revalidated rather than recomputed: the merged policy (``policy.load_cached``:
tier files, resolved paths), the filtered environment (while ``os.environ`` is
unchanged), the secret scan (incremental, per directory), compiled seccomp
profiles (by the profile file's identity), host facts (``/etc`` entries by
``lstat``) and finally the Plan itself, reused when every input is equal.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import plan as planmod
from .errors import SandboxError, UsageError
from .session import store

# proc, hostname: walls a container engine can refuse (linux/walls.py)
_DEGRADABLE = frozenset({"landlock", "seccomp", "limits", "cgroups", "proc", "hostname"})


class Prepared:
    """What a run executes: the plan, its cgroup backend and limits, the audit facts."""

    __slots__ = ("audit", "cg_manager", "limits", "plan", "timeout")

    def __init__(self, plan: planmod.Plan, cg_manager: Any, limits: Any, timeout: float | None, audit: dict[str, Any] | None = None) -> None:
        self.plan = plan
        self.cg_manager = cg_manager
        self.limits = limits
        self.timeout = timeout
        self.audit: dict[str, Any] = audit if audit is not None else {}


def argv_of(args: Sequence[str] | str, shell: bool) -> tuple[str, ...]:
    if isinstance(args, str | bytes):
        if shell:
            return ("/bin/sh", "-c", os.fsdecode(args))
        return (os.fsdecode(args),)
    if shell:
        return ("/bin/sh", "-c", " ".join(args))
    return tuple(os.fsdecode(a) for a in args)


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
    from .linux import seccomp as sc

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
_DEFAULT_LIMITS: list[Any] = []


def _limits(limits: Any, requested: set[str] | None, allow: bool) -> tuple[Any, Any, list[str], list[str], tuple[tuple[int, int, int], ...]]:
    """(limits, cgroup manager, unenforced and refused-unless-allowed, degraded, rlimits)."""
    import resource

    from .cgroups import base as cgbase
    from .cgroups import detect as cgdetect

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
        hard = tuple((r, resource.getrlimit(r)[1]) for r, _s, _h in cgbase.rlimits_for(limits, manager))
        rl = tuple(cgbase.rlimits_for(limits, manager))
        hit = (checked, unenforced, rl, hard)
        if len(_LIMITS) > 64:
            _LIMITS.clear()
        _LIMITS[key] = hit
    return limits, manager, hit[0], hit[1], hit[2]


# --------------------------------------------------------------------------- plans

_PLANS: dict[tuple[Any, ...], tuple[planmod.HostFacts, planmod.Plan, tuple[Any, ...]]] = {}


def _passwd_sig() -> tuple[Any, ...]:
    out: list[Any] = []
    for f in ("/etc/passwd", "/etc/group"):
        try:
            st = os.stat(f)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def _with(plan: planmod.Plan, **changes: Any) -> planmod.Plan:
    """A copy of a (frozen) plan with some fields changed, without re-running its __init__.

    The copy remembers the plan it was first made from (``_origin``, not a field):
    the launcher then packs it from that one's packed form (``launcher._derived``)."""
    p = object.__new__(planmod.Plan)
    p.__dict__.update(plan.__dict__)
    p.__dict__["_origin"] = plan.__dict__.get("_origin", plan)
    for k, v in changes.items():
        object.__setattr__(p, k, v)
    return p


def _build(req: planmod.Request) -> planmod.Plan:
    """``plan.build(req)``, reusing the plan of an equal request on unchanged host facts.

    The command, and the session's layers (the overlay's upper, work and lower dirs),
    are not part of the match: a plan for another command or session is a copy with
    those replaced."""
    facts = planmod.host_facts(req.etc_extra)
    owner: Any = None
    if facts.euid == 0 and req.user is None:
        st = os.stat(req.project)
        owner = (st.st_uid, st.st_gid)
    key = (
        str(req.project), str(req.cwd), tuple(req.env.items()), bool(req.lower_layers), req.upper is None, req.work is None,
        req.root, req.user, req.read_only, req.network, req.hostname, req.keep_fds, req.masked, req.grants,
        req.exec_allow, req.etc_extra, req.landlock, req.seccomp_name, req.seccomp_bpf, req.rlimits,
        req.degraded, req.stage_dir, owner, _passwd_sig(),
    )
    layers = (req.lower_layers, req.upper, req.work)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] == facts:
        _facts, plan, built_layers = hit
        if layers != built_layers:
            plan = _with(plan, mounts=_relayered(plan, req.lower_layers, req.upper, req.work))
        if plan.argv != req.argv:
            plan = _with(plan, argv=tuple(req.argv))
        return plan
    plan = planmod.build(req, facts)
    if len(_PLANS) > 32:
        _PLANS.clear()
    _PLANS[key] = (facts, plan, layers)
    return plan


def _relayered(plan: planmod.Plan, lower_layers: tuple[Any, ...], upper_dir: Any, work_dir: Any) -> tuple[planmod.MountOp, ...]:
    """The plan's mounts with the project's overlay made of these layers."""
    project = plan.project
    lower = (*(str(p) for p in lower_layers), project)
    upper = None if upper_dir is None else str(upper_dir)
    work = None if work_dir is None else str(work_dir)
    ops = list(plan.mounts)
    for i, m in enumerate(ops):
        if m.kind == "overlay" and m.target == project:
            op = object.__new__(planmod.MountOp)
            op.__dict__.update(m.__dict__)
            object.__setattr__(op, "lower", lower)
            object.__setattr__(op, "upper", upper)
            object.__setattr__(op, "work", work)
            ops[i] = op
            break
    return tuple(ops)


def clear_caches() -> None:
    """Forget every cached plan, policy, scan and profile (tests)."""
    from . import policy

    _PLANS.clear()
    _LIMITS.clear()
    _SECCOMP.clear()
    _DEFAULT_LIMITS.clear()
    policy.clear_cache()


# --------------------------------------------------------------------------- prepare


class CliSpec:
    """Policy flags of the command line, made a ``CliPolicy`` only when a run is
    prepared in full (importing the policy package is what a warm CLI run avoids)."""

    __slots__ = ("fields",)

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    @property
    def key(self) -> tuple[Any, ...]:
        return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in self.fields.items()))

    def build(self) -> Any:
        from .policy import CliPolicy

        return CliPolicy(**self.fields)


def load_policy(project: Path, sess: store.Session | None, cli: Any, env: Mapping[str, str] | None) -> Any:
    from . import policy as polmod

    if isinstance(cli, CliSpec):
        cli = cli.build()
    if cli is None:
        cli = polmod.CliPolicy(env=dict(env)) if env else None
    elif env:
        import dataclasses

        cli = dataclasses.replace(cli, env={**cli.env, **env})
    return polmod.load_cached(project, sess.dir if sess is not None else None, cli)


def _check_pass_fds(pass_fds: Sequence[int]) -> None:
    """Each fd must be the caller's (a CLI server's supervisor holds its client's
    under other numbers: ``callerfds``), never just any fd of this process."""
    from .callerfds import source

    for fd in pass_fds:
        if source(fd) is None:
            raise UsageError(f"--pass-fd {fd}: not an open file descriptor")


def prepare(
    sess: store.Session,
    project: Path,
    args: Sequence[str] | str,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    shell: bool = False,
    root: bool = False,
    user: int | None = None,
    read_only: bool = False,
    network: str = "none",
    pass_fds: Sequence[int] = (),
    seccomp: str = "default",
    allow_degraded: Sequence[str] = (),
    landlock: bool = True,
    limits: Any = None,
    requested_limits: set[str] | None = None,
    policy: Any = None,
    explain_only: bool = False,
    persist: bool = False,
) -> Prepared:
    """The plan and everything else a run of ``args`` in ``sess`` needs.

    ``persist`` (the CLI): keep the result on disk for later processes (``stockade.warm``)."""
    argv = argv_of(args, shell)
    wkey: tuple[Any, ...] | None = None
    if persist and argv and not explain_only and limits is None and requested_limits is None and (policy is None or isinstance(policy, CliSpec)):
        from . import warm

        wkey = (
            "run", str(project), None if cwd is None else os.fspath(cwd), timeout, shell, root, user, read_only, network,
            tuple(pass_fds), seccomp, tuple(allow_degraded), landlock, None if policy is None else policy.key,
            None if not env else tuple(sorted(env.items())),
        )
        if not {"proc", "hostname"}.isdisjoint(allow_degraded):
            from .linux import walls

            wkey += walls.ns_key()  # the probes' answers hold for these namespaces only
        hit = warm.load(wkey, sess, argv)
        if hit is not None:
            if os.geteuid() == 0 and not hit.plan.read_only:
                _own_upper(sess, project)
            _check_pass_fds(pass_fds)
            return hit
    if network not in ("none", "host"):
        raise UsageError(f"--net {network!r} is not a network mode; use none or host")
    degraded_ok = frozenset(allow_degraded)
    unknown = degraded_ok - _DEGRADABLE
    if unknown:
        raise UsageError(f"--allow-degraded {','.join(sorted(unknown))}: unknown; accepted: landlock, seccomp, limits, proc, hostname")
    if not landlock and "landlock" not in degraded_ok:
        raise UsageError("turning Landlock off needs --allow-degraded landlock")
    if seccomp == "off" and "seccomp" not in degraded_ok:
        raise UsageError("--seccomp off needs --allow-degraded seccomp")
    if not argv:
        raise UsageError("no command given; usage: stockade run [OPTIONS] -- CMD [ARGS...]")

    wd = _cwd(project, cwd)
    degraded: list[str] = []

    # environment
    has_session = not explain_only or os.path.exists(os.path.join(sess.dir, "meta.json"))
    pol = load_policy(project, sess if has_session else None, policy, env)
    run_env, removed = pol.env(os.environ)
    if pol.read_only:
        read_only = True
    reason = pol.check_command(list(argv))
    if reason:
        if not explain_only:
            from .audit import AuditLog

            try:
                AuditLog(sess).command_refused(None, list(argv), reason)
            except OSError:
                pass
        raise UsageError(f"command refused by policy: {reason}")

    # confinement: Landlock and seccomp, fail closed
    use_landlock = landlock
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
    if seccomp != "off":
        bpf, seccomp_name = _seccomp(seccomp, degraded_ok, degraded)
    else:
        degraded.append("seccomp (turned off)")
    if "proc" in degraded_ok or "hostname" in degraded_ok:
        from .linux import walls

        degraded.extend(walls.degraded(degraded_ok))  # only those this environment refuses

    lower_layers: list[Path] = [] if read_only else sess.layers()[::-1]
    masked_l: list[Any] = list(pol.masked(project))
    items: list[tuple[str, bool, bool]] = []
    grant_masks: list[Any] = []
    for g in pol.grants:
        grant_masks.extend(pol.masked(g.host_path))
    grant_masks.extend(pol.outside_masks())  # denied system and /etc paths: mounted like the grants'
    # Secrets in the project are overlay content (a lower layer of whiteouts or empty
    # files), never mounts: see session/masklayer.py. Those in grants are mounted after
    # the host is detached.
    if masked_l:
        if explain_only:
            lower_layers.append(sess.dir / "masks" / "(layer)")
        else:
            from .session.masklayer import ensure_mask_layer

            items = [(str(m.path), bool(m.is_dir), bool(m.is_symlink)) for m in masked_l]
            lower_layers.append(ensure_mask_layer(sess, items, project, pol.mask_mode))
    masked = tuple((str(m.path), bool(m.is_dir)) for m in grant_masks if not m.is_symlink)
    masked_l = masked_l + grant_masks
    grants = tuple((str(g.host_path), bool(g.writable)) for g in pol.grants)
    exec_allow = tuple(pol.exec_allow) if pol.exec_allow is not None else None
    etc_extra = tuple(pol.etc_extra)

    # limits
    limits, requested_limits = pol.limits_over(limits, requested_limits)  # the config's `limits` table
    lim, cg_manager, refused, unenforced, rlimits = _limits(limits, requested_limits, "limits" in degraded_ok)
    if refused:
        degraded.append("limits not enforced for the whole sandbox: " + ", ".join(refused))
    if timeout is None and lim.timeout is not None:
        timeout = lim.timeout

    req = planmod.Request(
        argv=argv,
        project=project,
        cwd=wd,
        env=run_env,
        lower_layers=tuple(lower_layers),
        upper=None if read_only else sess.upper,
        work=None if read_only else sess.work,
        root=root,
        user=user,
        read_only=read_only,
        network=network,
        keep_fds=tuple(pass_fds),
        masked=masked,
        grants=grants,
        exec_allow=exec_allow,
        etc_extra=etc_extra,
        landlock=use_landlock,
        seccomp_name=seccomp_name,
        seccomp_bpf=bpf,
        rlimits=rlimits,
        degraded=tuple(degraded),
    )
    plan = _build(req)
    if not explain_only and not read_only and os.geteuid() == 0:
        _own_upper(sess, project)
    if len(pass_fds) > 64:
        raise UsageError(f"--pass-fd: at most 64 descriptors can be passed, not {len(pass_fds)}")
    _check_pass_fds(pass_fds)
    info = {"policy": pol, "masked": masked_l, "removed": removed, "read_only": read_only, "project": str(project),
            "unenforced": tuple(unenforced)}
    prep = Prepared(plan, cg_manager, lim, timeout, info)
    if wkey is not None:
        from . import warm

        warm.save(wkey, prep, seccomp=seccomp, masked_items=items, mask_mode=pol.mask_mode, read_only=read_only)
    return prep
