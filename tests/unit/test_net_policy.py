"""The network policy of ``--net allow`` (policy/network.py): patterns, presets, deny
wins, the SSRF ranges, provenance from the tiers, live session rules, and how the
options flow from the command line and the API to ``Prepared.net``."""

from __future__ import annotations

import ipaddress
import json
import marshal
import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from stockade import policy
from stockade.cli import table
from stockade.cli.run import run_kwargs
from stockade.core.request import RunRequest
from stockade.errors import PolicyError, UsageError
from stockade.policy import CliPolicy
from stockade.policy.network import (
    BUILTIN_PRESETS,
    HostRule,
    LiveNetPolicy,
    NetPolicy,
    PatternError,
    canonical_address,
    host_address,
    parse_pattern,
    special_range,
)


def rule(pattern: str, action: str = "allow", tier: str = "workspace", source: str = "/p/.stockade.toml",
         preset: str | None = None, line: int | None = None) -> HostRule:
    return HostRule(pattern, action, tier, source, preset, line)


def allow(*patterns: str, deny: tuple[str, ...] = ()) -> NetPolicy:
    return NetPolicy("allow", tuple(rule(p) for p in patterns) + tuple(rule(p, "deny", "global", "/g.toml") for p in deny))


# --------------------------------------------------------------------------- patterns


@pytest.mark.parametrize("raw,kind,host,port", [
    ("pypi.org", "name", "pypi.org", None),
    ("PyPI.Org.", "name", "pypi.org", None),
    ("github.com:22", "name", "github.com", 22),
    ("*.pythonhosted.org:443", "wildcard", "pythonhosted.org", 443),
    ("10.1.2.3", "address", "10.1.2.3", None),
    ("10.1.2.3:8080", "address", "10.1.2.3", 8080),
    ("10.0.0.0/8", "network", "10.0.0.0/8", None),
    ("10.1.2.3/8", "network", "10.0.0.0/8", None),  # host bits: the range that holds it
    ("[::1]:5432", "address", "::1", 5432),
    ("fd00::/8", "network", "fd00::/8", None),
    ("[fd00::/8]:80", "network", "fd00::/8", 80),
    ("::ffff:127.0.0.1", "address", "127.0.0.1", None),  # IPv4-mapped: the IPv4 address it dials
    ("intranet", "name", "intranet", None),
    ("_svc.example.org", "name", "_svc.example.org", None),
])
def test_pattern_forms(raw: str, kind: str, host: str, port: int | None) -> None:
    p = parse_pattern(raw)
    assert (p.kind, p.host, p.port) == (kind, host, port)


@pytest.mark.parametrize("raw,says", [
    ("", "empty host pattern"),
    ("*", "'*' alone would allow every host"),
    ("*:443", "'*' alone"),
    ("foo*.example.org", "'*' only as the whole first label"),
    ("a.*.example.org", "'*' only as the whole first label"),
    ("*.*.org", "'*' only as the whole first label"),
    ("pypi.org:0", "port 0 is out of range (1-65535)"),
    ("pypi.org:65536", "port 65536 is out of range"),
    ("pypi.org:http", "is not a port number"),
    ("pypi.org:", "is not a port number"),
    ("pypi.org:-1", "is not a port number"),
    ("a..b", "empty label"),
    (".a.b", "empty label"),
    ("-a.org", "is not a DNS label"),
    ("a_b-.org", "is not a DNS label"),
    ("x" * 64 + ".org", "is not a DNS label"),
    (".".join(["abcdefghi"] * 30), "at most 253"),
    ("exa mple.org", "no spaces"),
    ("bücher.de", "xn--"),
    ("0177.0.0.1", "four decimal numbers"),  # octal: a resolver would read 127.0.0.1
    ("2130706433", "four decimal numbers"),  # decimal 127.0.0.1
    ("0x7f.1", "four decimal numbers"),
    ("127.1", "four decimal numbers"),
    ("1.2.3.4.5", "the last label is all digits"),
    ("[::1", "missing ']'"),
    ("[10.0.0.1]:80", "brackets are for IPv6"),
    ("[::1]80", "expected ':PORT' after ']'"),
    ("fe80::1%eth0", "not an IPv6 address"),
    ("10.0.0.0/x", "ADDRESS/PREFIX"),
    ("10.0.0.0/33", "10.0.0.0/33"),
    ("0.0.0.0/0", "every address"),
    ("::/0", "every address"),
    ("*.123", "a wildcard needs a DNS name"),
    ("@pypi", "preset name cannot be used here"),
])
def test_bad_patterns_say_what_is_wrong(raw: str, says: str) -> None:
    with pytest.raises(PatternError) as ei:
        parse_pattern(raw)
    assert says in str(ei.value)


