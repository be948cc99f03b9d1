"""Plan building, no privileges: mounts in order, identities, Landlock degradation."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade import plan as P
from stockade.errors import UsageError
from stockade.linux.idmap import Range


def facts(euid: int = 1000, abi: int = 7, *, privileged: bool | None = None, rng: Range | None = None) -> P.HostFacts:
    return P.HostFacts(
        euid=euid,
        egid=euid,
        system=(("/usr", None), ("/bin", "usr/bin"), ("/lib64", "usr/lib64")),
        etc=(("nsswitch.conf", "file", b"passwd: files\n"), ("localtime", "symlink", "/usr/share/zoneinfo/UTC"), ("ssl", "dir", "")),
        proc_entries=frozenset({"sys", "sysrq-trigger", "kcore", "acpi", "1", "self"}),
        landlock_abi=abi,
        privileged=euid == 0 if privileged is None else privileged,
        uid_range=rng,
        gid_range=rng,
        range_why="" if rng else "no range in this test",
    )


def req(tmp_path: Path, **kw: object) -> P.Request:
    proj = tmp_path / "home" / "u" / "proj"
    proj.mkdir(parents=True, exist_ok=True)
    base: dict[str, object] = dict(
        argv=("make",), project=proj, cwd=proj, env={"PATH": "/usr/bin"},
        upper=tmp_path / "s" / "upper", work=tmp_path / "s" / "work",
    )
    base.update(kw)
    return P.Request(**base)  # type: ignore[arg-type]


def test_mount_order_and_views(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path), facts())
    targets = [m.target for m in plan.mounts]
    kinds = {m.target: m.kind for m in plan.mounts}
    assert kinds["/usr"] == "bind" and "ro" in next(m for m in plan.mounts if m.target == "/usr").flags
    assert kinds["/bin"] == "symlink"
    assert kinds["/proc"] == "proc" and kinds["/dev/pts"] == "devpts" and kinds["/tmp"] == "tmpfs"
    proj = str(tmp_path / "home/u/proj")
    assert kinds[proj] == "overlay"
    ov = next(m for m in plan.mounts if m.kind == "overlay")
    assert ov.lower == (proj,) and ov.upper == str(tmp_path / "s/upper")
    # /dev before the /proc masks that bind /dev/null; /proc before its read-only binds
    assert targets.index("/dev") < targets.index("/proc/kcore")
    assert targets.index("/proc") < targets.index("/proc/sys")
    assert plan.mounts[-1].kind == "remount-ro" and plan.mounts[-1].target == "/"
    # /sys: only the documented pieces, each a read-only bind of the same host path
    assert any(h.startswith("/sys (except ") for h in plan.hidden)
    sys_ops = [m for m in plan.mounts if m.target == "/sys" or m.target.startswith("/sys/")]
    assert [m.target for m in sys_ops] == [p for p, _ in P.SYS_EXPOSED]
    assert all(m.kind == "bind" and m.source == m.target and "ro" in m.flags and "rec" not in m.flags for m in sys_ops)
    # /var/tmp and /run: private tmpfs, never a bind of the host's
    assert kinds["/var/tmp"] == "tmpfs" and kinds["/run"] == "tmpfs"
    assert not any(m.kind == "bind" and (m.source or "").startswith(("/run", "/var")) for m in plan.mounts)
    assert plan.cwd == proj


def test_project_under_tmp_and_home_is_mounted_after_them(tmp_path: Path) -> None:
    r = req(tmp_path)
    plan = P.build(r, facts())
    order = [m.target for m in plan.mounts]
    assert order.index("/tmp") < order.index(str(r.project))


def test_identity_unprivileged_and_root(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path), facts(euid=1000))
    assert (plan.uid, plan.uid_map.line(), plan.deny_setgroups) == (1000, "1000 1000 1\n", True)
    plan = P.build(req(tmp_path, root=True), facts(euid=1000))
    assert (plan.uid, plan.uid_map.line()) == (0, "0 1000 1\n")
    # real root runs as the project's owner by default, or --user
    # host root (whose credentials make the mounts) is mapped too, as 0, or as nobody under --root
    plan = P.build(req(tmp_path, user=4242), facts(euid=0))
    assert (plan.uid, plan.uid_map.line(), plan.drop_groups, plan.deny_setgroups) == (4242, "4242 4242 1\n0 0 1\n", True, False)
    plan = P.build(req(tmp_path, user=4242, root=True), facts(euid=0))
    assert (plan.uid, plan.uid_map.line()) == (0, "0 4242 1\n65534 0 1\n")
    plan = P.build(req(tmp_path, user=0), facts(euid=0))
    assert (plan.uid, plan.uid_map.line(), plan.gid_map.line()) == (0, "0 0 1\n", "0 0 1\n")
    with pytest.raises(UsageError):
        P.build(req(tmp_path, user=4242), facts(euid=1000))


ROOT_RANGE = Range(1879048192, 65536, "built-in")
SUB = Range(400000, 65536, "/etc/subuid (uid 1000)", "/usr/bin/newuidmap")


def test_a_range_fills_the_other_ids_and_root_inside_keeps_a_few_capabilities(tmp_path: Path) -> None:
    # real root over a root-owned project: 0 is host root, 1..65535 the range
    plan = P.build(req(tmp_path, user=0), facts(euid=0, rng=ROOT_RANGE))
    assert plan.uid_map.line() == "0 0 1\n1 1879048193 65535\n" and plan.uid_map.helper is None
    assert plan.keep_caps == P.KEEP_CAPS and "CAP_SYS_ADMIN" not in plan.keep_caps
    assert (plan.drop_groups, plan.deny_setgroups) == (True, False)
    # real root as the owner 4242: host root (the mounter) and 4242 are cut out of the range
    plan = P.build(req(tmp_path, user=4242), facts(euid=0, rng=ROOT_RANGE))
    assert plan.uid_map.line() == ("4242 4242 1\n0 0 1\n1 1879048193 4241\n4243 1879052435 61293\n")
    assert plan.keep_caps == ()  # not root inside
    # --root over another owner's project: host root is mapped as the mounter, so
    # no range and no capability (root inside would reach host root's files)
    plan = P.build(req(tmp_path, user=4242, root=True), facts(euid=0, rng=ROOT_RANGE))
    assert (plan.uid_map.line(), plan.keep_caps) == ("0 4242 1\n65534 0 1\n", ())
    assert any("--root over a project owned by another user" in n for n in plan.notes)
    # an unprivileged caller's subordinate range: newuidmap writes it, setgroups stays allowed
    plan = P.build(req(tmp_path, root=True), facts(euid=1000, rng=SUB))
    assert plan.uid_map.line() == "0 1000 1\n1 400001 65535\n" and plan.uid_map.helper == "/usr/bin/newuidmap"
    assert (plan.keep_caps, plan.deny_setgroups, plan.drop_groups) == (P.KEEP_CAPS, False, True)
    plan = P.build(req(tmp_path), facts(euid=1000, rng=SUB))
    assert plan.uid_map.line() == "1000 1000 1\n0 400000 1000\n1001 401001 64535\n"
    assert plan.keep_caps == ()
    # without a range: the single map, and the note says why
    plan = P.build(req(tmp_path, root=True), facts(euid=1000))
    assert (plan.uid_map.line(), plan.keep_caps) == ("0 1000 1\n", ())
    assert any(n.startswith("ids: only the sandbox user's id is mapped (no range in this test)") for n in plan.notes)


def test_an_empty_command_or_a_negative_user_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="the command is an empty string"):
        P.build(req(tmp_path, argv=("",)), facts())
    with pytest.raises(UsageError, match="user -5 is not a uid"):
        P.build(req(tmp_path, user=-5), facts(euid=0))


def test_explain_redacts_the_command_as_the_records_do(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path, argv=("curl", "-H", "Authorization: Bearer sk-abcdef1234567890abcdef", "x")), facts())
    text = plan.describe()
    assert "sk-abcdef1234567890abcdef" not in text and "[REDACTED]" in text


def test_root_in_a_nested_user_namespace_is_planned_as_unprivileged(tmp_path: Path) -> None:
    # `unshare -Ur`: euid 0, setgroups "deny", one id: nothing to map but itself, no setgroups
    plan = P.build(req(tmp_path), facts(euid=0, privileged=False))
    assert (plan.uid, plan.uid_map.line(), plan.deny_setgroups, plan.drop_groups) == (0, "0 0 1\n", True, False)
    with pytest.raises(UsageError):
        P.build(req(tmp_path, user=4242), facts(euid=0, privileged=False))


def test_passwd_is_synthesized(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path), facts(euid=1000))
    passwd = next(m for m in plan.mounts if m.target == "/etc/passwd")
    assert isinstance(passwd.data, bytes) and b":1000:1000:" in passwd.data
    assert b"root:x:0:0" in passwd.data


def test_read_only_mode_binds_project_ro(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path, read_only=True, upper=None, work=None), facts())
    m = next(m for m in plan.mounts if m.target == str(tmp_path / "home/u/proj"))
    assert m.kind == "bind" and "ro" in m.flags
    assert not any(m.kind == "overlay" for m in plan.mounts)


@pytest.mark.parametrize(("abi", "fs", "net", "scoped"), [(1, (1 << 13) - 1, 0, 0), (2, (1 << 14) - 1, 0, 0), (3, (1 << 15) - 1, 0, 0), (4, (1 << 15) - 1, 3, 0), (5, (1 << 16) - 1, 3, 0), (6, (1 << 16) - 1, 3, 3), (7, (1 << 16) - 1, 3, 3)])
def test_landlock_rights_degrade_by_abi(tmp_path: Path, abi: int, fs: int, net: int, scoped: int) -> None:
    # a passed fd keeps the TCP rules (network none without one: test_hosts_env.py)
    plan = P.build(req(tmp_path, keep_fds=(5,)), facts(abi=abi))
    assert plan.landlock is not None
    assert (plan.landlock.handled_fs, plan.landlock.handled_net, plan.landlock.scoped) == (fs, net, scoped)
    proj = str(tmp_path / "home/u/proj")
    rules = {p: a for p, a, _ in plan.landlock.rules}
    assert rules[proj] & P.LL_WRITE_FILE and rules["/tmp"] & P.LL_MAKE_REG
    assert not rules["/usr"] & P.LL_WRITE_FILE
    for p, a, _ in plan.landlock.rules:
        assert a & ~fs == 0 or p.startswith("/dev"), (p, hex(a))


def test_exec_allow_limits_execute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "elf_loaders", lambda: ())  # the loader: see the test below
    plan = P.build(req(tmp_path, exec_allow=("/usr/bin",)), facts())
    assert plan.landlock is not None
    execs = [p for p, a, _ in plan.landlock.rules if a & P.LL_EXECUTE]
    assert execs == ["/usr/bin"]


def test_masks_and_grants(tmp_path: Path) -> None:
    proj = tmp_path / "home/u/proj"
    plan = P.build(req(tmp_path, masked=((str(proj / ".env"), False), (str(proj / ".ssh"), True)), grants=(("/opt/tools", False),)), facts())
    by = {m.target: m for m in plan.mounts}
    assert by[str(proj / ".env")].kind == "bind" and "ro" in by[str(proj / ".env")].flags
    assert by[str(proj / ".ssh")].kind == "tmpfs"
    assert by["/opt/tools"].kind == "bind" and "ro" in by["/opt/tools"].flags
    order = [m.target for m in plan.mounts]
    assert order.index(str(proj)) < order.index(str(proj / ".env"))


def test_describe_is_printable(tmp_path: Path) -> None:
    text = P.build(req(tmp_path), facts()).describe()
    assert "namespaces:  user mount pid net ipc uts cgroup" in text
    assert "overlay" in text and "landlock:    ABI 7" in text


def test_resolve_cwd(tmp_path: Path) -> None:
    proj = tmp_path / "p"
    (proj / "sub").mkdir(parents=True)
    assert P.resolve_cwd(proj, "sub") == proj / "sub"
    with pytest.raises(UsageError):
        P.resolve_cwd(proj, "/")
    with pytest.raises(UsageError):
        P.resolve_cwd(proj, "missing")
    with pytest.raises(UsageError):
        P.resolve_project(tmp_path / "missing")


def test_no_command(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        P.build(req(tmp_path, argv=()), facts())


def test_grants_inside_the_project_or_a_rw_grant_are_refused(tmp_path: Path) -> None:
    proj = tmp_path / "home/u/proj"
    with pytest.raises(UsageError, match="inside the project"):
        P.build(req(tmp_path, grants=((str(proj / "data"), True),)), facts())
    with pytest.raises(UsageError, match="inside the read-write grant"):
        P.build(req(tmp_path, grants=(("/opt/cache", True), ("/opt/cache/sub", False))), facts())


def test_masks_are_mounted_after_the_host_is_detached(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path, masked=(("/opt/tools/.env", False),), grants=(("/opt/tools", False),)), facts())
    order = [(m.kind, m.target) for m in plan.mounts]
    assert order.index(("detach-host", "/")) < order.index(("bind", "/opt/tools/.env"))
    mask = next(m for m in plan.mounts if m.target == "/opt/tools/.env")
    assert mask.source_in_stage and mask.source == "/empty"


def test_exec_allow_adds_the_dynamic_loader_read_execute_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An allowlist of /usr/bin needs the loader in /usr/lib: the file alone, never write."""
    ld = "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    monkeypatch.setattr(P, "elf_loaders", lambda: (ld,))
    plan = P.build(req(tmp_path, exec_allow=("/usr/bin",)), facts())
    assert plan.landlock is not None
    rules = {p: acc for p, acc, _ in plan.landlock.rules}
    assert rules[ld] == P.LL_EXECUTE | P.LL_READ_FILE | P.LL_READ_DIR
    assert "/usr/lib" not in rules  # not the library dirs: they need read only (system trees have it)
    assert any(ld in n and "loader" in n for n in plan.notes)
    # an allowlist that covers the loader adds nothing; no allowlist adds nothing
    for allow in (("/usr",), None):
        p2 = P.build(req(tmp_path, exec_allow=allow), facts())
        assert p2.landlock is not None and ld not in {p for p, _a, _o in p2.landlock.rules}
        assert not any("loader" in n for n in p2.notes)


def test_pt_interp_of_the_shell_is_a_loader_found_by_name() -> None:
    interp = P._pt_interp("/bin/sh")
    if interp is None:
        pytest.skip("/bin/sh is statically linked")
    import os

    assert os.path.realpath(interp) in P.elf_loaders()


def test_masks_of_system_paths_split_for_the_launcher(tmp_path: Path) -> None:
    """A denied system file is masked per run; the launcher's shared base must not make
    its mount point again (an O_TRUNC open through the read-only /usr bind: EROFS)."""
    from stockade.launch import launcher

    masked = (("/usr/bin/python3.11", False), ("/usr/share/doc", True), ("/etc/ssl", True))
    plan = P.build(req(tmp_path, masked=masked), facts())
    parts = launcher.split(plan)
    assert parts is not None
    base, run = parts
    for target, _is_dir in masked:
        assert not any(m.target == target and m.why == "mount point" for m in base), target
        assert any(m.target == target and m.kind in ("bind", "tmpfs") for m in run), target
