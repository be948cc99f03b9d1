"""How a run starts: the one choice between a pre-spawned launcher
(launch/launcher.py) and a cold start (cloning this process, linux/native.py).

Both take the same lowered plan and run (launch/lower.py) and come back past the
id-map stage: the caller releases the child only into ``Stage.ATTACHED``, and
only when it asked to hold it there (``hold_before_exec``)."""

from __future__ import annotations

from ..linux import native
from ..plan import Plan
from . import launcher
from .lower import LoweredPlan, LoweredRun, RunChild, spawn


def start(
    plan: Plan,
    stdio: tuple[int, int, int],
    cgroup_fd: int | None,
    *,
    pty: bool = False,
    console_sock: int = -1,
    hold_before_exec: bool = False,
    hold_fd: int = -1,
    join_fds: tuple[int, ...] = (),
    serve_fd: int = -1,
    observe_sock: int = -1,
    observe_bpf: bytes = b"",
) -> RunChild:
    """Start a sandbox for the plan: through a launcher when possible, else cold.
    ``hold_fd``: the session's overlay lock (``Session.lock``; a cold start's overlay
    is gone once its init is reaped). ``join_fds``: cgroup v1 ``tasks`` files the
    sandbox's init enters first (``RunCgroup.placement``). ``hold_before_exec``: the
    child waits for ``native.release(child, Stage.ATTACHED)`` before the command.
    ``serve_fd``: a living sandbox: its init serves exec requests on this socket
    (``stockade.live``) instead of running the plan's command. ``observe_sock``,
    ``observe_bpf``: observe mode (core/observe.py): init installs the filter after the
    policy's and sends its listener over the socket."""
    if launcher.enabled() and (observe_sock < 0 or not _yama_needs_ancestor()):
        served = launcher.start(plan, stdio, cgroup_fd, pty=pty, console_sock=console_sock,
                                hold_before_exec=hold_before_exec, hold_fd=hold_fd, join_fds=join_fds,
                                serve_fd=serve_fd, observe_sock=observe_sock, observe_bpf=observe_bpf)
        if served is not None:
            return served
    if hold_fd >= 0:
        # an earlier run's overlay on this session may not be unmounted yet
        import fcntl

        fcntl.flock(hold_fd, fcntl.LOCK_EX)
    low = LoweredPlan(plan, plan.mounts)
    LoweredRun(plan, plan.mounts, stdio, -1 if cgroup_fd is None else cgroup_fd, pty=pty, console_sock=console_sock,
               join_fds=join_fds, hold_before_exec=hold_before_exec, serve_fd=serve_fd, observe_sock=observe_sock,
               observe_bpf=observe_bpf).apply(low)
    if plan.keep_fds:
        from ..callerfds import sources

        src = sources(plan.keep_fds)  # a server's supervisor: its client's fds, not its own numbers
        if src is not None:
            low.plan.keep_src = low.new("int[]", list(src))
    child = spawn(plan, low, RunChild)
    child.mounts = plan.mounts
    # False: it died already; its report pipe says why (the supervisor reads it)
    native.release(child, native.Stage.IDMAP)
    return child


def _yama_needs_ancestor() -> bool:
    """Observe mode reads the sandbox's memory (process_vm_readv: ptrace access). Under
    Yama's ptrace_scope 1 an unprivileged reader must be an ancestor of the process it
    reads, and a shared launcher (or one a CLI server started) is not this process's
    descendant: such a run starts cold, from this process."""
    import os

    if os.geteuid() == 0:
        return False  # CAP_SYS_PTRACE passes Yama
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or "0") >= 1
    except (OSError, ValueError):
        return False