def test_a_rule_refuses_a_bad_pattern_or_action() -> None:
    with pytest.raises(PolicyError, match="'\\*' alone"):
        rule("*")
    with pytest.raises(PolicyError, match="not allow or deny"):
        rule("pypi.org", "permit")


# --------------------------------------------------------------------------- decisions


def test_names_ports_and_wildcards() -> None:
    net = allow("pypi.org:443", "*.example.org", "github.com")
    assert net.decide("pypi.org", 443).allowed
    assert net.decide("PYPI.ORG.", 443).allowed
    assert not net.decide("pypi.org", 80).allowed  # the rule names a port
    assert not net.decide("www.pypi.org", 443).allowed  # a name rule is that name only
    assert net.decide("github.com", 22).allowed and net.decide("github.com", 443).allowed  # no port: any
    assert net.decide("a.example.org", 443).allowed
    assert net.decide("a.b.c.example.org", 1).allowed  # any depth below
    assert not net.decide("example.org", 443).allowed  # never the suffix itself
    assert not net.decide("badexample.org", 443).allowed  # a label boundary, not a string suffix
    d = net.decide("evil.example", 443)
    assert not d.allowed and d.rule is None
    assert d.reason == "no rule allows evil.example:443 (stockade allow --host evil.example)"


def test_deny_wins_whatever_the_tier() -> None:
    # the deny is from a lower tier (global) than the allow (cli): still denied
    net = NetPolicy("allow", (rule("evil.example.org", "deny", "global", "/g.toml"),
                              rule("*.example.org", "allow", "cli", "command line"),
                              rule("evil.example.org", "allow", "cli", "command line")))
    d = net.decide("evil.example.org", 443)
    assert not d.allowed and d.rule is not None and d.rule.action == "deny" and d.rule.tier == "global"
    assert "denied by 'evil.example.org' from /g.toml (global)" in d.reason
    assert net.decide("good.example.org", 443).allowed
    assert not net.decide_name("evil.example.org").allowed
    # a deny of one port leaves the name resolvable and its other ports reachable
    net2 = NetPolicy("allow", (rule("mail.example.org:25", "deny"), rule("mail.example.org")))
    assert not net2.decide("mail.example.org", 25).allowed
    assert net2.decide("mail.example.org", 443).allowed
    assert net2.decide_name("mail.example.org").allowed


def test_the_most_specific_allow_is_named() -> None:
    net = allow("*.example.org", "api.example.org:443", "api.example.org")
    d = net.decide("api.example.org", 443)
    assert d.rule is not None and d.rule.pattern == "api.example.org:443"


def test_ip_literals_need_an_address_rule() -> None:
    net = allow("pypi.org", "10.1.2.3:5432", "192.168.0.0/16")
    assert not net.decide("1.2.3.4", 443).allowed  # a public address, but no rule names it
    assert "no rule allows the address 1.2.3.4:443" in net.decide("1.2.3.4", 443).reason
    assert net.decide("10.1.2.3", 5432).allowed
    assert not net.decide("10.1.2.3", 22).allowed
    assert net.decide("192.168.7.7", 80).allowed
    assert net.decide("[::ffff:10.1.2.3]", 5432).allowed  # IPv4-mapped: the same address


@pytest.mark.parametrize("spelled", ["2130706433", "0x7f000001", "0177.0.0.1", "0x7f.1", "127.1", "017700000001",
                                     "::ffff:127.0.0.1", "[::ffff:7f00:1]"])
