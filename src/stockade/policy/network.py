"""The network policy of ``--net allow``: host rules, presets, and the decisions the
proxy asks for (a name, a name's resolved address, an IP literal).

A rule is ``HOST[:PORT]``: a DNS name (case-insensitive, trailing dot dropped), ``*.suffix``
(any depth below ``suffix``, never ``suffix`` itself), an IPv4 or IPv6 address (IPv6 in
brackets when a port follows) or a CIDR range; ``@name`` stands for a preset's rules.
Deny wins over allow whatever the tiers. A name's resolved address is refused when it
lies in a range the sandbox must not reach through the proxy (loopback, private,
shared, link-local, multicast, cloud metadata, unspecified, reserved: the SSRF class)
unless an allow rule names that address or a range holding it.

Everything here is immutable and made only of strings, ints and tuples, so a policy
survives pickling, the CLI's prepared-run cache (``to_json``/``from_json``) and threads.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import PolicyError
from ..sandbox_fs import DNS_PORT, PROXY_PORT

Tier = str  # the policy's layer names: default, global, workspace, session, cli
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MODES = ("none", "allow", "host")
ACTIONS = ("allow", "deny")
# the ports the sandbox's own loopback already uses for the proxy and DNS
RESERVED_PORTS = (PROXY_PORT, DNS_PORT)

# What users expect each preset to reach. Ports are given: a preset opens the service,
# not every port of its hosts.
BUILTIN_PRESETS: dict[str, tuple[str, ...]] = {
    # pip: the index and its file host
    "pypi": ("pypi.org:443", "files.pythonhosted.org:443"),
    # npm and yarn (classic) registries
    "npm": ("registry.npmjs.org:443", "registry.yarnpkg.com:443"),
    # git over https and ssh (22, and ssh.github.com:443 for networks that block 22),
    # the API, tarballs (codeload), raw files and release assets (*.githubusercontent.com)
    "github": (
        "github.com:443", "github.com:22", "ssh.github.com:443", "api.github.com:443", "codeload.github.com:443",
        "*.githubusercontent.com:443",
    ),
    # apt: plain http by default, https when configured
    "debian": ("deb.debian.org:80", "deb.debian.org:443", "security.debian.org:80", "security.debian.org:443"),
}

_LABEL_RE = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_PRESET_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_INET_ATON_RE = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}$")


# --------------------------------------------------------------------------- patterns


class PatternError(ValueError):
    """A malformed host pattern; the message says what is wrong and how to write it."""


@dataclass(frozen=True)
class Pattern:
    """A parsed ``HOST[:PORT]``. ``kind``: name | wildcard | address | network."""

    kind: str
    host: str  # name, the suffix of a wildcard (no "*."), or the canonical address/network
    port: int | None

    def text(self) -> str:
        if self.kind == "wildcard":
            h = "*." + self.host
        elif ":" in self.host:  # IPv6
            h = f"[{self.host}]" if self.port is not None else self.host
        else:
            h = self.host
        return h if self.port is None else f"{h}:{self.port}"


def parse_port(raw: object, what: str = "port") -> int:
    """A TCP port 1-65535 from an int or a decimal string; PatternError otherwise."""
    if isinstance(raw, bool):
        raise PatternError(f"{what} {raw!r} is not a port number (1-65535)")
    if isinstance(raw, int):
        n = raw
    elif isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 5:
        n = int(raw)
    else:
        raise PatternError(f"{what} {raw!r} is not a port number (1-65535)")
    if not 1 <= n <= 65535:
        raise PatternError(f"{what} {n} is out of range (1-65535)")
    return n


def parse_forward(raw: object) -> int:
    """A forwarded host port: 1-65535, not one the sandbox's own proxy or DNS listens on."""
    n = parse_port(raw)
    if n in RESERVED_PORTS:
        use = "proxy" if n == PROXY_PORT else "DNS responder"
        raise PatternError(f"port {n} is the sandbox's own {use}; forward another port")
    return n


def _looks_numeric(host: str) -> bool:
    """Forms inet_aton(3) reads as an IPv4 address (2130706433, 0177.1, 0x7f.1): never names."""
    return bool(_INET_ATON_RE.match(host))


