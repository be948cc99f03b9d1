"""Hosts and ports as a client inside the sandbox names them: parsing ``host:port``
targets, telling names from IP literals, and the one spelling the proxy reports and
hands to the policy (lower-case name without trailing dot, or a compressed IP)."""

from __future__ import annotations

import ipaddress
import re

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# a DNS name as the policy and getaddrinfo may see it: letters, digits, '-' and '_'
# (SRV-style labels), 1-63 bytes a label, 253 in all; nothing else reaches a resolver
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")


def ip_literal(host: str) -> IPAddress | None:
    """``host`` as an address when it is an IPv4 or IPv6 literal (no brackets, no zone);
    IPv4-mapped IPv6 as its IPv4 address (what the kernel dials)."""
    if "%" in host:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def normalize_host(host: str) -> str | None:
    """The canonical spelling of ``host`` (a DNS name or an IP literal), or None when
    it is neither: upper case folded, one trailing dot dropped, IPs compressed."""
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        ip = ip_literal(inner)
        return ip.compressed if ip is not None and ":" in inner else None
    ip = ip_literal(host)
    if ip is not None:
        return ip.compressed
    if not host.isascii():
        return None
    name = host.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > 253:
        return None
    labels = name.split(".")
    if not all(_LABEL.match(label) for label in labels):
        return None
    # all-numeric dotted names are IPv4 spellings getaddrinfo would accept (010.1, 0x7f.1):
    # an address in disguise, not a name
    if all(label.isdigit() or label.startswith("0x") for label in labels):
        return None
    return name


def parse_port(text: str) -> int | None:
    """A TCP port 1-65535 written in decimal, or None."""
    if not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def split_hostport(target: str, default_port: int | None = None) -> tuple[str, int] | None:
    """``host:port``, ``[v6]:port`` (or, with a default port, ``host``, ``[v6]``) as the
    canonical host and the port; None when malformed."""
    if target.startswith("["):
        end = target.find("]")
        if end < 0:
            return None
        host, rest = target[: end + 1], target[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    elif target.count(":") == 1:
        host, port_text = target.split(":")
    elif ":" in target:
        return None  # a bare IPv6 literal with a port is ambiguous: brackets are required
    else:
        host, port_text = target, None
    if port_text is None:
        if default_port is None:
            return None
        port: int | None = default_port
    else:
        port = parse_port(port_text)
    canon = normalize_host(host)
    if port is None or canon is None:
        return None
    return canon, port


def format_target(host: str, port: int) -> str:
    """``host:port`` with IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