def test_other_spellings_of_an_address_are_that_address(spelled: str) -> None:
    """What a resolver (inet_aton) would dial: decided as 127.0.0.1, never as a name."""
    assert host_address(spelled) == ipaddress.IPv4Address("127.0.0.1")
    assert not allow("*.example.org").decide(spelled, 80).allowed
    d = allow("127.0.0.1:8080").decide(spelled, 8080)
    assert d.allowed and d.rule is not None and d.rule.pattern == "127.0.0.1:8080"
    assert not NetPolicy("allow", (rule("127.0.0.1"), rule("127.0.0.0/8", "deny"))).decide(spelled, 1).allowed


SSRF = [
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("::1", "loopback"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:7f00:1", "loopback"),
    ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("172.31.255.255", "private"), ("192.168.1.1", "private"),
    ("fd12:3456::1", "private"), ("fc00::1", "private"),
    ("100.64.0.1", "carrier-grade NAT"), ("100.127.255.254", "carrier-grade NAT"),
    ("169.254.1.1", "link-local"), ("fe80::1", "link-local"),
    ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"), ("100.100.100.200", "metadata"),
    ("::ffff:169.254.169.254", "metadata"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"), ("0.1.2.3", "unspecified"), ("::", "unspecified"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "broadcast"), ("192.0.2.1", "documentation"),
    ("198.18.0.1", "benchmarking"), ("2001:db8::1", "documentation"), ("fec0::1", "site-local"),
    ("64:ff9b::a9fe:a9fe", "metadata"),  # NAT64 of 169.254.169.254
    ("64:ff9b::7f00:1", "loopback"), ("::7f00:1", "loopback"),  # IPv4-compatible
    ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
    ("2002:a00:1::1", "private"),
    ("::2", "unspecified"), ("4000::1", "reserved"),  # outside IPv6 global unicast
]


@pytest.mark.parametrize("addr,kind", SSRF)
def test_ssrf_ranges_are_refused_unless_named(addr: str, kind: str) -> None:
    assert special_range(addr) is not None and kind in str(special_range(addr))
    net = allow("name.example.org")
    d = net.decide_address(addr, 443)
    assert not d.allowed and kind in d.reason and "stockade allow --host" in d.reason
    canon = canonical_address(addr)
    exact = allow(str(canon) if canon.version == 4 else f"[{canon}]:443")
    assert exact.decide_address(addr, 443).allowed  # a rule naming the address lets it through
    wide = allow(str(ipaddress.ip_network(f"{canon}/{16 if canon.version == 4 else 64}", strict=False)))
    assert wide.decide_address(addr, 443).allowed  # and so does a range holding it


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "151.101.0.223", "2606:4700::1111", "2a00:1450::1",
                                  "64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8", "100.63.255.255",
                                  "172.32.0.1", "169.253.255.255", "223.255.255.255"])
def test_public_addresses_pass(addr: str) -> None:
    assert special_range(addr) is None
    d = allow("pypi.org").decide_address(addr, 443)
    assert d.allowed and d.rule is None


def test_a_deny_rule_blocks_a_public_address_and_a_range_rule_needs_its_port() -> None:
    net = NetPolicy("allow", (rule("1.1.1.0/24", "deny"), rule("10.0.0.0/8:5432")))
    assert not net.decide_address("1.1.1.1", 443).allowed
    assert net.decide_address("1.0.0.1", 443).allowed
    assert net.decide_address("10.9.9.9", 5432).allowed
    assert not net.decide_address("10.9.9.9", 22).allowed
    assert not net.decide_address("not-an-ip", 1).allowed
    # a DNS answer has no port yet (0 or None): a port-limited rule lets the address be answered,
    # a port-limited deny does not hide it
    assert net.decide_address("10.9.9.9", 0).allowed and net.decide_address("10.9.9.9", None).allowed
    assert not net.decide_address("1.1.1.1", 0).allowed
    assert not net.decide_address("127.0.0.1", 0).allowed
    assert NetPolicy("allow", (rule("8.8.8.8:53", "deny"),)).decide_address("8.8.8.8", 0).allowed