def _name_error(host: str) -> str | None:
    if len(host) > 253:
        return "a DNS name is at most 253 characters"
    labels = host.split(".")
    for lab in labels:
        if not lab:
            return "empty label (two dots, or a leading dot)"
        if not _LABEL_RE.match(lab):
            return f"label {lab!r} is not a DNS label (letters, digits, '-', at most 63)"
    if labels[-1].isdigit():
        return "the last label is all digits: write an IPv4 address as four decimal numbers (a.b.c.d)"
    return None


def _address(text: str) -> IPAddress | None:
    """The address ``text`` spells strictly (dotted quad, IPv6 without zone), IPv4-mapped
    IPv6 as its IPv4 address; None when it is no address."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return None
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
    return ip


def parse_pattern(raw: str) -> Pattern:
    """Parse one host pattern (not a ``@preset``); PatternError says what is wrong."""
    if not isinstance(raw, str):
        raise PatternError(f"{raw!r} is not a string")
    text = raw.strip().lower()
    if not text:
        raise PatternError("empty host pattern")
    if any(c.isspace() for c in text) or "\0" in text or not text.isascii():
        raise PatternError(f"{raw!r}: a host pattern has no spaces and only ASCII (use the xn-- form of a name)")
    if text.startswith("@"):
        raise PatternError(f"{raw!r}: a preset name cannot be used here")
    port: int | None = None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise PatternError(f"{raw!r}: missing ']' after the IPv6 address")
        host, rest = text[1:end], text[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise PatternError(f"{raw!r}: expected ':PORT' after ']'")
            port = parse_port(rest[1:], f"{raw!r}: port")
        if ":" not in host:
            raise PatternError(f"{raw!r}: brackets are for IPv6 addresses only")
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = parse_port(p, f"{raw!r}: port")
    else:
        host = text  # a name, an IPv4 address, or a bare IPv6 address (no port)
    if host.endswith(".") and not host.endswith(".."):
        host = host[:-1]
    if not host:
        raise PatternError(f"{raw!r}: no host before the port")
    if "/" in host:
        addr, _, plen = host.partition("/")
        if not plen.isdigit() or not _strict_ip(addr):
            raise PatternError(f"{raw!r}: a CIDR range is ADDRESS/PREFIX, e.g. 10.0.0.0/8 or fd00::/8")
        try:
            net = ipaddress.ip_network(host, strict=False)
        except ValueError as e:
            raise PatternError(f"{raw!r}: {e}") from None
        if net.prefixlen == 0:
            raise PatternError(f"{raw!r}: a /0 range is every address; use --net host for that")
        return Pattern("network", str(net), port)
    if ":" in host:
        ip = _address(host)
        if ip is None:
            raise PatternError(f"{raw!r}: not an IPv6 address (with a port, write [ADDRESS]:PORT)")
        return Pattern("address", str(ip), port)
    if host == "*":
        raise PatternError(f"{raw!r}: '*' alone would allow every host; name the hosts, or use --net host")
    if host.startswith("*."):
        suffix = host[2:]
        if "*" in suffix:
            raise PatternError(f"{raw!r}: '*' only as the whole first label, e.g. '*.example.org'")
        why = _name_error(suffix) if not _looks_numeric(suffix) else "a wildcard needs a DNS name after '*.'"
        if why:
            raise PatternError(f"{raw!r}: {why}")
        return Pattern("wildcard", suffix, port)
    if "*" in host:
        raise PatternError(f"{raw!r}: '*' only as the whole first label, e.g. '*.example.org'")
    ip = _address(host)
    if ip is not None:
        return Pattern("address", str(ip), port)
    if _looks_numeric(host):
        raise PatternError(f"{raw!r}: write an IPv4 address as four decimal numbers without leading zeros (a.b.c.d)")
    why = _name_error(host)
    if why:
        raise PatternError(f"{raw!r}: {why}")
    return Pattern("name", host, port)


def _strict_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def parse_resolver(raw: str, what: str = "resolver") -> tuple[str, int]:
    """``IP[:PORT]`` (IPv6 as ``[IP]:PORT``; port 53 when omitted): the upstream DNS server."""
    text = raw.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = 53 if not rest else parse_port(rest[1:] if rest.startswith(":") else rest, f"{what} port")
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = parse_port(p, f"{what} port")
    else:
        host, port = text, 53
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise PatternError(f"{what} {raw!r}: expected IP:PORT of a DNS server, e.g. 127.0.0.1:5353 or [::1]:53") from None
    return str(ip), port


# --------------------------------------------------------------------------- addresses the proxy refuses

def _nets(*spec: tuple[str, str]) -> tuple[tuple[IPNetwork, str], ...]:
    return tuple((ipaddress.ip_network(n), why) for n, why in spec)


# Explicit, not ipaddress's is_private/is_global (whose lists change between Python
# versions). Checked in order: the first that holds names the range. Metadata first.
_V4_SPECIAL = _nets(
    ("169.254.169.254/32", "the cloud metadata address"),
    ("100.100.100.200/32", "a cloud metadata address (Alibaba)"),
    ("0.0.0.0/8", "unspecified ('this network', 0.0.0.0/8)"),
    ("127.0.0.0/8", "loopback"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("100.64.0.0/10", "shared address space (carrier-grade NAT, RFC 6598)"),
    ("169.254.0.0/16", "link-local"),
    ("192.0.0.0/24", "reserved (IETF protocol assignments)"),
    ("192.0.2.0/24", "reserved (documentation)"),
    ("198.51.100.0/24", "reserved (documentation)"),
    ("203.0.113.0/24", "reserved (documentation)"),
    ("192.88.99.0/24", "reserved (6to4 relay anycast)"),
    ("198.18.0.0/15", "reserved (benchmarking)"),
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "broadcast"),
    ("240.0.0.0/4", "reserved (240.0.0.0/4)"),
)
_V6_SPECIAL = _nets(
    ("fd00:ec2::254/128", "the cloud metadata address (AWS, IPv6)"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("fc00::/7", "private (unique local, fc00::/7)"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local (deprecated)"),
    ("ff00::/8", "multicast"),
    ("2001:db8::/32", "reserved (documentation)"),
    ("3fff::/20", "reserved (documentation)"),
    ("2001::/23", "reserved (IETF protocol assignments, Teredo)"),
    ("100::/64", "reserved (discard-only)"),
)
_V6_GLOBAL = ipaddress.ip_network("2000::/3")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("::/96"))  # embed an IPv4 address in the low 32 bits
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


def canonical_address(ip: str | IPAddress) -> IPAddress:
    """An address as the kernel would dial it: IPv4-mapped IPv6 (::ffff:a.b.c.d) is its
    IPv4 address. A string is parsed strictly (ValueError for 0177.0.0.1, 2130706433, ...)."""
    addr: IPAddress = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.scope_id:
            addr = ipaddress.IPv6Address(str(addr).split("%", 1)[0])
        if addr.ipv4_mapped is not None:
            return addr.ipv4_mapped
    return addr


def special_range(ip: str | IPAddress) -> str | None:
    """What kind of address the proxy must not dial unasked (``None``: a public unicast
    address). IPv6 that carries an IPv4 address (NAT64, IPv4-compatible, 6to4) is judged
    by that address too."""
    addr = canonical_address(ip)
    if isinstance(addr, ipaddress.IPv4Address):
        for net, why in _V4_SPECIAL:
            if addr in net:
                return why
        return None
    for net, why in _V6_SPECIAL:
        if addr in net:
            return why
    for net in _NAT64:
        if addr in net:
            inner = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
            why4 = special_range(inner)
            return f"{why4} (as {inner}, embedded in {net})" if why4 else None
    if addr in _NAT64_LOCAL:
        return "reserved (local-use NAT64, 64:ff9b:1::/48)"
    if addr.sixtofour is not None:
        why4 = special_range(addr.sixtofour)
        return f"{why4} (as {addr.sixtofour}, embedded in 6to4 2002::/16)" if why4 else None
    if addr not in _V6_GLOBAL:
        return "reserved (not IPv6 global unicast 2000::/3)"
    return None


def host_address(host: str) -> IPAddress | None:
    """The address a client's host string denotes, canonical: a strict literal
    (``[v6]`` too), or an inet_aton(3) form (2130706433, 0x7f.1, 0177.0.0.1) that a
    resolver would read as one; None for a name."""
    h = host.strip().lower()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    ip = _address(h)
    if ip is not None:
        return ip
    if ":" in h and "%" in h:  # an IPv6 address with a zone: its address
        try:
            return canonical_address(h)
        except ValueError:
            return None
    if _looks_numeric(h):
        import socket

        try:
            return ipaddress.IPv4Address(socket.inet_aton(h))
        except (OSError, ValueError):
            return None
    return None


def normalize_name(host: str) -> str:
    h = host.strip().lower()
    return h[:-1] if h.endswith(".") else h


# --------------------------------------------------------------------------- rules and decisions


@dataclass(frozen=True)
class HostRule:
    """One host rule, with where it came from."""

    pattern: str  # as written (after preset expansion): "pypi.org", "*.pythonhosted.org:443", "10.0.0.0/8"
    action: str  # allow | deny
    tier: Tier  # the layer: default, global, workspace, session, cli
    source: str  # the file, "command line", or "default"
    preset: str | None = None  # "pypi" when it came from @pypi
    line: int | None = None  # the line of the file, when known

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise PolicyError(f"host rule {self.pattern!r}: action {self.action!r} is not allow or deny")
        try:
            p = parse_pattern(self.pattern)
        except PatternError as e:
            raise PolicyError(f"host rule: {e}") from None
        net = ipaddress.ip_network(p.host) if p.kind in ("address", "network") else None
        object.__setattr__(self, "_p", p)
        object.__setattr__(self, "_net", net)

    @property
    def parsed(self) -> Pattern:
        p: Pattern = self.__dict__["_p"]
        return p

    @property
    def port(self) -> int | None:
        return self.parsed.port

    def _port_ok(self, port: int | None) -> bool:
        mine = self.parsed.port
        return mine is None or port is None or mine == port

    def matches_name(self, name: str, port: int | None) -> bool:
        """``name`` (lower case, no trailing dot) at ``port`` (None: any port of a rule
        without one, or with one: for DNS) matches this name or wildcard rule."""
        p = self.parsed
        if p.kind == "name":
            hit = name == p.host
        elif p.kind == "wildcard":
            hit = name.endswith("." + p.host)
        else:
            return False
        return hit and self._port_ok(port)

    def covers_address(self, ip: IPAddress | str, port: int | None) -> bool:
        """This address or range rule holds ``ip`` (canonical) at ``port``."""
        net: IPNetwork | None = self.__dict__["_net"]
        if net is None:
            return False
        addr = canonical_address(ip)
        return addr.version == net.version and addr in net and self._port_ok(port)

    def matches(self, host: str, port: int) -> bool:
        """The client asked for ``host`` (a name or an IP literal) at ``port``."""
        ip = host_address(host)
        if ip is not None:
            return self.covers_address(ip, port)
        return self.matches_name(normalize_name(host), port)

    def where(self) -> str:
        if self.line is not None and self.source.startswith("/"):
            return f"{self.source}:{self.line}"
        return self.source

    def describe(self) -> str:
        pre = f" (preset {self.preset})" if self.preset else ""
        src = self.where()
        tail = f"{src} ({self.tier})" if src != self.tier else self.tier
        return f"{self.pattern!r}{pre} from {tail}"

    def specificity(self) -> tuple[int, int, int]:
        p = self.parsed
        kind = {"name": 3, "address": 3, "wildcard": 1, "network": 1}[p.kind]
        depth = p.host.count(".") + p.host.count(":")
        if p.kind == "network":
            depth = ipaddress.ip_network(p.host).prefixlen
        return (kind, int(p.port is not None), depth)

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "action": self.action, "tier": self.tier, "source": self.source,
                "preset": self.preset, "line": self.line}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HostRule:
        return cls(str(d["pattern"]), str(d["action"]), str(d["tier"]), str(d["source"]), d.get("preset"), d.get("line"))


@dataclass(frozen=True)
class HostDecision:
    allowed: bool
    rule: HostRule | None  # None: nothing matched (default deny), or no rule needed (a public address)
    reason: str  # one line

    def to_json(self) -> dict[str, Any]:
        return {"allowed": self.allowed, "rule": self.rule.to_json() if self.rule else None, "reason": self.reason}


def _target(host: str, port: int | None) -> str:
    if port is None:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class NetPolicy:
    """The network of one run: its mode, host rules, forwarded host ports, resolver."""

    mode: str = "none"  # none | allow | host
    rules: tuple[HostRule, ...] = ()
    forward: tuple[int, ...] = ()
    resolver: tuple[str, int] | None = None  # the upstream DNS server the proxy asks; None: getaddrinfo
    # the presets in force (built-in and [network.presets]): a session's `allow --host @name` expands by them
    presets: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PolicyError(f"network mode {self.mode!r}: expected one of none, allow, host")

    # ---- the rules -------------------------------------------------------------
    @property
    def allows(self) -> tuple[HostRule, ...]:
        return tuple(r for r in self.rules if r.action == "allow")

    @property
    def denies(self) -> tuple[HostRule, ...]:
        return tuple(r for r in self.rules if r.action == "deny")

    def _mode_refusal(self, target: str) -> HostDecision | None:
        if self.mode == "host":
            return HostDecision(True, None, "network mode host: the host's network, no rules apply")
        if self.mode == "none":
            return HostDecision(False, None, f"network mode none: {target} is not reachable (run with --net allow)")
        return None

    def decide(self, host: str, port: int) -> HostDecision:
        """May the client reach ``host`` (a name or an IP literal it asked for) at ``port``?
        Deny wins; an IP literal needs an address or range allow rule."""
        ip = host_address(host)
        target = _target(str(ip) if ip is not None else normalize_name(host), port)
        refused = self._mode_refusal(target)
        if refused is not None:
            return refused
        if ip is not None:
            for r in self.denies:
                if r.covers_address(ip, port):
                    return HostDecision(False, r, f"{target} is denied by {r.describe()}")
            best = self._best(r for r in self.allows if r.covers_address(ip, port))
            if best is not None:
                return HostDecision(True, best, f"{target} is allowed by {best.describe()}")
            return HostDecision(False, None, f"no rule allows the address {target}: connect by a name the policy "
                                             f"allows, or name the address (stockade allow --host {target})")
        name = normalize_name(host)
        why = _name_error(name) if name else "empty name"
        if why:
            return HostDecision(False, None, f"{name!r} is not a host name ({why})")
        for r in self.denies:
            if r.matches_name(name, port):
                return HostDecision(False, r, f"{target} is denied by {r.describe()}")
        best = self._best(r for r in self.allows if r.matches_name(name, port))
        if best is not None:
            return HostDecision(True, best, f"{target} is allowed by {best.describe()}")
        return HostDecision(False, None, f"no rule allows {target} (stockade allow --host {name})")

    def decide_name(self, host: str) -> HostDecision:
        """May ``host`` resolve inside at all (DNS: any port a rule allows)? A deny with a
        port does not stop the name resolving (other ports may be allowed)."""
        name = normalize_name(host)
        refused = self._mode_refusal(name)
        if refused is not None:
            return refused
        if host_address(name) is not None:
            return HostDecision(False, None, f"{name!r} is an address, not a name to resolve")
        why = _name_error(name) if name else "empty name"
        if why:
            return HostDecision(False, None, f"{name!r} is not a host name ({why})")
        for r in self.denies:
            if r.port is None and r.matches_name(name, None):
                return HostDecision(False, r, f"{name} is denied by {r.describe()}")
        best = self._best(r for r in self.allows if r.matches_name(name, None))
        if best is not None:
            return HostDecision(True, best, f"{name} is allowed by {best.describe()}")
        return HostDecision(False, None, f"no rule allows {name} (stockade allow --host {name})")

    def decide_address(self, ip: str | IPAddress, port: int | None) -> HostDecision:
        """May the proxy dial ``ip`` (a resolved address of an allowed name) at ``port``?
        A deny rule covering it: no. An address in a special range (loopback, private,
        link-local, metadata, ...): only when an allow rule covers it. Else yes.
        ``port`` None or 0 (a DNS answer: no port yet): a rule of any port counts."""
        port = port or None
        try:
            addr = canonical_address(ip)
        except ValueError:
            return HostDecision(False, None, f"{ip!r} is not an IP address")
        target = _target(str(addr), port)
        refused = self._mode_refusal(target)
        if refused is not None:
            return refused
        for r in self.denies:
            # without a port (DNS), a deny of one port leaves the address to the others
            if (port is not None or r.port is None) and r.covers_address(addr, port):
                return HostDecision(False, r, f"{target} is denied by {r.describe()}")
        kind = special_range(addr)
        if kind is None:
            return HostDecision(True, None, f"{addr} is a public address")
        best = self._best(r for r in self.allows if r.covers_address(addr, port))
        if best is not None:
            return HostDecision(True, best, f"{target} ({kind}) is allowed by {best.describe()}")
        return HostDecision(False, None, f"{addr} is {kind}: refused unless a rule names it "
                                         f"(stockade allow --host {target})")

    @staticmethod
    def _best(rules: Iterable[HostRule]) -> HostRule | None:
        best: HostRule | None = None
        for r in rules:
            if best is None or r.specificity() > best.specificity():
                best = r
        return best

    # ---- changes -------------------------------------------------------------------
    def with_session_rules(self, rules: Sequence[HostRule]) -> NetPolicy:
        """This policy with the session tier's host rules replaced by ``rules``."""
        return replace(self, rules=(*(r for r in self.rules if r.tier != "session"), *rules))

    def preset_table(self) -> dict[str, tuple[str, ...]]:
        return dict(self.presets) if self.presets else dict(BUILTIN_PRESETS)

    # ---- show ------------------------------------------------------------------------
    @property
    def digest(self) -> str:
        cached: str | None = self.__dict__.get("_digest")
        if cached is None:
            doc = {"mode": self.mode, "rules": sorted((r.pattern, r.action) for r in self.rules),
                   "forward": sorted(self.forward), "resolver": list(self.resolver) if self.resolver else None}
            cached = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
            object.__setattr__(self, "_digest", cached)
        return cached

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "rules": [r.to_json() for r in self.rules],
            "forward": list(self.forward),
            "resolver": f"{_target(*self.resolver)}" if self.resolver else None,
            "presets": {k: list(v) for k, v in self.presets},
            "digest": self.digest,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NetPolicy:
        res = d.get("resolver")
        return cls(
            mode=str(d["mode"]),
            rules=tuple(HostRule.from_json(r) for r in d.get("rules", ())),
            forward=tuple(int(p) for p in d.get("forward", ())),
            resolver=parse_resolver(res) if res else None,
            presets=tuple((k, tuple(v)) for k, v in dict(d.get("presets") or {}).items()),
        )

    def explain_lines(self) -> list[str]:
        """The network plan, for `stockade explain` and `policy show`."""
        proxy, dns = PROXY_PORT, DNS_PORT
        out: list[str] = []
        if self.mode == "host":
            out.append("network: host (the host's network namespace; no rules apply)")
            return out
        if self.mode == "allow":
            out.append(f"network: allow: only through the proxy at 127.0.0.1:{proxy} and [::1]:{proxy} "
                       f"(HTTP CONNECT, plain HTTP, SOCKS5), DNS at 127.0.0.1:{dns}")
            via = f"{_target(*self.resolver)}" if self.resolver else "the host's resolver"
            out.append(f"  names resolve through {via}; names no rule allows get NXDOMAIN (never asked upstream)")
            if not self.allows:
                out.append("  no allow rule: every connection is refused")
            for r in sorted(self.rules, key=lambda r: (r.action != "deny", r.pattern)):
                pre = f" (preset {r.preset})" if r.preset else ""
                out.append(f"  {r.action:<5} {r.pattern:<32} {r.tier} {r.where()}{pre}".rstrip())
            out.append("  refused unless a rule names the address: loopback, private, shared (CGNAT), link-local, "
                       "multicast, cloud metadata, unspecified and reserved ranges")
        else:
            out.append("network: none (own network namespace, only lo)")
        for p in self.forward:
            out.append(f"  forward 127.0.0.1:{p} and [::1]:{p} inside -> the host's localhost:{p}")
        return out


