"""`stockade doctor`'s network section (--net allow, --forward): each failure of the
live steps (a network namespace with lo up over netlink, a sibling of this uid joining it
with setns, ports 53 and 3128 bound there) named with its cause and fix, from synthetic
results of the two probe children and fake environments; the connector check on real
files. The live probes themselves: tests/integration/test_net_doctor.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from stockade import doctor
from stockade.linux import remedies
from tests.unit.test_doctor_lines import fake_proc, fake_root

A_OK = {"ok": True, "links": ["lo"], "routes_out": []}
B_OK = {"ok": True, "how": "a pidfd", "ports": ["53/udp", "53/tcp", "3128/tcp"]}
NET = ("net-ns", "net-setns", "net-ports")


def env_of(tmp_path: Path, **kw: Any) -> remedies.Env:
    uid = kw.pop("uid", 1000)
    files = kw.pop("files", ())
    return dataclasses.replace(remedies.detect(fake_proc(tmp_path, **kw), fake_root(tmp_path, *files)), uid=uid)


def by_name(probes: list[doctor.Probe]) -> dict[str, doctor.Probe]:
    assert [p.name for p in probes] == list(NET)
    assert all(p.section == doctor.NETWORK for p in probes)
    return {p.name: p for p in probes}


def test_all_ok(tmp_path: Path) -> None:
    p = by_name(doctor.analyze_network(A_OK, B_OK, env_of(tmp_path), uid=1000))
    assert all(x.status == "ok" for x in p.values())
    assert "lo up over netlink (pyroute2)" in p["net-ns"].detail
    assert "uid 1000 joins a sandbox's user and network namespaces (setns with a pidfd)" in p["net-setns"].detail
    assert "127.0.0.1:53 (UDP, TCP) and 127.0.0.1:3128" in p["net-ports"].detail
    text = doctor.Report(list(p.values())).format()
    assert "network (--net allow and --forward; the default --net none needs none of it):" in text
    assert "cannot run here" not in text


def fail(step: str, err: int, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "step": step, "errno": err, "error": os.strerror(err) if err else "x", **extra}


def test_no_network_namespaces(tmp_path: Path) -> None:
    """user.max_net_namespaces = 0: the cause and the sysctl; the later steps are not tried."""
    a = fail("unshare(CLONE_NEWUSER|CLONE_NEWNET)", errno.ENOSPC)
    p = by_name(doctor.analyze_network(a, {}, env_of(tmp_path), uid=1000, max_net="0"))
    ns = p["net-ns"]
    assert ns.status == "missing"
    assert ns.cause == "network namespaces are disabled (user.max_net_namespaces = 0)"
    assert ns.fix and "sysctl -w user.max_net_namespaces=15000" in ns.fix
    assert ns.detail == f"unshare(CLONE_NEWUSER|CLONE_NEWNET): ENOSPC: {ns.cause}"
    for name in ("net-setns", "net-ports"):
        assert p[name].status == "missing" and "not tried" in p[name].detail and "(net-ns)" in p[name].detail
    # the limit reached, not off
    limit = doctor.analyze_network(a, {}, env_of(tmp_path / "b"), uid=1000, max_net="3")[0]
    assert limit.cause == "the network namespace limit is reached (user.max_net_namespaces = 3)"


def test_report_and_json_name_the_network_failure_without_failing_doctor(tmp_path: Path) -> None:
    a = fail("unshare(CLONE_NEWUSER|CLONE_NEWNET)", errno.ENOSPC)
    probes = doctor.analyze_network(a, {}, env_of(tmp_path), uid=1000, max_net="0")
    rep = doctor.Report([doctor.Probe("userns", "ok", "fine"), *probes])
    assert rep.exit_status == 0  # --net none, the default, needs none of it
    lines = rep.format().splitlines()
    assert lines[1] == "network (--net allow and --forward; the default --net none needs none of it):"
    assert f"{'':<22}cause: {probes[0].cause}" not in lines  # already in the detail
    assert f"{'':<22}fix: {probes[0].fix}" in lines
    assert lines[-1] == ("--net allow and --forward cannot run here: missing net-ns, net-setns, net-ports "
                         "(--net none and --net host can).")
    doc = json.loads(json.dumps(rep.to_json()))
    assert doc["ok"] is True and doc["network"] == {"ok": False, "missing": list(NET)}
    ns = next(p for p in doc["probes"] if p["name"] == "net-ns")
    assert ns["section"] == "network" and ns["cause"] == probes[0].cause and ns["fix"] == probes[0].fix


def test_unshare_refused_by_a_seccomp_filter(tmp_path: Path) -> None:
    env = env_of(tmp_path, seccomp=2, files=(".dockerenv",))
    ns = doctor.analyze_network(fail("unshare(CLONE_NEWUSER|CLONE_NEWNET)", errno.EPERM), {}, env, uid=1000)[0]
    assert ns.cause and "seccomp filter" in ns.cause and ns.fix and "--security-opt seccomp=unconfined" in ns.fix


def test_no_network_namespace_support(tmp_path: Path) -> None:
    ns = doctor.analyze_network(fail("unshare(CLONE_NEWUSER|CLONE_NEWNET)", errno.EINVAL), {}, env_of(tmp_path),
                                uid=1000)[0]
    assert ns.cause == "the kernel has no network namespaces (CONFIG_NET_NS)"


def test_id_map_step_is_the_id_maps_cause(tmp_path: Path) -> None:
    env = env_of(tmp_path, uid_map="0 1000 1")
    ns = doctor.analyze_network(fail("write /proc/self/uid_map", errno.EPERM), {}, env, uid=1000)[0]
    assert ns.cause == remedies.id_map(errno.EPERM, env, "uid_map").cause


def test_pyroute2_missing(tmp_path: Path) -> None:
    a = {"ok": False, "step": "import pyroute2", "errno": 0, "error": "No module named 'pyroute2'"}
    ns = doctor.analyze_network(a, {}, env_of(tmp_path), uid=1000)[0]
    assert ns.status == "missing"
    assert ns.cause and "pyroute2" in ns.cause and "No module named 'pyroute2'" in ns.cause
    assert ns.fix and "pip install 'pyroute2>=0.7'" in ns.fix


@pytest.mark.parametrize(("err", "seccomp", "words"), [
    (errno.EPERM, 2, "seccomp filter on this process refuses netlink requests"),
    (errno.EPERM, 0, "a security module denies CAP_NET_ADMIN"),
    (errno.EAFNOSUPPORT, 0, "no rtnetlink sockets"),
    (errno.EAFNOSUPPORT, 2, "seccomp filter on this process refuses netlink sockets"),
])
def test_netlink_refused(tmp_path: Path, err: int, seccomp: int, words: str) -> None:
    env = env_of(tmp_path, seccomp=seccomp)
    ns = doctor.analyze_network(fail("netlink: bring lo up", err), {}, env, uid=1000)[0]
    assert ns.status == "missing" and ns.cause and words in ns.cause and ns.fix


def test_setns_refused(tmp_path: Path) -> None:
    b = fail("setns(pidfd, CLONE_NEWUSER|CLONE_NEWNET)", errno.EPERM)
    p = by_name(doctor.analyze_network(A_OK, b, env_of(tmp_path), uid=1000))
    assert p["net-ns"].status == "ok"
    s = p["net-setns"]
    assert s.status == "missing" and s.detail.startswith("setns(pidfd, CLONE_NEWUSER|CLONE_NEWNET): EPERM: ")
    assert s.cause and "joining the sandbox's user namespace was refused" in s.cause
    assert s.fix and "nsenter -U -n -t <pid>" in s.fix
    assert p["net-ports"].status == "missing" and "not tried, the namespace was not joined" in p["net-ports"].detail


@pytest.mark.parametrize(("kw", "words", "fix"), [
    ({"seccomp": 2}, "seccomp filter on this process refuses setns", "seccomp"),
    ({"sysctl": {"kernel/apparmor_restrict_unprivileged_userns": "1"}}, "AppArmor restricts",
     "stockade doctor --apparmor"),
])
def test_setns_refused_by_the_environment(tmp_path: Path, kw: dict[str, Any], words: str, fix: str) -> None:
    b = fail("setns(/proc/7/ns/user)", errno.EPERM)
    s = doctor.analyze_network(A_OK, b, env_of(tmp_path, **kw), uid=1000)[1]
    assert s.cause and words in s.cause and s.fix and fix in s.fix


def test_setns_einval_names_the_kernel(tmp_path: Path) -> None:
    s = doctor.analyze_network(A_OK, fail("setns(/proc/7/ns/user)", errno.EINVAL), env_of(tmp_path), uid=1000)[1]
    assert s.cause and "Linux 5.8" in s.cause and s.fix == "use a 5.8+ kernel; `stockade doctor --json` shows the failing call"


def test_port_53_refused(tmp_path: Path) -> None:
    b = fail("bind 127.0.0.1:53/udp", errno.EACCES, port=53, how="a pidfd")
    p = by_name(doctor.analyze_network(A_OK, b, env_of(tmp_path), uid=1000))
    assert p["net-setns"].status == "ok"  # it joined; the bind came after
    ports = p["net-ports"]
    assert ports.status == "missing" and ports.detail.startswith("bind 127.0.0.1:53/udp: EACCES: ")
    assert ports.cause and "binding 127.0.0.1:53" in ports.cause and "CAP_NET_BIND_SERVICE" in ports.cause
    inuse = doctor.analyze_network(A_OK, fail("bind 127.0.0.1:3128/tcp", errno.EADDRINUSE, port=3128), env_of(
        tmp_path / "b"), uid=1000)[2]
    assert inuse.cause == "127.0.0.1:3128 is already taken in the sandbox's network namespace"


def test_lo_not_carrying(tmp_path: Path) -> None:
    b = fail("connect 127.0.0.1:3128 over lo", errno.ENETUNREACH, port=3128)
    ports = doctor.analyze_network(A_OK, b, env_of(tmp_path), uid=1000)[2]
    assert ports.status == "missing" and ports.detail.startswith("connect 127.0.0.1:3128 over lo: ENETUNREACH")
    assert ports.fix and "ip link set lo up" in ports.fix


def test_every_failure_names_a_cause_and_a_fix(tmp_path: Path) -> None:
    """No errno at any step leaves a failing line without both."""
    env = env_of(tmp_path)
    for err in (errno.EPERM, errno.EACCES, errno.EINVAL, errno.ENOSPC, errno.ENOSYS, errno.ENOMEM, errno.EADDRINUSE, 0):
        cases = [(fail("unshare(CLONE_NEWUSER|CLONE_NEWNET)", err), {}),
                 (fail("netlink: bring lo up", err), {}),
                 (A_OK, fail("setns(pidfd, CLONE_NEWUSER|CLONE_NEWNET)", err)),
                 (A_OK, fail("pidfd_open(7)", err)),
                 (A_OK, fail("bind 127.0.0.1:53/tcp", err, port=53)),
                 (A_OK, fail("connect 127.0.0.1:3128 over lo", err, port=3128))]
        for a, b in cases:
            probes = doctor.analyze_network(a, b, env, uid=1000)
            failed = [p for p in probes if p.status == "missing" and "not tried" not in p.detail]
            assert len(failed) == 1, probes
            assert failed[0].cause and failed[0].fix, failed[0]


# ---------------------------------------------------------------- the connector


def test_connector_missing(tmp_path: Path) -> None:
    p = doctor.probe_connector(tmp_path / "stockade-connect")
    assert p.status == "missing" and p.section == doctor.NETWORK
    assert "is missing: --net allow refuses to start without it" in p.detail
    assert p.fix and "make native" in p.fix


def test_connector_not_executable(tmp_path: Path) -> None:
    f = tmp_path / "stockade-connect"
    f.write_bytes(b"\x7fELF")
    f.chmod(0o644)  # root too may execute nothing without an x bit
    p = doctor.probe_connector(f)
    assert p.status == "missing" and "is not executable" in p.detail and p.fix and f"chmod 755 {f}" in p.fix


def test_connector_that_is_something_else(tmp_path: Path) -> None:
    f = tmp_path / "stockade-connect"
    f.write_text("#!/bin/sh\nexit 0\n")
    f.chmod(0o755)
    p = doctor.probe_connector(f)
    assert p.status == "missing" and "does not behave as stockade-connect (exit 0" in p.detail and p.fix


def test_connector_built() -> None:
    if not doctor.CONNECTOR.exists():
        pytest.skip("stockade-connect not built")
    p = doctor.probe_connector()
    assert p.status == "ok" and p.detail.startswith(f"{doctor.CONNECTOR} runs (")
    assert p.data["dynamic"] is doctor._elf_interp(doctor.CONNECTOR)


def test_elf_interp() -> None:
    true = Path("/bin/true").resolve()
    assert doctor._elf_interp(true) is True  # a distribution's binaries are dynamic
    assert doctor._elf_interp(Path(__file__)) is None
