"""Limits, parsing, CLI flags, outcome classification, rlimits."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest

from stockade.cgroups.base import (
    CgroupStats,
    GiB,
    Limits,
    MiB,
    Outcome,
    check_enforceable,
    classify,
    degraded_limits,
)
from stockade.cgroups.none import NoneManager
from stockade.cgroups.parse import limits_from_mapping, parse_duration, parse_limit, parse_size
from stockade.cgroups.rlimit import kernel_version, nproc_is_safe, rlimits_for
from stockade.cgroups.v1 import Hierarchy, V1Manager
from stockade.cli.limits import limits_from_args, requested_limits
from stockade.cli.table import Args, parse
from stockade.errors import UsageError

# ----------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("512M", 512 * MiB), ("512m", 512 * MiB), ("512MiB", 512 * MiB), ("512MB", 512 * MiB),
        ("1G", GiB), ("1.5G", 3 * GiB // 2), ("64k", 64 * 1024), ("2T", 2 * 1024**4),
        ("1024", 1024), ("0", 0), ("100b", 100), (" 8 M ", 8 * MiB), (".5G", GiB // 2),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12XB", "", "M", "-1M", "1.2.3G", "1e9", "5 GG", "1Gx", "nan", "9999999T"])
def test_parse_size_rejects(text: str) -> None:
    assert parse_size(text) is None


@pytest.mark.parametrize(
    ("text", "value"),
    [("30s", 30.0), ("2", 2.0), ("1.5m", 90.0), ("500ms", 0.5), ("2h", 7200.0), ("1d", 86400.0), ("0.25", 0.25)],
)
def test_parse_duration(text: str, value: float) -> None:
    assert parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "", "-1s", "1x", "s", "1 2s", "inf"])
def test_parse_duration_rejects(text: str) -> None:
    assert parse_duration(text) is None


def _run_args(*flags: str) -> Args:
    """The options of `stockade run FLAGS -- x`, parsed by the CLI's own parser."""
    return parse(["run", *flags, "--", "x"])


@pytest.mark.parametrize(
    ("flag", "value", "form"),
    [
        ("--memory", "12XB", "512M"),
        ("--memory", "100", "minimum" if False else "512M"),  # below 1M
        ("--cpus", "-1", "0.5"),
        ("--cpus", "0", "0.5"),
        ("--cpus", "lots", "0.5"),
        ("--pids", "0", "integer >= 2"),
        ("--pids", "1.5", "integer >= 2"),
        ("--timeout", "abc", "30s"),
        ("--timeout", "0", "30s"),
        ("--cpu-time", "-5", "60s"),
        ("--max-file-size", "big", "1G"),
        ("--nofile", "2", "integer >= 3"),
    ],
)
def test_cli_bad_values_name_the_flag_and_form(flag: str, value: str, form: str) -> None:
    args = _run_args(flag, value)
    with pytest.raises(UsageError) as ei:
        limits_from_args(args)
    msg = str(ei.value)
    assert msg.startswith(f"{flag}: invalid value {value!r}: expected ")
    assert form in msg and "\n" not in msg


def test_cli_good_values_over_defaults() -> None:
    args = _run_args(
        *["--memory", "512M", "--cpus", "1.5", "--pids", "256", "--timeout", "30s", "--cpu-time", "60s", "--max-file-size", "1G", "--nofile", "1024"]
    )
    lim = limits_from_args(args)
    assert lim == Limits(memory=512 * MiB, cpus=1.5, pids=256, timeout=30.0, cpu_time=60.0,
                         max_file_size=GiB, nofile=1024, disk=10 * GiB, disk_floor=GiB)  # (the disk defaults)
    assert requested_limits(args) == {"memory", "cpus", "pids", "timeout", "cpu_time", "max_file_size", "nofile"}
    none = limits_from_args(_run_args())
    assert none == Limits.defaults() and requested_limits(_run_args()) == set()
    lifted = limits_from_args(_run_args("--pids", "none", "--memory", "unlimited"))
    assert lifted.pids is None and lifted.memory is None and lifted.nofile == Limits.defaults().nofile


def test_defaults_protect_a_laptop() -> None:
    d = Limits.defaults()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert d.pids == 1024 and d.nofile == 4096
    assert d.memory is not None and 0.4 * ram <= d.memory <= 0.5 * ram and d.memory % MiB == 0
    assert d.timeout is None and d.cpus is None


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"memory": 10}, "memory"), ({"pids": 1}, "pids"), ({"cpus": -0.5}, "cpus"),
     ({"timeout": 0}, "timeout"), ({"nofile": True}, "nofile"), ({"memory": 1.5e9}, "memory"),
     ({"cpus": float("nan")}, "cpus"), ({"max_file_size": -1}, "max_file_size")],
)
def test_limits_validate_on_construction(kw: dict[str, object], field: str) -> None:
    with pytest.raises(UsageError, match=f"^Limits.{field}: "):
        Limits(**kw)  # type: ignore[arg-type]


