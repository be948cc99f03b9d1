"""Seccomp profile compiler: validation, semantics (through the BPF interpreter), cache, CLI."""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stockade.errors import PolicyError
from stockade.linux import seccomp
from stockade.linux.seccomp import cache as seccomp_cache
from stockade.linux.seccomp import lib as seccomp_lib

try:
    seccomp.libseccomp_version()
except Exception as exc:  # pragma: no cover - depends on the machine
    if os.environ.get("STOCKADE_MUST_WORK") == "1":
        raise
    pytest.skip(f"libseccomp unavailable: {exc}", allow_module_level=True)

ALLOW = seccomp.SECCOMP_RET_ALLOW
KILL_PROCESS = seccomp.SECCOMP_RET_KILL_PROCESS
I386 = seccomp.AUDIT_ARCH_I386
M64 = 0xFFFFFFFFFFFFFFFF


def eperm() -> int:
    return seccomp.SECCOMP_RET_ERRNO | errno.EPERM


def enosys() -> int:
    return seccomp.SECCOMP_RET_ERRNO | errno.ENOSYS


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    seccomp.clear_memory_cache()
    yield
    seccomp.clear_memory_cache()


def run(profile: str, name: str | int, *args: int, arch: int | None = None) -> int:
    f = seccomp.compile_profile(profile)
    nr = seccomp.syscall_number(name) if isinstance(name, str) else name
    return int(seccomp.evaluate(f.bpf, nr, args, arch=arch))


def write_profile(tmp_path: Path, doc: Any, name: str = "p.json") -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


BASE_ALLOW = [
    "read", "write", "close", "execve", "exit_group", "exit", "rt_sigprocmask", "rt_sigtimedwait",
    "rt_sigreturn", "wait4", "kill", "setpgid", "setsid", "dup2", "dup3", "ioctl",
]  # fmt: skip


def minimal(extra: list[dict[str, Any]] | None = None, **top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 38,
        "syscalls": [
            {"names": BASE_ALLOW, "action": "SCMP_ACT_ALLOW"},
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ALLOW",
                "args": [
                    {"index": 0, "value": 0x7E020080, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
                ],
            },
            *(extra or []),
        ],
    }
    doc.update(top)
    return doc


# ---- the builtin profiles ------------------------------------------------------------
@pytest.mark.parametrize("name", seccomp.BUILTIN_PROFILES)
def test_builtin_compiles(name: str) -> None:
    f = seccomp.compile_profile(name)
    assert f.name == name
    assert len(f.bpf) % 8 == 0 and 0 < f.instructions <= 4096
    assert len(f.digest) == 64
    # every instruction is a well-formed sock_filter
    for i in range(f.instructions):
        struct.unpack_from("=HBBI", f.bpf, i * 8)


@pytest.mark.parametrize("name", seccomp.BUILTIN_PROFILES)
def test_builtin_escapes_denied(name: str) -> None:
    for sc in [
        "unshare", "setns", "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount",
        "fspick", "move_mount", "open_tree", "mount_setattr", "keyctl", "add_key", "request_key",
        "bpf", "perf_event_open", "userfaultfd", "open_by_handle_at", "name_to_handle_at",
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
        "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime",
        "adjtimex", "clock_adjtime", "iopl", "ioperm", "chroot", "syslog",
    ]:  # fmt: skip
        assert run(name, sc) == eperm(), sc
    for sc in ["clone3", "io_uring_setup", "io_uring_enter", "io_uring_register"]:
        assert run(name, sc) == enosys(), sc


