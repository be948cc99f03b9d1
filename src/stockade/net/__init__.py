"""The network of ``--net allow`` and forwarded host ports.

The host-side proxy (``proxy``) holds listening sockets that live in the sandbox's own
network namespace (``netns`` makes them there): a process inside reaches
``127.0.0.1:PROXY_PORT`` and the DNS responder on ``127.0.0.1:DNS_PORT``; nothing of the
host is reachable from inside but through them.
"""

from __future__ import annotations

from ..sandbox_fs import CONNECT_PATH, DNS_PORT, PROXY_PORT, PROXY_URL, SOCKS_URL

__all__ = ["CONNECT_PATH", "DNS_PORT", "PROXY_PORT", "PROXY_URL", "SOCKS_URL"]
