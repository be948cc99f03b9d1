"""Observe mode in the run path: the listener's socket and thread for one run, and its
records written to the session's audit log when the run ends (``observed.py`` says
what each means)."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import TYPE_CHECKING, Any

from ..audit import AuditLog
from ..errors import StockadeError

if TYPE_CHECKING:
    from ..linux.audit_netlink import Subscription
    from ..linux.seccomp.observe import Observer
    from ..observed import Decided, RawLayout
    from ..session import store
    from .prepare import Prepared

LIVE_REFUSED = ("observe mode is not available for living sandboxes (its filter is installed when a sandbox starts, "
                "for one command tree): observe a command with `stockade run --observe -- CMD`")


class RunObserve:
    """One run's observe mode: the socket init sends the listener over (its end goes to
    the sandbox), the thread that answers the notifications (C's, no GIL), the records
    hands over in memory, classified as they arrive (``observed.Classifier``) by the
    supervisor's own loop (``pump``, on its timer: no thread of ours waits for the GIL,
    and the records' thread wakes nobody), so the run's end only adds the last ones to
    the audit log."""

    def __init__(self, prep: Prepared, sess: store.Session, run_no: int) -> None:
        from ..linux.seccomp.observe import Observer, observe_bpf

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.child_fd = theirs.detach()  # closed once the sandbox has it (Launch.handed_over)
        self.bpf = observe_bpf()
        self.prep = prep
        project = prep.plan.project
        masked = tuple(str(m.path) for m in prep.audit.masked if observed_under(str(m.path), project))
        self.observer: Observer = Observer(ours, project, masked)
        self.classifier: Any = None
        self.run_no = run_no
        self._log = AuditLog(sess)
        # each event's audit line, made while the command runs, remade each time its
        # event changes (the run's end then takes them as they are): id(aggregate) -> line
        self._lines: dict[int, bytes] = {}
        self._lines_current = True  # False: some changed past the cap, not remade
        self._sess = sess
        self._marked = False
        self.error: str | None = None
        self._ended = False
        # Landlock's own denial records (kernel audit): subscribed before the sandbox
        # exists, as the stream is never replayed; else why not
        self.ll_audit: Subscription | str = "Landlock is off for this run"
        self.init_pid: int | None = None
        self._ll: tuple[list[dict[str, Any]], str] | None = None
        ll = prep.plan.landlock
        if ll is not None and ll.restrict_flags:
            from ..linux.audit_netlink import Subscription

            self.ll_audit = Subscription.open(ll.abi)
        elif ll is not None:
            self.ll_audit = f"Landlock ABI {ll.abi}: denial records need ABI 7 (Linux 6.15+)"

    def start(self, init_pidfd: int = -1, init_pid: int = -1) -> None:
        """The sandbox started (its init: ``init_pidfd``, ``init_pid`` as its starter
        names it): the thread that answers starts."""
        from .. import observed

        if not isinstance(self.ll_audit, str):
            from ..linux.native import pidfd_pid

            # the pid Landlock's domain record names: the restricting task's, in the
            # initial PID namespace (a launcher's report is its own namespace's)
            pid = pidfd_pid(init_pidfd) if init_pidfd >= 0 else -1
            self.init_pid = pid if pid > 0 else (init_pid if init_pid > 0 else None)
        self.observer.start()  # (first: the command's first call waits for it)
        try:  # before the first records are taken: the loop then only classifies
            self.classifier = observed.Classifier(context(self.prep), decided(self.prep))
        except Exception as e:  # never lose the run to its log
            self.error = f"classify: {e}"

    def pump(self) -> bool:
        """Classify the records handed over since the last call (the supervisor's loop
        calls it on its timer, ``supervise.PUMP_EVERY``; the run's end once more).
        Whether there were any."""
        if not isinstance(self.ll_audit, str):
            self.ll_audit.drain()  # (other processes' records too: the socket's buffer is bounded)
        data = self.observer.take()
        if not self._marked:
            self._mark_session()
        if self.classifier is None or self.error is not None or not data:
            return bool(data)
        try:
            self.classifier.feed_raw(data, _layout())
            self._prerender()
        except Exception as e:  # never lose the run to its log
            self.error = f"classify: {e}"
            self._lines_current = False
        return True

    def _end(self) -> None:
        """The sandbox is gone: the loop ends, its last records are classified."""
        if self._ended:
            return
        self._ended = True
        self.observer.stop()
        self.pump()
        self.observer.close()

    def _mark_session(self) -> None:
        """The session is marked observed: kept after the run even with no change (its
        log is what it ran for). Once, from the first pump while the command runs (the
        run's end, if it never pumped); read again only when its meta.json is not the
        one this process marked (a session's every observed run would read it)."""
        self._marked = True
        path = str(self._sess.meta_path)
        with contextlib.suppress(StockadeError, OSError, ValueError):
            if _MARKED.get(path) == _file_sig(path):
                return
            if not self._sess.meta().get("observed"):
                self._sess.update_meta(observed=True)
            # remembered only as the file read with the mark (another writer's replacement
            # made meanwhile without it is read again, and marked, by the next run)
            sig = _file_sig(path)
            if self._sess.meta().get("observed") and _file_sig(path) == sig:
                if len(_MARKED) >= 1000:
                    _MARKED.clear()
                _MARKED[path] = sig

    def _prerender(self) -> None:
        """Make the lines of the events changed since the last batch (at most the number
        a run writes: a ``find /`` touches tens of thousands)."""
        from .. import observed

        touched = self.classifier.take_touched()
        if len(self._lines) >= observed.MAX_EVENTS:
            self._lines_current = False  # (the run's end makes the lines of those it holds again)
            return
        start = self._log.line_start(self.run_no)  # (one timestamp for the batch)
        if len(touched) > observed.MAX_EVENTS:
            self._lines_current = False
        for a in touched[:observed.MAX_EVENTS]:
            self._lines[id(a)] = self._line(a, start)

    def _line(self, a: Any, start: str | None = None) -> bytes:
        line: bytes = _observed().line_of(a, self._log, self.run_no, start)
        return line

    def finish(self, sess: store.Session, run_no: int) -> dict[str, Any]:
        """Wait for the loop (it ends with the sandbox), write the classified
        records to the session's audit log; the run's summary of them."""
        from .. import observed

        self._end()
        st = self.observer.stats
        summary: dict[str, Any] = {"notified": st.notified, "logged": st.logged, "inside_project": st.skipped,
                                   "stale": st.stale, "unreadable": st.unreadable, "lost": st.lost}
        if st.notified:
            summary.update(wakeup=st.wakeup(), loop=st.loop())
        if st.error:
            summary["error"] = os.strerror(st.error)
        if not self.observer.got_listener:
            summary["error"] = "the sandbox sent no listener (it ended before its command started)"
        if self.classifier is not None and self.classifier.failed:
            summary["unclassified"] = self.classifier.failed  # (records skipped: the first one's error)
            summary["error"] = f"classify: {self.classifier.first_error}"
        if self.error:
            summary["error"] = self.error
        done = self.classifier is not None
        kept, left = self.classifier.written() if done else ([], {})
        kernel, summary["landlock_audit"] = self._landlock()
        end = "" if isinstance(self.ll_audit, str) else self.ll_audit.end
        if end and end != "off":
            summary["landlock_audit_end"] = end
        if len(kernel) > observed.MAX_EVENTS:  # (the kernel's records: a cap of their own)
            left[f"{observed.LANDLOCK_DENIAL} blocked"] = len(kernel) - observed.MAX_EVENTS
            kernel = kernel[:observed.MAX_EVENTS]
        summary["events"] = len(kept) + len(kernel) + sum(left.values())
        summary["blocked"] = (self.classifier.blocked() if done else 0) + len(kernel)
        summary["landlock_denials"] = len(kernel)
        if not self._marked:
            self._mark_session()
        log = AuditLog(sess, batch=True)
        try:
            for e in kernel:
                e = dict(e)
                log.event(e.pop("operation"), e.pop("target"), e.pop("result"), run=run_no, **e)
            start = log.line_start(run_no)
            lines, current = self._lines, self._lines_current
            log.add(b"".join([(lines.get(id(a)) if current else None) or self._line(a, start) for a in kept]))
            if left:
                log.event(observed.SUPPRESSED, f"run {run_no}", "info", run=run_no, policy="observe",
                          reason=f"more than {observed.MAX_EVENTS} distinct observed entries: the rest counted",
                          counts=left)
            log.event(observed.SUMMARY, f"run {run_no}", "info", run=run_no, policy="observe",
                      reason="what observe mode saw (results predicted from the plan"
                             + ("; Landlock's denials from its kernel audit records)" if summary["landlock_audit"] == "on"
                                else ")"), **summary)
            log.flush()
        except OSError:
            pass  # the audit log never breaks a run
        return summary

    def _landlock(self) -> tuple[list[dict[str, Any]], str]:
        """Our sandbox's Landlock denials as events (``observed.landlock_events``), and
        "on" or why they are not read; the subscription is closed. Once, when the run
        is over (``stop``: the start failed, or the run's teardown; ``finish``)."""
        from .. import observed

        sub = self.ll_audit
        if self._ll is not None:
            return self._ll
        if isinstance(sub, str):
            return [], sub
        self._ll = [], "the run ended before its records were read"
        try:
            if self.init_pid is None:
                self._ll = [], "the sandbox's init pid is unknown (its start failed)"
                return self._ll
            # kauditd hands records over asynchronously: wait for them only when a
            # Landlock denial is likely (its TCP rules predicted one; one of ours came)
            aggs = self.classifier.aggs.values() if self.classifier is not None else ()
            expect = any(a.policy == "landlock-net" and a.result == "blocked" for a in aggs)
            why = sub.refusal()
            if why is not None:
                self._ll = [], why
                return self._ll
            denials = sub.denials(self.init_pid, expect=expect)
            note = "on" if not (sub.lost or sub.dropped) else (
                f"on (records lost: {sub.lost} overruns, {sub.dropped} over the cap of the run's subscription)")
            self._ll = observed.landlock_events(denials), note
        except Exception as e:  # never lose the run to its log
            self._ll = [], f"reading the kernel audit records failed: {e}"
        finally:
            sub.close()
        return self._ll

    def stop(self) -> None:
        """The run is over (or failed to start): end both threads."""
        self._end()
        self._landlock()  # the sandbox is gone: its last records are on their way


# meta.json files this process marked observed -> their (inode, mtime, size) then: a
# rewrite (write_json_atomic replaces the file) or another session of the name reads it again
_MARKED: dict[str, tuple[int, int, int]] = {}


def _file_sig(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


_OBSERVED: Any = None


def _observed() -> Any:
    """``stockade.observed``, imported with the first observed run (not with every CLI call)."""
    global _OBSERVED
    if _OBSERVED is None:
        from .. import observed

        _OBSERVED = observed
    return _OBSERVED


_LAYOUT: RawLayout | None = None


def _layout() -> RawLayout:
    """``observed.RawLayout`` of the records csrc/observe.c hands over."""
    global _LAYOUT
    if _LAYOUT is None:
        from ..linux.seccomp import observe as kobs
        from ..observed import RawLayout

        _LAYOUT = RawLayout(kobs.REC, kobs.syscall_name, kobs.Record)
    return _LAYOUT


def observed_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# The policy's decisions of the last policy observed (observed.Decided), and what they
# were made for: its merged rules (a cached policy's copies share them: a policy read
# again is a new object) and the plan's facts they read.
_DECIDED: tuple[tuple[object, ...], Decided] | None = None


def decided(prep: Prepared) -> Decided:
    """``observed.Decided`` for this run's policy: the last one's when the policy is the
    same (its merged rules the very object, the project and home the same), else new."""
    from .. import observed

    global _DECIDED
    eff: Any = prep.audit.policy
    rules = getattr(eff, "paths", None)
    if rules is None:  # (a cached preparation's policy facts: context() reads the policy again)
        return observed.Decided()
    key = (rules, prep.plan.project, prep.plan.home, getattr(eff, "home", None))
    memo = _DECIDED
    if memo is not None and memo[0][0] is rules and memo[0][1:] == key[1:]:
        return memo[1]
    made = observed.Decided()
    _DECIDED = (key, made)
    return made


def context(prep: Prepared) -> Any:
    """The plan's facts that predict each observed call's result."""
    from .. import observed
    from ..linux.seccomp import observe as kobs
    from ..plan import LL_EXECUTE, LL_NET_CONNECT_TCP
    from ..policy.view import ETC_MADE
    from ..sandbox_fs import SYSTEM_DIRS

    plan = prep.plan
    eff: Any = prep.audit.policy
    if not hasattr(eff, "why"):  # a cached preparation's policy facts: the merged policy again
        from pathlib import Path

        from .. import policy as polmod

        eff = polmod.load(Path(plan.project), None)
    trees = [plan.project, *(str(g.host_path) for g in eff.grants), *(d.path for d in eff.paths.denies)]

    def why(p: str) -> Any:
        return eff.why(p, resolved=True)

    def uniform(d: str) -> bool:
        """Beneath a system directory, with no project, grant or deny at or below d."""
        if not any(observed.is_under(d, s) for s in SYSTEM_DIRS):
            return False
        return not any(observed.is_under(t, d) or observed.is_under(d, t) for t in trees)

    ll = plan.landlock
    ports: tuple[int, ...] | None = None
    if ll is not None and ll.abi >= 4 and ll.handled_net & LL_NET_CONNECT_TCP:
        ports = tuple(ll.connect_ports)
    execs: tuple[str, ...] | None = None
    if ll is not None and getattr(eff, "exec_allow", None) is not None and ll.handled_fs & LL_EXECUTE:
        # the allowlist as Landlock holds it: the listed paths and what the plan adds (the
        # dynamic loader, the proxy's connect helper), the rules that carry EXECUTE
        execs = tuple(os.path.realpath(p) for p, acc, _opt in ll.rules if acc & LL_EXECUTE)
    return observed.Context(
        project=plan.project, home=plan.home, network=plan.network, tcp_connect_ports=ports, why=why, uniform=uniform,
        grants=tuple(str(g.host_path) for g in eff.grants), own_etc=tuple("/etc/" + n for n in ETC_MADE),
        exec_allow=execs,
        kinds={"exec": kobs.KIND_EXEC, "open": kobs.KIND_OPEN, "connect": kobs.KIND_CONNECT,
               "sendto": kobs.KIND_SENDTO, "sendmsg": kobs.KIND_SENDMSG},
        unreadable_flag=kobs.F_UNREADABLE, relative_flag=kobs.F_RELATIVE, sockaddr=kobs.sockaddr)