@pytest.mark.parametrize("name", seccomp.BUILTIN_PROFILES)
def test_builtin_clone_namespace_flags(name: str) -> None:
    sigchld = 17
    assert run(name, "clone", sigchld) == ALLOW
    assert run(name, "clone", 0x01200000 | sigchld) == ALLOW  # glibc fork
    assert run(name, "clone", 0x003D0F00) == ALLOW  # pthread_create
    assert run(name, "clone", 0x4100 | sigchld) == ALLOW  # vfork (posix_spawn)
    for flag in [
        0x20000,
        0x2000000,
        0x4000000,
        0x8000000,
        0x10000000,
        0x20000000,
        0x40000000,
        0x80,
    ]:
        assert run(name, "clone", flag | sigchld) == eperm(), hex(flag)
        # high bits cannot hide a flag: the compare is on the flag bits only
        assert run(name, "clone", (0xFFFF << 48) | flag | sigchld) == eperm(), hex(flag)


@pytest.mark.parametrize("name", seccomp.BUILTIN_PROFILES)
def test_builtin_tiocsti_masked(name: str) -> None:
    for req in (0x5412, 0x541C):
        assert run(name, "ioctl", 0, req) == eperm()
        assert run(name, "ioctl", 0, (1 << 32) | req) == eperm()
        assert run(name, "ioctl", 0, 0xFFFFFFFF00000000 | req) == eperm()
    assert run(name, "ioctl", 0, 0x5413) == ALLOW  # TIOCGWINSZ
    assert run(name, "ioctl", 0, 0x540E) == ALLOW  # TIOCSCTTY (init, shell)
    assert run(name, "ioctl", 0, 0xFFFFFFFF80045400) == ALLOW  # sign-extended _IOR


@pytest.mark.parametrize("name", seccomp.BUILTIN_PROFILES)
def test_builtin_foreign_abis_killed(name: str) -> None:
    getpid_x32 = 0x40000000 | 39
    assert run(name, getpid_x32) == KILL_PROCESS
    assert run(name, 0x40000000 | 0) == KILL_PROCESS  # x32 read
    assert run(name, 20, arch=I386) == KILL_PROCESS  # i386 getpid
    assert run(name, 39, arch=0x12345678) == KILL_PROCESS


@pytest.mark.parametrize("name", seccomp.BUILTIN_PROFILES)
def test_builtin_device_nodes_and_vsock(name: str) -> None:
    s_ifchr, s_ifblk, s_ififo = 0o020000, 0o060000, 0o010000
    assert run(name, "mknodat", 0, 0, s_ifblk | 0o600) == eperm()
    assert run(name, "mknodat", 0, 0, s_ifchr | 0o600) == eperm()
    assert run(name, "mknod", 0, s_ifblk | 0o600) == eperm()
    assert run(name, "mknodat", 0, 0, s_ififo | 0o600) == ALLOW
    assert run(name, "mknodat", 0, 0, 0o100600) == ALLOW
    assert run(name, "socket", 40) == seccomp.SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT
    assert run(name, "socket", (1 << 32) | 40) == seccomp.SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT
    assert run(name, "socket", 1) == ALLOW


def test_default_specifics() -> None:
    assert run("default", 99999) == enosys()
    assert run("default", "ptrace") == ALLOW
    assert run("default", "personality", 0xFFFFFFFF) == ALLOW
    assert run("default", "personality", 0) == ALLOW
    assert run("default", "personality", 0x0400000) == enosys()  # READ_IMPLIES_EXEC
    assert run("default", "personality", 0x0100000) == enosys()  # MMAP_PAGE_ZERO
    assert run("default", "socket", 17) == ALLOW  # AF_PACKET: capabilities decide
    for sc in ["openat", "statx", "fchmodat2", "getrandom", "rseq", "close_range", "memfd_create"]:
        assert run("default", sc) == ALLOW, sc


def test_strict_specifics() -> None:
    assert run("strict", "ptrace") == enosys()
    assert run("strict", "setuid") == ALLOW  # make calls set*id even when not setuid
    assert run("strict", "msgget") == enosys()
    assert run("strict", "socket", 1) == ALLOW
    assert run("strict", "socket", 10) == ALLOW
    assert run("strict", "socket", 17) == enosys()
    assert run("strict", "personality", 8) == enosys()