# --------------------------------------------------------------------------- building from tiers


def expand(raw: str, presets: Mapping[str, Sequence[str]]) -> list[tuple[str, str | None]]:
    """``raw`` as (pattern, preset) pairs: a ``@name`` becomes its preset's patterns.
    PatternError for a malformed pattern or an unknown preset."""
    text = raw.strip()
    if text.startswith("@"):
        name = text[1:].lower()
        if name not in presets:
            known = ", ".join("@" + k for k in sorted(presets))
            raise PatternError(f"unknown preset {text!r}; known presets: {known}")
        return [(p, name) for p in presets[name]]
    parse_pattern(text)
    return [(text, None)]


def check_raw(raw: str) -> None:
    """Check a pattern as written (a ``@name`` only for its form: presets are known
    once every tier is read)."""
    text = raw.strip() if isinstance(raw, str) else raw
    if isinstance(text, str) and text.startswith("@"):
        if not _PRESET_RE.match(text[1:].lower()):
            raise PatternError(f"{raw!r} is not a preset name (@ then letters, digits, '-', '_')")
        return
    parse_pattern(text)


def check_preset_name(name: str) -> None:
    if not _PRESET_RE.match(name):
        raise PatternError(f"preset name {name!r}: letters, digits, '-' and '_' only")