def test_modes() -> None:
    rules = (rule("pypi.org"),)
    none = NetPolicy("none", rules, forward=(5432,))
    assert not none.decide("pypi.org", 443).allowed and "network mode none" in none.decide("pypi.org", 443).reason
    assert not none.decide_name("pypi.org").allowed
    assert not none.decide_address("8.8.8.8", 443).allowed
    assert NetPolicy("host").decide("anything.example", 1).allowed
    with pytest.raises(PolicyError, match="network mode 'open'"):
        NetPolicy("open")


def test_decide_name() -> None:
    net = allow("*.example.org:443", "pypi.org")
    assert net.decide_name("a.example.org").allowed  # a port-limited rule still lets the name resolve
    assert net.decide_name("PyPI.org.").allowed
    assert not net.decide_name("example.org").allowed
    assert not net.decide_name("exfil-data-1234.attacker.example").allowed
    assert not net.decide_name("127.0.0.1").allowed  # an address is not a name to look up
    assert not net.decide_name("a..b").allowed


# --------------------------------------------------------------------------- presets and the tiers


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    home = tmp_path / "home"
    proj = tmp_path / "proj"
    proj.mkdir()
    (home / ".config" / "stockade").mkdir(parents=True)
    sess = tmp_path / "session"
    sess.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("STOCKADE_NET_RESOLVER", raising=False)
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    policy.clear_cache()
    return {"home": home, "proj": proj, "global": home / ".config" / "stockade" / "config.toml",
            "ws": proj / ".stockade.toml", "sess": sess}


def test_builtin_presets() -> None:
    assert set(BUILTIN_PRESETS) == {"pypi", "npm", "github", "debian"}
    for pats in BUILTIN_PRESETS.values():
        for p in pats:
            assert parse_pattern(p).port is not None  # a preset opens services, not every port
    net = NetPolicy("allow", tuple(rule(p, preset="github") for p in BUILTIN_PRESETS["github"]))
    assert net.decide("github.com", 22).allowed  # git over ssh
    assert net.decide("github.com", 443).allowed
    assert net.decide("objects.githubusercontent.com", 443).allowed
    assert not net.decide("github.com", 80).allowed
    assert "(preset github)" in net.decide("github.com", 22).reason
    pypi = NetPolicy("allow", tuple(rule(p, preset="pypi") for p in BUILTIN_PRESETS["pypi"]))
    assert pypi.decide("pypi.org", 443).allowed and pypi.decide("files.pythonhosted.org", 443).allowed
    npm = NetPolicy("allow", tuple(rule(p) for p in BUILTIN_PRESETS["npm"]))
    assert npm.decide("registry.npmjs.org", 443).allowed
    deb = NetPolicy("allow", tuple(rule(p) for p in BUILTIN_PRESETS["debian"]))
    assert deb.decide("deb.debian.org", 80).allowed and deb.decide("security.debian.org", 443).allowed


def test_config_tiers_with_provenance(env: dict[str, Path]) -> None:
    env["global"].write_text('[network]\ndeny = ["evil.example.org"]\nresolver = "127.0.0.1:5353"\n')
    env["ws"].write_text('[network]\nmode = "allow"\nallow = [\n  "@pypi",\n  "*.example.org",\n]\n'
                         'forward = [5432, "6379"]\n')
    (env["sess"] / "policy.json").write_text(json.dumps(
        {"schema_version": 1, "hosts": [{"host": "api.github.com:443", "action": "allow"}]}, indent=1))
    eff = policy.load(env["proj"], env["sess"], CliPolicy(allow_hosts=("extra.example",), forward=(8080,)))
    net = eff.network
    assert net.mode == "allow" and net.forward == (5432, 6379, 8080) and net.resolver == ("127.0.0.1", 5353)
    by = {r.pattern: r for r in net.rules}
    assert by["evil.example.org"].tier == "global" and by["evil.example.org"].source == str(env["global"])
    assert by["evil.example.org"].line == 2
    assert by["pypi.org:443"].preset == "pypi" and by["pypi.org:443"].tier == "workspace"
    assert by["pypi.org:443"].line == 4 and by["pypi.org:443"].source == str(env["ws"])
    assert by["*.example.org"].line == 5
    assert by["api.github.com:443"].tier == "session" and by["api.github.com:443"].source == str(env["sess"] / "policy.json")
    assert by["extra.example"].tier == "cli" and by["extra.example"].source == "command line"
    d = net.decide("evil.example.org", 443)
    assert not d.allowed and f"from {env['global']}:2 (global)" in d.reason
    d = net.decide("pypi.org", 443)
    assert d.reason == f"pypi.org:443 is allowed by 'pypi.org:443' (preset pypi) from {env['ws']}:4 (workspace)"
    # show: every host rule with its tier, and the mode with the file that set it
    rows = [(r.kind, r.action, r.target, r.origin.layer) for r in eff.rules()]
    assert ("host", "deny", "evil.example.org", "global") in rows
    assert ("host", "allow", "extra.example", "cli") in rows
    assert ("setting", "set", 'network.mode = "allow"', "workspace") in rows
    assert eff.to_json()["network"]["mode"] == "allow"
    # the network is part of the policy's digest
    assert policy.load(env["proj"], None, CliPolicy()).digest != policy.load(env["proj"], env["sess"], CliPolicy()).digest


