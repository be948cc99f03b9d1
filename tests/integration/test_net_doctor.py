"""`stockade doctor`'s network section, live (root and uid 65534): the probe makes a user
and network namespace, brings lo up over netlink, joins it from a sibling with setns and
binds 127.0.0.1:53 and :3128 there; and, where this machine can make the failure, the
failing step is named with its cause and fix: setns or netlink refused by a seccomp filter,
user.max_net_namespaces = 0, a namespace of another owner."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sysconfig
import time
from typing import Any

import pytest

from tests.conftest import NOBODY, SRC, User, need, unpriv_python

ARGS = ["doctor", "--json", "--refresh", "--no-self-test"]
NET = ("net-ns", "net-setns", "net-ports", "net-connect")

# install a seccomp filter (RULES, libseccomp JSON rules, via stockade's own compiler),
# then exec the rest of argv
FILTER = r"""
import ctypes, json, os, struct, sys, tempfile
from stockade.linux.seccomp import compile_profile
rules = json.loads(sys.argv[1])
prof = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_NATIVE"], "syscalls": rules}
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(prof, f)
bpf = compile_profile(f.name, use_cache=False).bpf
os.unlink(f.name)
buf = ctypes.create_string_buffer(bpf, len(bpf))
fprog = struct.pack("HxxxxxxQ", len(bpf) // 8, ctypes.addressof(buf))
prog = ctypes.create_string_buffer(fprog, len(fprog))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.c_void_p(ctypes.addressof(prog)), 0, 0) == 0, os.strerror(ctypes.get_errno())
os.execvp(sys.argv[2], sys.argv[2:])
"""


def doctor_json(user: User, wrap: list[str] | None = None) -> tuple[subprocess.CompletedProcess[bytes], dict[str, Any]]:
    argv = [*user.prefix(), *(wrap or []), user.python, "-m", "stockade", *ARGS]
    r = subprocess.run(argv, env=user.env({"STOCKADE_SERVER": "0"}), capture_output=True, timeout=180)
    assert r.stdout, r.stderr.decode()
    return r, json.loads(r.stdout)


def net_probes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    probes = {p["name"]: p for p in doc["probes"] if p.get("section") == "network"}
    assert tuple(probes) == NET, list(probes)
    return probes


def filtered(user: User, rules: list[dict[str, Any]]) -> list[str]:
    return [user.python, "-c", FILTER, json.dumps(rules)]


def test_network_section_live(user: User) -> None:
    _r, doc = doctor_json(user)
    p = net_probes(doc)
    # what this host may lack is network namespaces; given one, a process of the same uid
    # joining it and binding there is stockade's part
    need(p["net-ns"]["status"] == "ok", f"no network namespace here: {p['net-ns']['detail']}")
    assert all(p[n]["status"] == "ok" for n in NET), p
    assert f"a process of uid {user.uid} joins" in p["net-setns"]["detail"]
    assert p["net-ns"]["data"]["live"]["links"] == ["lo"]
    assert p["net-ports"]["data"]["live"]["ports"] == ["53/udp", "53/tcp", "3128/tcp"]
    # cached: the same section again, without the live children
    r2 = subprocess.run([*user.prefix(), user.python, "-m", "stockade", "doctor", "--no-self-test"],
                        env=user.env({"STOCKADE_SERVER": "0"}), capture_output=True, timeout=180)
    text = r2.stdout.decode()
    lines = text.splitlines()
    head = lines.index("network (--net allow and --forward; the default --net none needs none of it):")
    assert [ln.split()[:2] for ln in lines[head + 1:head + 5]] == [["OK", n] for n in NET]
    assert "cannot run here" not in text
    cache = json.loads((user.state / "doctor.json").read_text())
    assert [q["name"] for q in cache["probes"] if q.get("section") == "network"] == list(NET[:3])


def test_setns_refused_by_a_seccomp_filter(user: User) -> None:
    """Where a filter answers setns with EPERM (a container's default profile without
    CAP_SYS_ADMIN): net-setns names it; doctor's own exit status is unchanged."""
    r, doc = doctor_json(user, filtered(user, [{"names": ["setns"], "action": "SCMP_ACT_ERRNO",
                                                "errnoRet": errno.EPERM}]))
    p = net_probes(doc)
    need(p["net-ns"]["status"] == "ok", f"no network namespace here: {p['net-ns']['detail']}")
    s = p["net-setns"]
    assert s["status"] == "missing"
    assert s["detail"].startswith("setns(pidfd, CLONE_NEWUSER|CLONE_NEWNET): EPERM: a seccomp filter on this process "
                                  "refuses setns"), s
    assert s["fix"] and "seccomp" in s["fix"]
    assert p["net-ports"]["status"] == "missing" and "not tried" in p["net-ports"]["detail"]
    assert doc["network"] == {"ok": False, "missing": ["net-setns", "net-ports"]}
    assert r.returncode == (0 if doc["ok"] else 1)


