"""The network of ``--net allow`` and forwarded host ports.

The host-side proxy (``proxy``) holds listening sockets that live in the sandbox's own
network namespace (``netns`` makes them there): a process inside reaches
``127.0.0.1:PROXY_PORT`` and the DNS responder on ``127.0.0.1:DNS_PORT``; nothing of the
host is reachable from inside but through them.
"""

from __future__ import annotations

PROXY_PORT = 3128  # HTTP (CONNECT and absolute-URI) and SOCKS5 on one port
DNS_PORT = 53
CONNECT_PATH = "/run/stockade/connect"  # SOCKS5 connector for ssh's ProxyCommand and git's GIT_PROXY_COMMAND
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
SOCKS_URL = f"socks5h://127.0.0.1:{PROXY_PORT}"
