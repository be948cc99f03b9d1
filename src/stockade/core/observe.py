"""Observe mode in the run path: the listener's socket and thread for one run, and its
records written to the session's audit log when the run ends (``observed.py`` says
what each means)."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    from ..linux.seccomp.observe import Observer
    from ..session import store
    from .prepare import Prepared

RECORDS = "observed.bin"  # a run's raw records (runs/N/), decoded into the audit log at its end


def check(observe: bool, seccomp: str, *, origin: str = "--observe") -> None:
    """Bad input, before anything is made: observe mode stacks its filter on the
    policy's seccomp filter, so it needs one."""
    if not observe:
        return
    if seccomp == "off":
        fix = "drop --seccomp off, or run without --observe" if origin == "--observe" else \
            "drop --seccomp off, or pass --no-observe"
        raise UsageError(f"{origin} needs seccomp (observe mode stacks its own filter on the policy's); {fix}")
    from ..linux.seccomp.observe import supported

    why = supported()
    if why is not None:
        raise UsageError(f"{origin}: {why}")


class RunObserve:
    """One run's observe mode: the socket init sends the listener over (its end goes to
    the sandbox), the thread that answers the notifications, the records it writes."""

    def __init__(self, run_dir: str, project: str) -> None:
        from ..linux.seccomp.observe import Observer, observe_bpf

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.child_fd = theirs.detach()  # closed once the sandbox has it (Launch.handed_over)
        self.bpf = observe_bpf()
        self.path = os.path.join(run_dir, RECORDS)
        self.observer: Observer = Observer(ours, self.path, project)

    def start(self) -> None:
        self.observer.start()

    def finish(self, sess: store.Session, run_no: int, prep: Prepared) -> dict[str, Any]:
        """Wait for the thread (it ends with the sandbox), decode its records into the
        session's audit log; the run's summary of them."""
        from .. import observed
        from ..audit import AuditLog
        from ..linux.seccomp import observe as kobs

        st = self.observer.stop()
        records = kobs.read_records(self.path)
        summary: dict[str, Any] = {"notified": st.notified, "logged": st.logged, "inside_project": st.skipped,
                                   "stale": st.stale, "unreadable": st.unreadable, "lost": st.lost}
        if st.error:
            summary["error"] = os.strerror(st.error)
        if not self.observer.got_listener:
            summary["error"] = "the sandbox sent no listener (it ended before its command started)"
        try:
            ctx = context(prep)
            events = observed.classify(records, ctx)
        except Exception as e:  # never lose the run's outcome to its log
            summary["error"] = f"classify: {e}"
            events = []
        kept, left = observed.capped(events)
        summary["events"] = len(events)
        summary["blocked"] = sum(1 for e in events if e["result"] == "blocked")
        log = AuditLog(sess, batch=True)
        try:
            for e in kept:
                e = dict(e)
                log.event(e.pop("operation"), e.pop("target"), e.pop("result"), run=run_no, policy=e.pop("policy"),
                          reason=e.pop("reason"), **e)
            if left:
                log.event(observed.SUPPRESSED, f"run {run_no}", "info", run=run_no, policy="observe",
                          reason=f"more than {observed.MAX_EVENTS} distinct observed entries: the rest counted",
                          counts=left)
            log.event(observed.SUMMARY, f"run {run_no}", "info", run=run_no, policy="observe",
                      reason="what observe mode saw (results predicted from the plan)", **summary)
            log.flush()
        except OSError:
            pass  # the audit log never breaks a run
        return summary


def context(prep: Prepared) -> Any:
    """The plan's facts that predict each observed call's result."""
    from .. import observed
    from ..linux.seccomp import observe as kobs
    from ..plan import LL_NET_CONNECT_TCP

    plan = prep.plan
    pol: Any = prep.audit.policy
    why = getattr(pol, "why", None)
    if why is None:  # a cached preparation's policy facts: the merged policy again
        from .. import policy as polmod

        from pathlib import Path

        why = polmod.load(Path(plan.project), None).why
    ll = plan.landlock
    ports: tuple[int, ...] | None = None
    if ll is not None and ll.abi >= 4 and ll.handled_net & LL_NET_CONNECT_TCP:
        ports = tuple(ll.connect_ports)
    return observed.Context(
        project=plan.project, home=plan.home, network=plan.network, tcp_connect_ports=ports, why=why,
        kinds={"exec": kobs.KIND_EXEC, "open": kobs.KIND_OPEN, "connect": kobs.KIND_CONNECT,
               "sendto": kobs.KIND_SENDTO, "sendmsg": kobs.KIND_SENDMSG},
        unreadable_flag=kobs.F_UNREADABLE, relative_flag=kobs.F_RELATIVE, sockaddr=kobs.sockaddr)