def test_permissive_specifics() -> None:
    assert run("permissive", 99999) == ALLOW
    assert run("permissive", "ptrace") == ALLOW
    assert run("permissive", "personality", 0x0400000) == ALLOW


@pytest.mark.parametrize("name", seccomp.BUILTIN_PROFILES)
def test_builtin_init_calls_allowed(name: str) -> None:
    bpf = seccomp.compile_profile(name).bpf
    for sc, args in seccomp.INIT_REQUIRED_CALLS:
        ret = seccomp.evaluate(bpf, seccomp.syscall_number(sc), args)
        assert ret == ALLOW, (sc, hex(ret))


def test_list_profiles() -> None:
    infos = seccomp.list_profiles()
    assert [i.name for i in infos] == list(seccomp.BUILTIN_PROFILES)
    for i in infos:
        assert i.description and "\n" not in i.description
        assert i.path.is_file()
    assert infos[0].default_action == "SCMP_ACT_ERRNO(ENOSYS)"


def test_profiles_ship_through_package_symlink() -> None:
    pkg = Path(seccomp.__file__).resolve().parent.parent.parent / "seccomp_profiles"
    for n in seccomp.BUILTIN_PROFILES:
        assert (pkg / f"{n}.json").is_file()
    assert (pkg / "README.md").is_file()


# ---- cache ----------------------------------------------------------------------------
def test_cache_disk_and_memory(tmp_path: Path) -> None:
    f1 = seccomp.compile_profile("default")
    files = list(seccomp.cache_dir().glob("*.bpf"))
    assert len(files) == 1 and files[0].read_bytes() == f1.bpf
    assert seccomp.compile_profile("default") is f1  # in-process hit
    seccomp.clear_memory_cache()
    f2 = seccomp.compile_profile("default")
    assert f2.bpf == f1.bpf and f2.digest == f1.digest and f2 is not f1


def test_cache_hit_does_not_recompile(monkeypatch: pytest.MonkeyPatch) -> None:
    seccomp.compile_profile("strict")
    seccomp.clear_memory_cache()

    def boom(*_a: object) -> bytes:
        raise AssertionError("recompiled despite a disk cache entry")

    monkeypatch.setattr(seccomp_cache, "compile_bpf", boom)
    assert seccomp.compile_profile("strict").instructions > 0


def test_cache_corrupt_entry_recompiled() -> None:
    f1 = seccomp.compile_profile("permissive")
    (entry,) = seccomp.cache_dir().glob("*.bpf")
    entry.write_bytes(b"\x00" * 5)
    seccomp.clear_memory_cache()
    assert seccomp.compile_profile("permissive").bpf == f1.bpf


def test_cache_follows_file_changes(tmp_path: Path) -> None:
    p = write_profile(tmp_path, minimal())
    f1 = seccomp.compile_profile(p)
    assert seccomp.evaluate(f1.bpf, seccomp.syscall_number("getpid")) == enosys()
    doc = minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW"}])
    Path(p).write_text(json.dumps(doc) + "\n")
    f2 = seccomp.compile_profile(p)
    assert seccomp.evaluate(f2.bpf, seccomp.syscall_number("getpid")) == ALLOW


def test_cache_unwritable_state_dir_still_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(blocker / "state"))
    assert seccomp.compile_profile("default").instructions > 0


# ---- custom profiles: semantics ---------------------------------------------------------
def test_conditional_deny_beats_unconditional_allow(tmp_path: Path) -> None:
    p = write_profile(
        tmp_path,
        minimal(
            [
                {"names": ["getpid"], "action": "SCMP_ACT_ALLOW"},
                {
                    "names": ["getpid"],
                    "action": "SCMP_ACT_ERRNO",
                    "errnoRet": "EACCES",
                    "args": [{"index": 0, "value": 7, "op": "SCMP_CMP_EQ"}],
                },
            ]
        ),
    )
    bpf = seccomp.compile_profile(p).bpf
    nr = seccomp.syscall_number("getpid")
    assert seccomp.evaluate(bpf, nr, [7]) == seccomp.SECCOMP_RET_ERRNO | errno.EACCES
    assert seccomp.evaluate(bpf, nr, [8]) == ALLOW