def env_resolver(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """``STOCKADE_NET_RESOLVER`` (read when asked, per run); PolicyError when malformed."""
    raw = (os.environ if environ is None else environ).get("STOCKADE_NET_RESOLVER")
    if not raw:
        return None
    try:
        return parse_resolver(raw, "STOCKADE_NET_RESOLVER")
    except PatternError as e:
        raise PolicyError(str(e)) from None


# --------------------------------------------------------------------------- the session's rules, live


def session_host_rules(data: Mapping[str, Any], file: str, presets: Mapping[str, Sequence[str]],
                       lines: Mapping[int, int | None] | None = None) -> list[HostRule]:
    """The ``hosts`` list of a session's policy.json as rules of the session tier."""
    out: list[HostRule] = []
    for i, ent in enumerate(data.get("hosts", []) or []):
        line = lines.get(i) if lines else None
        try:
            pairs = expand(str(ent["host"]), presets)
        except PatternError as e:
            where = f"{file}:{line}" if line else file
            raise PolicyError(f"{where}: hosts[{i}].host: {e}") from None
        for pat, preset in pairs:
            out.append(HostRule(pat, str(ent["action"]), "session", file, preset, line))
    return out


class LiveNetPolicy:
    """What the proxy asks, per connection: the run's policy with the session's host
    rules as they are now (``stockade allow --host`` during a run takes effect at the next
    connection). One stat of the session's policy file per call; re-read when it changed."""

    def __init__(self, base: NetPolicy, session_dir: Path | None) -> None:
        self.base = base
        self.path = None if session_dir is None else os.path.join(session_dir, "policy.json")
        self.error: str | None = None  # the last re-read that failed (the previous rules stay)
        self._lock = threading.Lock()
        self._state: tuple[object, NetPolicy] = (object(), base)  # (file signature, policy)
        if self.path is not None:
            self.current()

    @staticmethod
    def _sig(path: str) -> object:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            return ("error", e.errno)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def current(self) -> NetPolicy:
        if self.path is None:
            return self.base
        sig = self._sig(self.path)
        state = self._state
        if state[0] == sig:
            return state[1]
        with self._lock:
            state = self._state
            if state[0] == sig:
                return state[1]
            policy = self._reload(sig, state[1])
            self._state = (sig, policy)
            return policy

    def _reload(self, sig: object, previous: NetPolicy) -> NetPolicy:
        assert self.path is not None
        if sig is None:
            self.error = None
            return self.base.with_session_rules(())
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise PolicyError(f"{self.path}: expected a JSON object")
            hosts = data.get("hosts", [])
            if not isinstance(hosts, list) or not all(isinstance(h, dict) and "host" in h and "action" in h for h in hosts):
                raise PolicyError(f"{self.path}: hosts: expected an array of {{host, action}} tables")
            rules = session_host_rules(data, self.path, self.base.preset_table())
        except (OSError, ValueError, PolicyError) as e:
            # a file that cannot be read keeps the rules in force (a run's next start reports it)
            self.error = f"{self.path}: {e}"
            return previous
        self.error = None
        return self.base.with_session_rules(rules)
