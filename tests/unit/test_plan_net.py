"""The plan of --net allow and forwarded ports: resolv.conf, the connector, the env,
Landlock's port rules where a socket of the caller's may be handed in."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade import plan as P
from stockade.errors import UsageError
from stockade.net import CONNECT_PATH, DNS_PORT, PROXY_PORT, PROXY_URL, SOCKS_URL


def req(tmp_path: Path, **kw: object) -> P.Request:
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    base: dict[str, object] = dict(
        argv=("pip", "install", "x"), project=proj, cwd=proj, env={"PATH": "/usr/bin"},
        upper=tmp_path / "s1" / "upper", work=tmp_path / "s1" / "work",
    )
    base.update(kw)
    return P.Request(**base)  # type: ignore[arg-type]


def _op(plan: P.Plan, target: str) -> P.MountOp:
    return next(m for m in plan.mounts if m.target == target)


def test_allow_points_dns_at_the_responder_and_binds_the_connector(tmp_path: Path) -> None:
    plan = P.build(req(tmp_path, network="allow"))
    assert "net" in plan.namespaces
    resolv = [m for m in plan.mounts if m.target == "/etc/resolv.conf"]
    assert len(resolv) == 1 and resolv[0].kind == "file" and resolv[0].data == P.RESOLV_CONF
    assert b"nameserver 127.0.0.1" in P.RESOLV_CONF
    conn = _op(plan, CONNECT_PATH)
    assert conn.kind == "bind" and "ro" in conn.flags and conn.source == str(P.connector_path())
    # the connector's directory exists before it is bound, on the private /run
    targets = [m.target for m in plan.mounts]
    assert targets.index("/run") < targets.index("/run/stockade") < targets.index(CONNECT_PATH)


def test_allow_env_points_every_client_at_the_proxy(tmp_path: Path) -> None:
    env = dict(P.build(req(tmp_path, network="allow", env={"PATH": "/usr/bin", "GIT_CONFIG_COUNT": "1",
                                                            "GIT_CONFIG_KEY_0": "user.name",
                                                            "GIT_CONFIG_VALUE_0": "me"})).env)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "PIP_PROXY", "npm_config_proxy"):
        assert env[k] == PROXY_URL
    assert env["ALL_PROXY"] == SOCKS_URL == f"socks5h://127.0.0.1:{PROXY_PORT}"
    assert env["NODE_USE_ENV_PROXY"] == "1"
    assert "127.0.0.1" in env["NO_PROXY"].split(",")
    assert env["GIT_PROXY_COMMAND"] == CONNECT_PATH and CONNECT_PATH in env["GIT_SSH_COMMAND"]
    # the caller's git settings stay; http.proxy is added after them
    assert env["GIT_CONFIG_COUNT"] == "2" and env["GIT_CONFIG_KEY_0"] == "user.name"
    assert (env["GIT_CONFIG_KEY_1"], env["GIT_CONFIG_VALUE_1"]) == ("http.proxy", PROXY_URL)


def test_none_and_host_get_no_proxy_parts(tmp_path: Path) -> None:
    for mode in ("none", "host"):
        plan = P.build(req(tmp_path, network=mode))
        env = dict(plan.env)
        assert "HTTP_PROXY" not in env and "ALL_PROXY" not in env
        assert not any(m.target == CONNECT_PATH for m in plan.mounts)
        assert all(m.data != P.RESOLV_CONF for m in plan.mounts if m.target == "/etc/resolv.conf")


def test_forward_with_host_network_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--forward"):
        P.build(req(tmp_path, network="host", forward=(5432,)))


def test_landlock_ports_only_where_a_callers_socket_may_be_handed_in(tmp_path: Path) -> None:
    plain = P.build(req(tmp_path, network="allow", forward=(5432,)))
    if plain.landlock is None or plain.landlock.abi < 4:
        pytest.skip("Landlock ABI < 4: no TCP rules on this kernel")
    assert plain.landlock.handled_net == 0  # inside, loopback reaches only the proxy's listeners
    walled = P.build(req(tmp_path, network="allow", forward=(5432,), keep_fds=(5,)))
    assert walled.landlock is not None and walled.landlock.handled_net == P.LL_NET_BIND_TCP | P.LL_NET_CONNECT_TCP
    assert walled.landlock.bind_ports == ()
    assert set(walled.landlock.connect_ports) == {PROXY_PORT, DNS_PORT, 5432}
    none_fwd = P.build(req(tmp_path, network="none", forward=(6379,), keep_fds=(5,)))
    assert none_fwd.landlock is not None and none_fwd.landlock.connect_ports == (6379,)


def test_explain_names_the_network_plan(tmp_path: Path) -> None:
    text = P.build(req(tmp_path, network="allow", forward=(5432,))).describe()
    line = next(ln for ln in text.splitlines() if ln.startswith("network:"))
    assert f"127.0.0.1:{PROXY_PORT}" in line and "SOCKS5" in line and "5432" in line
    assert P.proxied("allow", ()) and P.proxied("none", (5432,))
    assert not P.proxied("none", ()) and not P.proxied("host", ())