def test_rule_errno_defaults_to_eperm_and_other_actions(tmp_path: Path) -> None:
    p = write_profile(
        tmp_path,
        minimal(
            [
                {"names": ["getpid"], "action": "SCMP_ACT_ERRNO"},
                {"names": ["getppid"], "action": "SCMP_ACT_KILL_PROCESS"},
                {"names": ["gettid"], "action": "SCMP_ACT_TRAP"},
                {"names": ["getuid"], "action": "SCMP_ACT_LOG"},
                {"names": ["getgid"], "action": "SCMP_ACT_KILL"},
            ]
        ),
    )
    bpf = seccomp.compile_profile(p).bpf

    def ev(n: str) -> int:
        return seccomp.evaluate(bpf, seccomp.syscall_number(n))

    assert ev("getpid") == eperm()
    assert ev("getppid") == KILL_PROCESS
    assert ev("gettid") == seccomp.SECCOMP_RET_TRAP
    assert ev("getuid") == seccomp.SECCOMP_RET_LOG
    assert ev("getgid") == seccomp.SECCOMP_RET_KILL_THREAD


def test_arg_operators(tmp_path: Path) -> None:
    ops = ["SCMP_CMP_NE", "SCMP_CMP_LT", "SCMP_CMP_LE", "SCMP_CMP_EQ", "SCMP_CMP_GE", "SCMP_CMP_GT"]
    names = ["getpid", "getppid", "gettid", "getuid", "getgid", "geteuid"]
    rules = [
        {
            "names": [n],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 2, "value": 100, "op": op}],
        }
        for n, op in zip(names, ops, strict=True)
    ]
    bpf = seccomp.compile_profile(write_profile(tmp_path, minimal(rules))).bpf
    py = {
        "SCMP_CMP_NE": lambda v: v != 100,
        "SCMP_CMP_LT": lambda v: v < 100,
        "SCMP_CMP_LE": lambda v: v <= 100,
        "SCMP_CMP_EQ": lambda v: v == 100,
        "SCMP_CMP_GE": lambda v: v >= 100,
        "SCMP_CMP_GT": lambda v: v > 100,
    }
    for n, op in zip(names, ops, strict=True):
        for v in [0, 99, 100, 101, 1 << 32, (1 << 32) + 100, M64]:
            got = seccomp.evaluate(bpf, seccomp.syscall_number(n), [0, 0, v]) == ALLOW
            assert got == py[op](v), (op, v)


def test_non_native_arch_listed_is_allowed_through(tmp_path: Path) -> None:
    if seccomp_lib.libseccomp().native != seccomp.AUDIT_ARCH_X86_64:
        pytest.skip("x86-64 only")
    doc = minimal(architectures=["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"])
    bpf = seccomp.compile_profile(write_profile(tmp_path, doc)).bpf
    assert seccomp.evaluate(bpf, 3, arch=I386) == ALLOW  # i386 read
    assert seccomp.evaluate(bpf, 0x40000000, arch=None) == KILL_PROCESS  # x32 still killed
    doc = minimal(architectures=["SCMP_ARCH_X86_64", "SCMP_ARCH_X32"])
    bpf = seccomp.compile_profile(write_profile(tmp_path, doc, "b.json")).bpf
    assert seccomp.evaluate(bpf, 0x40000000) == ALLOW  # x32 read
    assert seccomp.evaluate(bpf, 3, arch=I386) == KILL_PROCESS


def test_extra_syscall_table_for_new_calls(tmp_path: Path) -> None:
    doc = minimal([{"names": ["mseal", "lsm_set_self_attr"], "action": "SCMP_ACT_ERRNO"}])
    bpf = seccomp.compile_profile(write_profile(tmp_path, doc)).bpf
    assert seccomp.evaluate(bpf, 462) == eperm()