def test_netlink_refused_by_a_seccomp_filter(user: User) -> None:
    """No AF_NETLINK sockets: lo cannot come up; net-ns says so and why."""
    rules = [{"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EAFNOSUPPORT,
              "args": [{"index": 0, "value": 16, "op": "SCMP_CMP_EQ"}]}]  # AF_NETLINK
    _r, doc = doctor_json(user, filtered(user, rules))
    ns = net_probes(doc)["net-ns"]
    assert ns["status"] == "missing"
    assert ns["detail"].startswith("netlink: bring lo up: EAFNOSUPPORT: a seccomp filter on this process refuses "
                                   "netlink sockets (AF_NETLINK)"), ns
    assert ns["fix"]


def test_no_network_namespaces_allowed(user: User) -> None:
    """user.max_net_namespaces = 0 written in a nested user namespace, doctor run inside it."""
    wrap = ["unshare", "-Ur", "sh", "-c", 'echo 0 > /proc/sys/user/max_net_namespaces && exec "$@"', "sh"]
    probe = subprocess.run([*user.prefix(), *wrap[:2], "true"], capture_output=True)
    need(probe.returncode == 0, f"unshare -Ur: {probe.stderr.decode().strip()}")
    _r, doc = doctor_json(user, wrap)
    ns = net_probes(doc)["net-ns"]
    assert ns["status"] == "missing"
    assert ns["detail"] == ("unshare(CLONE_NEWUSER|CLONE_NEWNET): ENOSPC: network namespaces are disabled "
                            "(user.max_net_namespaces = 0)"), ns
    assert "sysctl -w user.max_net_namespaces=15000" in ns["fix"]


@pytest.fixture
def roots_namespace() -> Any:
    """A user and network namespace owned by root, held by a sleeping process."""
    need(os.geteuid() == 0, "needs root to make a namespace uid 65534 does not own")
    p = subprocess.Popen(["unshare", "--user", "--map-root-user", "--net", "sleep", "60"])
    try:
        for _ in range(100):  # until it is in its own namespace
            if os.stat(f"/proc/{p.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino:
                break
            time.sleep(0.05)
        yield p.pid
    finally:
        p.kill()
        p.wait()


def test_join_is_refused_for_another_owners_namespace(roots_namespace: int) -> None:
    """The join step is real: uid 65534 may not setns into a namespace root owns, and the
    probe reports EPERM at that step (doctor words it as the setns cause). Root joins it,
    binds, and finds its lo down (unshare left it so): the lo check is real too."""
    py = unpriv_python()
    need(py is not None, "no Python interpreter executable by uid 65534 with this ABI")
    code = ("import json; from stockade import doctor; "
            f"print(json.dumps(doctor._child_result(lambda: doctor._net_join({roots_namespace}))))")
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", str(py), "-c", code],
                       env={"PYTHONPATH": f"{SRC}:{sysconfig.get_paths()['purelib']}"}, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    b = json.loads(r.stdout)
    assert (b["ok"], b["errno"], b["step"]) == (False, errno.EPERM, "setns(pidfd, CLONE_NEWUSER|CLONE_NEWNET)")
    from stockade import doctor

    own = doctor._child_result(lambda: doctor._net_join(roots_namespace))
    assert (own["ok"], own["step"], own["errno"]) == (False, "connect 127.0.0.1:3128 over lo", errno.ENETUNREACH)