def test_limits_from_config_mapping() -> None:
    lim = limits_from_mapping({"memory": "1G", "cpu-time": 30, "pids": 100}, source="stockade.toml")
    assert lim == Limits(memory=GiB, cpu_time=30.0, pids=100)
    with pytest.raises(UsageError, match=r"^stockade\.toml: unknown limit 'mem'"):
        limits_from_mapping({"mem": "1G"}, source="stockade.toml")
    with pytest.raises(UsageError, match=r"^stockade\.toml: limits\.memory: invalid value '1Q'"):
        limits_from_mapping({"memory": "1Q"}, source="stockade.toml")
    with pytest.raises(UsageError):
        parse_limit("pids", True)
    assert Limits().replace(pids=5).pids == 5
    with pytest.raises(UsageError, match="unknown limit 'bogus'"):
        Limits().replace(bogus=1)
    assert Limits(memory=GiB).to_dict()["memory"] == GiB


# ----------------------------------------------------------------- classify


def test_classify_exit_and_signal() -> None:
    assert classify(0).kind == "exited" and classify(0).exit_status == 0
    o = classify(3)
    assert (o.kind, o.code, o.exit_status, o.summary()) == ("exited", 3, 3, "exited(3)")
    o = classify(-signal.SIGSEGV)
    assert (o.kind, o.signal, o.exit_status) == ("signaled", signal.SIGSEGV, 139)
    assert o.summary() == "signaled(SIGSEGV)"
    o = classify(waitstatus=0x0900)  # exit 9
    assert (o.kind, o.code) == ("exited", 9)
    o = classify(waitstatus=signal.SIGTERM)
    assert (o.kind, o.signal, o.exit_status) == ("signaled", signal.SIGTERM, 143)
    o = classify(137, exit_code_encodes_signal=True)
    assert (o.kind, o.signal) == ("signaled", signal.SIGKILL)
    assert classify(137).kind == "exited"
    assert "CPU time limit" in classify(-signal.SIGXCPU).summary()
    with pytest.raises(ValueError):
        classify()
    with pytest.raises(ValueError):
        classify(0, waitstatus=0)


def test_classify_timeout_wins() -> None:
    st = CgroupStats(oom_killed=True, oom_kills=1, pids_limit_hit=True, pids_max_events=1)
    o = classify(-signal.SIGKILL, timed_out=True, stats=st, limits=Limits(timeout=2))
    assert o.kind == "timeout" and o.exit_status == 124
    assert o.summary().startswith("timeout after 2s")
    assert "oom-kill" in o.events and "pids-limit-hit" in o.events


def test_classify_oom() -> None:
    st = CgroupStats(oom_killed=True, oom_kills=1, peak_memory=256 * MiB, cpu_time=0.5, source="v1")
    o = classify(-signal.SIGKILL, stats=st, limits=Limits(memory=256 * MiB))
    assert o.kind == "oom-killed" and o.exit_status == 137 and o.events == ()
    assert o.summary() == "oom-killed (memory limit 256M), signaled(SIGKILL); peak memory 256M; cpu 0.50s"
    # a child was OOM-killed and the command failed because of it
    o = classify(2, stats=st)
    assert o.kind == "oom-killed" and o.code == 2 and o.exit_status == 137
    # ... or the command coped and succeeded: not the cause, still reported
    o = classify(0, stats=st)
    assert o.kind == "exited" and o.exit_status == 0 and o.events == ("oom-kill",)
    assert "events: oom-kill" in o.summary()


def test_classify_pids_limit() -> None:
    st = CgroupStats(pids_limit_hit=True, pids_max_events=40)
    o = classify(1, stats=st, limits=Limits(pids=64))
    assert o.kind == "pids-limit-hit" and o.exit_status == 1
    assert o.summary().startswith("pids-limit-hit (pids limit 64), exited(1)")
    o = classify(-signal.SIGTERM, stats=st)
    assert o.kind == "pids-limit-hit" and o.exit_status == 143
    assert classify(0, stats=st).events == ("pids-limit-hit x40",)