# ---- bad input ---------------------------------------------------------------------------
BAD: list[tuple[str, Any, str]] = [
    ("bad-json", '{"defaultAction": ', "JSON"),
    ("not-object", "[]", "top level"),
    ("unknown-top", {**minimal(), "flags": []}, "flags"),
    ("no-default", {"syscalls": []}, "defaultAction"),
    ("bad-default", minimal(defaultAction="SCMP_ACT_NOPE"), "defaultAction"),
    ("trace", minimal(defaultAction="SCMP_ACT_TRACE"), "not supported"),
    ("notify", minimal([{"names": ["getpid"], "action": "SCMP_ACT_NOTIFY"}]), "syscalls[2].action"),
    ("unknown-action", minimal([{"names": ["getpid"], "action": "ALLOW"}]), "syscalls[2].action"),
    ("no-action", minimal([{"names": ["getpid"]}]), "syscalls[2].action"),
    ("unknown-syscall", minimal([{"names": ["getpid", "frobnicate"], "action": "SCMP_ACT_ALLOW"}]), "syscalls[2].names[1]"),
    ("names-not-list", minimal([{"names": "getpid", "action": "SCMP_ACT_ALLOW"}]), "syscalls[2].names"),
    ("names-empty", minimal([{"names": [], "action": "SCMP_ACT_ALLOW"}]), "syscalls[2].names"),
    ("rule-unknown-key", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "includes": {}}]), "syscalls[2].includes"),
    ("errno-on-allow", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "errnoRet": 1}]), "syscalls[2].errnoRet"),
    ("errno-range", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ERRNO", "errnoRet": 70000}]), "syscalls[2].errnoRet"),
    ("errno-name", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ERRNO", "errnoRet": "EWHAT"}]), "syscalls[2].errnoRet"),
    ("args-not-list", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": {"index": 0}}]), "syscalls[2].args"),
    ("arg-not-object", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [3]}]), "syscalls[2].args[0]"),
    ("arg-index", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 6, "value": 0, "op": "SCMP_CMP_EQ"}]}]), "syscalls[2].args[0].index"),
    ("arg-op", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 0, "op": "EQ"}]}]), "syscalls[2].args[0].op"),
    ("arg-value-missing", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "op": "SCMP_CMP_EQ"}]}]), "syscalls[2].args[0].value"),
    ("arg-value-type", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": "1", "op": "SCMP_CMP_EQ"}]}]), "syscalls[2].args[0].value"),
    ("arg-value-range", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 1 << 64, "op": "SCMP_CMP_EQ"}]}]), "syscalls[2].args[0].value"),
    ("arg-unknown-key", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ", "mask": 3}]}]), "syscalls[2].args[0].mask"),
    ("arg-same-index", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_GE"}, {"index": 0, "value": 9, "op": "SCMP_CMP_LE"}]}]), "syscalls[2].args[1].index"),
    ("arch-unknown", minimal(architectures=["SCMP_ARCH_PDP11"]), "architectures[0]"),
    ("arch-no-native", minimal(architectures=["SCMP_ARCH_AARCH64" if os.uname().machine == "x86_64" else "SCMP_ARCH_X86_64"]), "architectures"),
    ("conflict", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ALLOW"}, {"names": ["getpid"], "action": "SCMP_ACT_ERRNO"}]), "syscalls[3]"),
    ("cond-allow-vs-deny", minimal([{"names": ["getpid"], "action": "SCMP_ACT_ERRNO"}, {"names": ["getpid"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"}]}]), "syscalls[3]"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "doc", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_profile(tmp_path: Path, label: str, doc: Any, field: str) -> None:
    p = write_profile(tmp_path, doc, f"{label}.json")
    with pytest.raises(PolicyError) as ei:
        seccomp.compile_profile(p)
    msg = str(ei.value)
    assert p in msg, msg
    assert field in msg, msg
    assert ei.value.exit_status == 2
    assert not list(seccomp.cache_dir().glob("*.bpf")) if seccomp.cache_dir().exists() else True


@pytest.mark.parametrize(
    ("deny", "needle"),
    [
        ({"names": ["execve"], "action": "SCMP_ACT_ERRNO"}, "execve"),
        ({"names": ["exit_group"], "action": "SCMP_ACT_KILL_PROCESS"}, "exit_group"),
        ({"names": ["wait4"], "action": "SCMP_ACT_TRAP"}, "wait4"),
        (
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "args": [{"index": 0, "value": 17, "valueTwo": 17, "op": "SCMP_CMP_MASKED_EQ"}],
            },
            "clone(0x11",
        ),
    ],
)
def test_profile_denying_init_calls_refused(
    tmp_path: Path, deny: dict[str, Any], needle: str
) -> None:
    doc = minimal([deny])
    # drop the unconditional allow so the deny is the rule that applies
    doc["syscalls"][0]["names"] = [n for n in BASE_ALLOW if n not in deny["names"]]
    p = write_profile(tmp_path, doc)
    with pytest.raises(PolicyError) as ei:
        seccomp.compile_profile(p)
    msg = str(ei.value)
    assert needle in msg and "init" in msg and p in msg, msg


def test_default_action_deny_without_allows_refused(tmp_path: Path) -> None:
    p = write_profile(tmp_path, {"defaultAction": "SCMP_ACT_KILL_PROCESS"})
    with pytest.raises(PolicyError, match="execve"):
        seccomp.compile_profile(p)


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="unknown seccomp profile 'nope'"):
        seccomp.compile_profile("nope")
    with pytest.raises(PolicyError, match="no such file"):
        seccomp.compile_profile(str(tmp_path / "missing.json"))
    with pytest.raises(PolicyError, match="allow-degraded"):
        seccomp.compile_profile("off")


# ---- BPF interpreter sanity -----------------------------------------------------------------
def test_evaluate_rejects_out_of_range_jump() -> None:
    bad = struct.pack("=HBBI", 0x05, 0, 0, 5)  # ja +5 off the end
    with pytest.raises(ValueError):
        seccomp.evaluate(bad, 0)


# ---- CLI ----------------------------------------------------------------------------------
def _cli(argv: list[str]) -> int:
    from stockade.cli.table import parse

    args = parse(argv)
    return int(args.func(args))


def test_cli_lists_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["profiles"]) == 0
    out = capsys.readouterr().out
    for n in (*seccomp.BUILTIN_PROFILES, "off"):
        assert any(line.startswith(n + " ") for line in out.splitlines()), out
    assert _cli(["profiles", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in data] == list(seccomp.BUILTIN_PROFILES)


def test_cli_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["profiles", "--check", "strict"]) == 0
    assert "strict: ok" in capsys.readouterr().out
    p = write_profile(tmp_path, minimal([{"names": ["nosuchcall"], "action": "SCMP_ACT_ALLOW"}]))
    with pytest.raises(PolicyError, match="nosuchcall"):
        _cli(["profiles", "--check", p])


@pytest.mark.parametrize("name", seccomp.BUILTIN_PROFILES)
def test_hot_syscalls_take_the_kernel_fast_path(name: str) -> None:
    """The kernel's action cache skips the BPF run for syscalls allowed whatever the
    arguments; the prologue and the composed deny program must not defeat it."""
    bpf = seccomp.compile_profile(name).bpf
    hot = ["read", "write", "openat", "newfstatat", "statx", "getdents64", "close", "mmap",
           "munmap", "futex", "brk", "lseek", "fcntl", "execve", "wait4", "pread64", "rt_sigaction"]  # fmt: skip
    slow = [n for n in hot if not seccomp.kernel_const_allow(bpf, seccomp.syscall_number(n))]
    assert not slow, slow
    # argument-inspected calls cannot be cached: they run the filter
    assert not seccomp.kernel_const_allow(bpf, seccomp.syscall_number("ioctl"))
    assert not seccomp.kernel_const_allow(bpf, seccomp.syscall_number("clone"))