def test_cli_mode_beats_the_config(env: dict[str, Path]) -> None:
    env["ws"].write_text('[network]\nmode = "allow"\nallow = ["pypi.org"]\n')
    assert policy.load(env["proj"], None, CliPolicy()).network.mode == "allow"
    assert policy.load(env["proj"], None, CliPolicy(net_mode="none")).network.mode == "none"
    assert policy.load(env["proj"], None, CliPolicy(net_mode="host")).network.mode == "host"


def test_why_resolv_conf_follows_the_mode(env: dict[str, Path]) -> None:
    if os.path.islink("/etc/resolv.conf"):
        pytest.skip("/etc/resolv.conf is a symlink here: `why` answers for its target")
    d = policy.load(env["proj"], None, CliPolicy()).why("/etc/resolv.conf")
    assert not d.visible
    d = policy.load(env["proj"], None, CliPolicy(net_mode="allow")).why("/etc/resolv.conf")
    assert d.visible and "the proxy's DNS responder" in d.reason
    if os.path.lexists("/etc/resolv.conf"):
        d = policy.load(env["proj"], None, CliPolicy(net_mode="host")).why("/etc/resolv.conf")
        assert d.visible and "the host's resolv.conf" in d.reason


def test_presets_defined_and_replaced_in_the_config(env: dict[str, Path]) -> None:
    env["global"].write_text('[network.presets]\ncorp = ["artifacts.corp.example:443"]\n')
    env["ws"].write_text('[network]\nallow = ["@corp", "@pypi"]\n[network.presets]\npypi = ["mirror.corp.example:443"]\n')
    net = policy.load(env["proj"], None, CliPolicy()).network
    pats = {(r.pattern, r.preset) for r in net.rules}
    assert pats == {("artifacts.corp.example:443", "corp"), ("mirror.corp.example:443", "pypi")}
    assert dict(net.presets)["corp"] == ("artifacts.corp.example:443",)


@pytest.mark.parametrize("toml,key,says", [
    ('[network]\nallow = ["*"]\n', "network.allow[0]", "'*' alone"),
    ('[network]\nallow = ["ok.org",\n "bad..org"]\n', "network.allow[1]", "empty label"),
    ('[network]\ndeny = ["x.org:99999"]\n', "network.deny[0]", "out of range"),
    ('[network]\nallow = ["@nope"]\n', "network.allow[0]", "unknown preset '@nope'; known presets: @debian, @github, @npm, @pypi"),
    ('[network]\nforward = [3128]\n', "network.forward[0]", "the sandbox's own proxy"),
    ('[network]\nforward = ["abc"]\n', "network.forward[0]", "not a port number"),
    ('[network]\nforward = [70000]\n', "network.forward[0]", "out of range"),
    ('[network]\nresolver = "dns.example:53"\n', "network.resolver", "expected IP:PORT"),
    ('[network]\nmode = "open"\n', "network.mode", "invalid value 'open'"),
    ('[network]\nallowed = ["x.org"]\n', "network.allowed", "unknown key; valid keys here: allow, deny, forward, mode, presets, resolver"),
    ('[network.presets]\ncorp = ["@pypi"]\n', "network.presets.corp", "not other presets"),
    ('[network.presets]\ncorp = "x.org"\n', "network.presets.corp", "expected an array of strings"),
    ('[network.presets]\ncorp = []\n', "network.presets.corp", "an empty preset"),
])
def test_bad_network_config_names_file_line_and_key(env: dict[str, Path], toml: str, key: str, says: str) -> None:
    env["ws"].write_text(toml)
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], None, CliPolicy())
    msg = str(ei.value)
    assert msg.startswith(f"{env['ws']}:") and key in msg and says in msg, msg
    assert "\n" not in msg and isinstance(ei.value, UsageError)


