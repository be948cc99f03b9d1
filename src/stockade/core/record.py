"""Record one run: its run.json, its audit events, and the RunResult the caller gets."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from ..audit import AuditLog
from ..launch import lower
from ..redact import record_argv
from ..session import store
from .result import RunResult

if TYPE_CHECKING:
    from ..cgroups.base import CgroupStats
    from ..net.run import NetSummary
    from .launch import Launch
    from .prepare import Prepared
    from .request import RunIO
    from .supervise import Supervisor


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class RunRecord:
    """``<session>/runs/<n>/run.json`` and the session's audit events of one run."""

    def __init__(self, sess: store.Session, prep: Prepared, quiet: bool) -> None:
        plan = prep.plan
        self.sess = sess
        self.prep = prep
        self.run_no, run_path = sess.new_run_dir()
        self.run_dir = str(run_path)
        self.started = time.time()
        self.data: dict[str, Any] = {
            "run": self.run_no,
            "argv": record_argv(plan.argv),  # redacted here, once: status, log and export read this record
            "cwd": plan.cwd,
            "started": _utc(self.started),
            "status": "running",
            "degraded": list(plan.degraded),
            "seccomp": plan.seccomp_name,
            "landlock_abi": plan.landlock.abi if plan.landlock else 0,
        }
        self._audit_start(quiet)

    def _audit_start(self, quiet: bool) -> None:
        """The run's first events (and the session's, for its first run); the audit log
        never breaks a run. ``quiet``: no policy warnings on stderr."""
        sess, plan, info = self.sess, self.prep.plan, self.prep.audit
        pol = info.policy
        log = AuditLog(sess, batch=True)
        try:
            try:
                fresh = os.stat(sess.events_path).st_size == 0  # a session made ahead has it, empty
            except FileNotFoundError:
                fresh = True
            if fresh:
                log.session_start(pol, project=info.project)
            log.run_start(self.run_no, list(plan.argv), plan.cwd, pol)
            if info.masked:
                log.masked(self.run_no, info.masked, relative_to=info.project)
            if info.removed:
                log.env_removed(self.run_no, info.removed)
            if info.read_only:
                log.read_only(self.run_no, info.project)
            log.plan_denials(self.run_no, plan)
            log.flush()
        except OSError:
            pass
        if not quiet:
            for w in pol.warnings:
                sys.stderr.write(f"stockade: warning: {w}\n")
            if plan.env_warnings:
                sys.stderr.write("stockade: warning: " + "; ".join(plan.env_warnings) + "\n")
            if self.prep.limits.disk is None and not plan.read_only:
                sys.stderr.write("stockade: warning: --disk none: nothing caps what the sandbox writes; it can fill "
                                 "the state dir's filesystem, and the host's RAM through /tmp and /dev/shm\n")

    def _ended(self) -> None:
        ended = time.time()
        self.data["ended"] = _utc(ended)
        self.data["duration"] = round(ended - self.started, 4)

    def setup_failed(self, sup: Supervisor, launch: Launch) -> BaseException:
        """The sandbox failed before the command ran: recorded; the error to raise."""
        assert sup.error is not None
        self._ended()
        child, place = launch.child, launch.place
        ops = child.mounts if child is not None else self.prep.plan.mounts
        err = lower.report_error(sup.error, ops, cgroup_paths=place.join_paths if place else ())
        self.data["status"] = "setup-failed"
        self.data["error"] = str(err)
        store.write_json_new(self.run_dir + "/run.json", self.data)
        return err

    def done(self, sup: Supervisor, stats: CgroupStats | None, io: RunIO, raise_timeout: bool,
             net: NetSummary | None = None, observed: dict[str, Any] | None = None) -> RunResult:
        """The command ran: its outcome recorded, the caller's RunResult (or subprocess's
        TimeoutExpired / CalledProcessError, when asked for)."""
        from ..cgroups import base as cgbase

        self._ended()
        plan, prep = self.prep.plan, self.prep
        returncode = sup.returncode
        o = cgbase.classify(returncode, timed_out=sup.timed_out, stats=stats, limits=prep.limits,
                            unenforced=prep.audit.unenforced, disk_hit=sup.disk_hit, disk_full=sup.disk_full)
        rec = self.data
        rec.update({"outcome": o.summary(), "outcome_kind": o.kind, "peak_memory": o.peak_memory,
                    "cpu_time": o.cpu_time, "exit_code": o.exit_status})
        rec["status"] = "done"
        rec["exit_status"] = returncode if returncode >= 0 else 128 - returncode
        if sup.log_truncated:
            rec["log_truncated_bytes"] = sup.log_truncated  # past STOCKADE_LOG_MAX per stream
        if sup.log_disk_full:
            rec["log_disk_full"] = True  # the kept log was cut short by a full state-dir disk
        if sup.disk is not None:
            rec["disk"] = {"limit": prep.limits.disk, "floor": prep.limits.disk_floor, "peak": sup.disk.peak,
                           "hit": sup.disk_hit, "full": list(sup.disk.full)}
        if sup.reader_gone:
            rec["reader_gone"] = sup.reader_gone  # the caller's reader left; the command got EPIPE/SIGPIPE
        if sup.exec_failed is not None:
            rec["exec_failed"] = {"path": sup.exec_failed.path, "errno": sup.exec_failed.err}
        if net is not None:
            rec["network"] = net.to_json()
        if observed is not None:
            rec["observed"] = observed  # observe mode: what it saw (the events are in the audit log)
        store.write_json_new(self.run_dir + "/run.json", rec)
        try:
            AuditLog(self.sess).outcome(self.run_no, o.kind, outcome=o.summary(), exit_status=rec["exit_status"],
                                        degraded=list(plan.degraded) or None, seccomp=plan.seccomp_name,
                                        landlock_abi=rec["landlock_abi"],
                                        **({"network": net.to_json()} if net is not None else {}))
        except OSError:
            pass  # the audit log never breaks a run

        argv = list(plan.argv)
        out, err = io.decoded(bytes(sup.out_buf) if sup.capture_out else None,
                              bytes(sup.err_buf) if sup.capture_err else None)
        res = RunResult(argv, returncode, out, err, session=self.sess.id, run=self.run_no, outcome=o.summary(),
                     outcome_kind=o.kind, peak_memory=o.peak_memory, cpu_time=o.cpu_time, degraded=plan.degraded,
                     exec_failed=sup.exec_failed, cg_manager=prep.cg_manager,
                     network=net.summary_line() if net is not None else None,
                     disk=o.disk or sup.disk_full)
        if sup.timed_out and raise_timeout and prep.timeout is not None:
            # subprocess.run compatibility; the result rides along for callers that want the outcome
            import subprocess

            exc = subprocess.TimeoutExpired(argv, prep.timeout, out, err)
            exc.result = res  # type: ignore[attr-defined]
            raise exc
        if io.check and returncode != 0:
            import subprocess

            raise subprocess.CalledProcessError(returncode, argv, out, err)
        return res