def test_outcome_to_dict_and_unenforced() -> None:
    o = classify(0, stats=CgroupStats(peak_memory=10 * MiB, cpu_time=1.25, source="rusage"),
                 unenforced=["memory", "cpus"])
    d = o.to_dict()
    assert d["outcome"] == "exited" and d["exit_status"] == 0 and d["stats_source"] == "rusage"
    assert d["unenforced"] == ["memory", "cpus"]
    assert "not enforced for the whole sandbox: --memory, --cpus" in o.summary()
    assert isinstance(o, Outcome)


# ----------------------------------------------------------------- rlimits


def _v1() -> V1Manager:
    h = Hierarchy(frozenset({"memory"}), "/nonexistent", "/")
    p = Hierarchy(frozenset({"pids"}), "/nonexistent2", "/")
    return V1Manager(hierarchies={"memory": h, "pids": p})


def test_rlimits_with_cgroups_leave_memory_and_pids_to_the_cgroup() -> None:
    lim = Limits(memory=GiB, pids=100, nofile=512, max_file_size=GiB, cpu_time=2.5)
    rl = {r: (s, h) for r, s, h in rlimits_for(lim, _v1(), nproc_safe=True)}
    assert rl[resource.RLIMIT_CORE] == (0, 0)
    assert rl[resource.RLIMIT_NOFILE][0] <= 512
    assert rl[resource.RLIMIT_FSIZE] == (GiB, GiB)
    assert rl[resource.RLIMIT_CPU] == (3, 4)  # ceil, then SIGKILL a second later
    assert resource.RLIMIT_DATA not in rl and resource.RLIMIT_NPROC not in rl


def test_rlimits_without_cgroups() -> None:
    lim = Limits(memory=GiB, pids=100)
    rl = {r: (s, h) for r, s, h in rlimits_for(lim, NoneManager(nproc_safe=False))}
    assert rl[resource.RLIMIT_DATA] == (GiB, GiB)
    assert resource.RLIMIT_NPROC not in rl  # unsafe before 5.14
    rl = {r: (s, h) for r, s, h in rlimits_for(lim, NoneManager(nproc_safe=True))}
    assert rl[resource.RLIMIT_NPROC] == (100, 100)
    assert rlimits_for(Limits(), NoneManager()) == [(resource.RLIMIT_CORE, 0, 0)]


def test_rlimits_never_exceed_the_callers_hard_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no finite hard RLIMIT_NOFILE to clamp to")
    rl = {r: (s, h) for r, s, h in rlimits_for(Limits(nofile=hard * 4), NoneManager())}
    assert rl[resource.RLIMIT_NOFILE] == (hard, hard)


def test_rlimits_really_apply_in_a_child() -> None:
    """The triples are valid input for setrlimit: apply them in a child and read back."""
    lim = Limits(nofile=64, max_file_size=MiB, cpu_time=5)
    triples = rlimits_for(lim, NoneManager())
    code = (
        "import resource,sys,json\n"
        "for r,s,h in json.loads(sys.argv[1]): resource.setrlimit(r,(s,h))\n"
        "print(json.dumps([resource.getrlimit(r) for r,_,_ in json.loads(sys.argv[1])]))"
    )
    import json

    out = subprocess.run([sys.executable, "-c", code, json.dumps(triples)], capture_output=True, text=True, check=True)
    assert [tuple(x) for x in json.loads(out.stdout)] == [(s, h) for _r, s, h in triples]


def test_degraded_and_check_enforceable() -> None:
    lim = Limits(memory=GiB, pids=100, cpus=1, nofile=100)
    none = NoneManager(nproc_safe=False)
    assert degraded_limits(lim, none) == ["memory", "cpus", "pids"]
    assert degraded_limits(lim, none, {"memory"}) == ["memory"]
    assert degraded_limits(lim, NoneManager(nproc_safe=True)) == ["memory", "cpus"]
    assert degraded_limits(lim, _v1()) == ["cpus"]  # no cpu hierarchy in that manager
    with pytest.raises(UsageError, match=r"^--memory: cannot be enforced .* --allow-degraded limits"):
        check_enforceable(lim, none, requested={"memory"}, allow_degraded=False)
    assert check_enforceable(lim, none, requested={"memory"}, allow_degraded=True) == ["memory"]
    # defaults that were not asked for never block a run
    assert check_enforceable(lim, none, requested={"nofile"}, allow_degraded=False) == []


def test_kernel_version_parsing() -> None:
    assert kernel_version("6.18.44-fc-v769") == (6, 18)
    assert kernel_version("5.4.0-150-generic") == (5, 4)
    assert kernel_version("garbage") == (0, 0)
    assert nproc_is_safe("5.14.0") and not nproc_is_safe("5.13.19")