@pytest.mark.parametrize("cli,says", [
    (CliPolicy(net_mode="open"), "--net 'open' is not a network mode; use none, allow or host"),
    (CliPolicy(allow_hosts=("*",)), "--allow-host: '*': '*' alone"),
    (CliPolicy(allow_hosts=("@nope",)), "--allow-host: unknown preset '@nope'"),
    (CliPolicy(allow_hosts=("0177.0.0.1",)), "--allow-host: '0177.0.0.1'"),
    (CliPolicy(forward=("53",)), "--forward: port 53 is the sandbox's own DNS responder"),
    (CliPolicy(forward=(0,)), "--forward: port 0 is out of range"),
    (CliPolicy(forward=(True,)), "--forward: port True is not a port number"),  # type: ignore[arg-type]
])
def test_bad_cli_network_options(env: dict[str, Path], cli: CliPolicy, says: str) -> None:
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], None, cli)
    assert says in str(ei.value)


def test_resolver_from_the_environment_per_run(env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    env["ws"].write_text('[network]\nresolver = "127.0.0.1:5353"\n')
    monkeypatch.setenv("STOCKADE_NET_RESOLVER", "resolver.example")
    assert policy.load_cached(env["proj"], None, CliPolicy()).network.mode == "none"  # not read without a proxy
    monkeypatch.delenv("STOCKADE_NET_RESOLVER")
    eff = policy.load_cached(env["proj"], None, CliPolicy(net_mode="allow"))
    assert eff.network.resolver == ("127.0.0.1", 5353)
    monkeypatch.setenv("STOCKADE_NET_RESOLVER", "[::1]:5300")
    assert eff.network.resolver == ("::1", 5300)  # read when asked, not when loaded
    assert policy.load_cached(env["proj"], None, CliPolicy(net_mode="allow")).network.resolver == ("::1", 5300)
    monkeypatch.setenv("STOCKADE_NET_RESOLVER", "10.0.0.1")
    assert eff.network.resolver == ("10.0.0.1", 53)
    monkeypatch.setenv("STOCKADE_NET_RESOLVER", "resolver.example")
    with pytest.raises(PolicyError, match=r"STOCKADE_NET_RESOLVER 'resolver\.example': expected IP:PORT"):
        _ = eff.network


def test_round_trips() -> None:
    net = NetPolicy("allow", (rule("pypi.org:443", preset="pypi", line=3), rule("10.0.0.0/8", "deny", "cli", "command line")),
                    forward=(5432,), resolver=("::1", 53), presets=tuple(sorted(BUILTIN_PRESETS.items())))
    again = pickle.loads(pickle.dumps(net))
    assert again == net and again.decide("pypi.org", 443).allowed and again.digest == net.digest
    doc = marshal.loads(marshal.dumps(net.to_json()))  # what the prepared-run cache stores
    back = NetPolicy.from_json(doc)
    assert back == net and back.rules[0].line == 3 and back.resolver == ("::1", 53) and back.presets == net.presets
    assert not back.decide_address("10.1.1.1", 80).allowed
    assert NetPolicy("allow", net.rules[:1]).digest != net.digest


def test_explain_lines() -> None:
    net = NetPolicy("allow", (rule("pypi.org:443", preset="pypi", line=3),), forward=(5432,))
    text = "\n".join(net.explain_lines())
    assert "127.0.0.1:3128" in text and "pypi.org:443" in text and "/p/.stockade.toml:3" in text
    assert "preset pypi" in text and "localhost:5432" in text and "metadata" in text
    assert "no allow rule" in "\n".join(NetPolicy("allow").explain_lines())


# --------------------------------------------------------------------------- the session's rules, live


def write_hosts(sess: Path, hosts: list[tuple[str, str]]) -> None:
    tmp = sess / ".policy.json.tmp"
    tmp.write_text(json.dumps({"schema_version": 1, "hosts": [{"host": h, "action": a} for h, a in hosts]}))
    os.replace(tmp, sess / "policy.json")  # as `stockade allow --host` writes it


def test_live_policy_follows_the_session_file(tmp_path: Path) -> None:
    base = NetPolicy("allow", (rule("pypi.org"), rule("old.example", "allow", "session", "x")),
                     presets=tuple(sorted(BUILTIN_PRESETS.items())))
    live = LiveNetPolicy(base, tmp_path)
    assert not live.current().decide("old.example", 443).allowed  # no session file: no session rules
    assert live.current().decide("pypi.org", 443).allowed
    write_hosts(tmp_path, [("new.example", "allow")])
    cur = live.current()
    assert cur.decide("new.example", 443).allowed
    r = cur.decide("new.example", 443).rule
    assert r is not None and r.tier == "session" and r.source == str(tmp_path / "policy.json")
    assert live.current() is cur  # unchanged file: the same policy, one stat
    write_hosts(tmp_path, [("new.example", "allow"), ("pypi.org", "deny"), ("@github", "allow")])
    cur = live.current()
    assert not cur.decide("pypi.org", 443).allowed  # a session deny beats the config's allow
    assert cur.decide("github.com", 22).allowed  # presets expand
    (tmp_path / "policy.json").unlink()
    assert not live.current().decide("new.example", 443).allowed
    assert live.current().decide("pypi.org", 443).allowed
    # a broken file keeps the rules in force and says why
    write_hosts(tmp_path, [("kept.example", "allow")])
    assert live.current().decide("kept.example", 443).allowed
    (tmp_path / "policy.json").write_text("{broken")
    assert live.current().decide("kept.example", 443).allowed and live.error is not None
    assert LiveNetPolicy(base, None).current() is base


def test_live_policy_is_thread_safe_and_cheap(tmp_path: Path) -> None:
    live = LiveNetPolicy(NetPolicy("allow", (rule("pypi.org"),)), tmp_path)
    stop = threading.Event()
    seen: list[bool] = []
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            while not stop.is_set():
                seen.append(live.current().decide("a.example", 443).allowed)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(30):
        write_hosts(tmp_path, [("a.example", "allow" if i % 2 else "deny")])
    write_hosts(tmp_path, [("a.example", "allow")])
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert live.current().decide("a.example", 443).allowed
    start = time.perf_counter()
    for _ in range(2000):
        live.current()
    assert (time.perf_counter() - start) / 2000 < 0.0005  # a stat, not a parse


# --------------------------------------------------------------------------- the command line and the core


@pytest.mark.parametrize("argv", [
    ["run", "--net", "allow", "--allow-host", "pypi.org", "--allow-host=@github", "--forward", "5432", "--", "x"],
    ["run", "--net=none", "--forward=6379", "x"],
    ["run", "--allow-host", "*.example.org:443", "--", "x"],
])
def test_fast_parse_reads_the_network_options_as_argparse(argv: list[str]) -> None:
    fast = table.fast_parse(argv)
    assert fast is not None and fast == table.parse(argv)
    kw = run_kwargs(fast)
    assert kw["network"] == fast.net and kw["allow_hosts"] == tuple(fast.allow_hosts)
    assert table.keepable(fast)  # a prepared run with these options may be kept (they are in its key)


def test_no_net_option_leaves_the_mode_to_the_config() -> None:
    kw = run_kwargs(table.parse(["run", "--", "x"]))
    assert kw["network"] is None and kw["allow_hosts"] == () and kw["forward"] == ()
    assert table.fast_parse(["run", "--net", "open", "--", "x"]) is None  # argparse refuses it


def test_the_cache_key_has_the_network_options(tmp_path: Path) -> None:
    from stockade.core.prepare import _key

    base = _key(RunRequest(["x"], network="allow"), tmp_path)
    assert base != _key(RunRequest(["x"], network="allow", allow_hosts=("pypi.org",)), tmp_path)
    assert base != _key(RunRequest(["x"], network="allow", forward=(5432,)), tmp_path)
    assert base != _key(RunRequest(["x"]), tmp_path)


@pytest.fixture()
def proj(env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(env["proj"])
    return env["proj"]


def test_prepared_net_per_mode(proj: Path) -> None:
    from stockade.core.execute import explain_plan

    def prep(**kw: object) -> tuple[object, str, tuple[int, ...]]:
        p = explain_plan(RunRequest(["true"], project=proj, **kw))  # type: ignore[arg-type]
        return p.net, p.plan.network, p.plan.forward

    net, mode, fwd = prep()
    assert net is None and mode == "none" and fwd == ()
    net, mode, fwd = prep(network="allow", allow_hosts=["pypi.org"])
    assert isinstance(net, NetPolicy) and mode == "allow" and net.decide("pypi.org", 443).allowed
    net, mode, fwd = prep(forward=[5432])
    assert isinstance(net, NetPolicy) and net.mode == "none" and fwd == (5432,)
    net, mode, fwd = prep(network="host")
    assert net is None and mode == "host"
    (proj / ".stockade.toml").write_text('[network]\nmode = "allow"\nallow = ["@npm"]\nforward = [6379]\n')
    policy.clear_cache()
    net, mode, fwd = prep()
    assert isinstance(net, NetPolicy) and mode == "allow" and fwd == (6379,) and net.decide("registry.npmjs.org", 443).allowed
    net, mode, fwd = prep(network="host")  # the config's forwards: the host's network reaches them anyway
    assert net is None and mode == "host" and fwd == ()


@pytest.mark.parametrize("kw,says", [
    ({"allow_hosts": ["pypi.org"]}, "--allow-host needs --net allow (the network mode is none)"),
    ({"network": "host", "allow_hosts": ["pypi.org"]}, "--allow-host needs --net allow (the network mode is host)"),
    ({"network": "host", "forward": [5432]}, "--forward: the host's network already reaches its ports"),
    ({"network": "open"}, "--net 'open' is not a network mode; use none, allow or host"),
    ({"network": "allow", "allow_hosts": "pypi.org"}, "allow_hosts and forward take a list"),
    ({"network": "allow", "allow_hosts": ["pypi.org:99999"]}, "--allow-host: 'pypi.org:99999': port 99999 is out of range"),
])
def test_bad_network_requests(proj: Path, kw: dict[str, object], says: str) -> None:
    from stockade.core.execute import explain_plan

    with pytest.raises(UsageError) as ei:
        explain_plan(RunRequest(["true"], project=proj, **kw))  # type: ignore[arg-type]
    assert says in str(ei.value)


def test_the_warm_cache_keeps_the_net_policy(proj: Path) -> None:
    """A prepared run stored across processes brings its NetPolicy back."""
    from stockade.core.prepare import Resolved
    from stockade.fast import warm
    from stockade.session import store

    (proj / ".stockade.toml").write_text('[network]\nmode = "allow"\nallow = ["@pypi"]\n')
    sess = store.open_or_create(proj, None)
    from stockade.core import prepare as prep

    past = time.time() - 30  # older than the timestamp granularity: revalidated by stat alone
    for p in (proj / ".stockade.toml", proj, sess.dir):
        os.utime(p, (past, past))
    policy.clear_cache()

    req = RunRequest(["true"], project=proj, allow_hosts=["extra.example"])
    key = prep._key(req, proj)
    assert key is not None
    resolved = prep.resolve(sess, proj, req, ("true",))
    assert resolved.net is not None
    if not warm.save(key, resolved):
        pytest.skip("this preparation cannot be kept (a file changed within the timestamp granularity)")
    time.sleep(0.05)
    got = warm.load(key, sess)
    assert isinstance(got, Resolved) and got.net == resolved.net and got.inputs.forward == resolved.inputs.forward
    assert got.net.decide("extra.example", 443).allowed and got.net.rules[0].source == str(proj / ".stockade.toml")
    # a changed [network] section invalidates it (the tier files are its deps)
    (proj / ".stockade.toml").write_text('[network]\nmode = "allow"\nallow = ["@npm"]\n')
    assert warm.load(key, sess) is None
