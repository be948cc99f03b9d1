"""The sandbox's filesystem view of the host outside the project: which system
directories, /etc entries, /proc entries and devices it gets, and where it reaches
the proxy of ``--net allow``. Plain data read by the
plan (which mounts them) and by the policy (which explains them in ``why`` and refuses
denies it could not honour); a module of its own so neither imports the other."""

from __future__ import annotations

import functools
import os
import stat

# --net allow: where the sandbox reaches the host-side proxy (net/), read by the plan
# (env, resolv.conf, Landlock ports) and by the policy (forwarding these is refused)
PROXY_PORT = 3128  # HTTP (CONNECT and absolute-URI) and SOCKS5 on one port
DNS_PORT = 53
CONNECT_PATH = "/run/stockade/connect"  # SOCKS5 connector for ssh's ProxyCommand and git's GIT_PROXY_COMMAND
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
SOCKS_URL = f"socks5h://127.0.0.1:{PROXY_PORT}"

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# /etc is hidden except these. Files are copied into the sandbox's /etc (cheaper
# than a bind each), symlinks reproduced, directories bound read-only.
ETC_ALLOW = (
    "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "host.conf", "gai.conf",
    "os-release", "debian_version", "lsb-release", "localtime", "timezone", "mime.types",
    "protocols", "services", "shells", "inputrc", "bash.bashrc", "profile", "profile.d",
    "ssl", "ca-certificates", "ca-certificates.conf", "alternatives", "gitconfig",
    "python3", "python3.11", "python3.12", "perl", "xdg", "magic", "mailcap",
    "hosts",  # read for its localhost lines only (hosts_file); never copied whole
)

PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
PROC_MASKED = (
    "kcore", "keys", "key-users", "latency_stats", "timer_list", "timer_stats",
    "sched_debug", "kallsyms", "kmsg", "kpagecount", "kpageflags", "kpagecgroup",
    "config.gz", "vmallocinfo", "slabinfo", "pagetypeinfo",
)
PROC_MASKED_DIRS = ("acpi", "scsi", "asound", "driver", "dynamic_debug")

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


@functools.lru_cache(maxsize=1)
def system_layout() -> tuple[tuple[str, str | None], ...]:
    """The system dirs this host has: (path, symlink target or None for a directory)."""
    out: list[tuple[str, str | None]] = []
    for d in SYSTEM_DIRS:
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            out.append((d, os.readlink(d)))
        elif stat.S_ISDIR(st.st_mode):
            out.append((d, None))
    return tuple(out)
