"""The run path, top to bottom: request -> prepare -> launch -> supervise -> record.

Every way a run starts (the Python API, the CLI in-process, a CLI server's
supervisor, ``stockade shell``) calls ``execute`` or ``execute_in``.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import plan as planmod
from ..errors import SessionNotFound, StockadeError, UsageError
from ..session import store
from . import diskwatch
from .diskwatch import DiskWatch
from .launch import Launch
from .prepare import Prepared, prepare
from .record import RunRecord
from .request import RunIO, RunRequest
from .result import RunResult
from .supervise import Forwarding, log_max


def execute(req: RunRequest, io: RunIO) -> RunResult:
    """Run ``req`` in its session (made when new). A session this call made is removed
    again when nothing ran in it (bad input, a sandbox that failed to start)."""
    io.checked()
    project = planmod.resolve_project(req.project)
    fresh = req.session is None
    if not fresh:
        try:
            store.open_session(str(req.session))  # (a bad name is refused here, before anything is made)
        except SessionNotFound:
            fresh = True
    anonymous = req.session is None
    sess = store.open_or_create(project, req.session, anonymous=anonymous)
    res: RunResult | None = None
    refused = False
    try:
        res = _execute(sess, project, req, io)
        return res
    except StockadeError:
        refused = True  # nothing ran, or it failed to start: discard_unused decides
        if fresh:
            discard_unused(sess)
        raise
    finally:
        # bad input or a start that failed leaves the state dir as it was: no collection
        _retain(sess, anonymous and not refused, req.keep_latest_empty, res, collect=not refused)


def execute_in(sess: store.Session, req: RunRequest, io: RunIO) -> RunResult:
    """Run ``req`` in the open session ``sess`` (a Sandbox's)."""
    io.checked()
    try:
        return _execute(sess, planmod.resolve_project(req.project), req, io)
    finally:
        _retain(sess, False, False, None)


def _retain(sess: store.Session, anonymous: bool, keep_latest: bool, res: RunResult | None, *,
            collect: bool = True) -> None:
    """After a run (its session's lock released): an anonymous session that holds no
    change goes (changes/retention.py), and now and then the old sessions are collected."""
    from ..changes import retention

    try:
        if anonymous and retention.after_run(sess.id, keep_latest=keep_latest) and res is not None:
            res.session_removed = True
        if collect:
            retention.maybe_collect()
    except Exception:
        pass


def _execute(sess: store.Session, project: Path, req: RunRequest, io: RunIO) -> RunResult:
    log_max()  # a bad STOCKADE_LOG_MAX is refused before anything starts (the supervisor reads it again)
    with sess.lock(wait=not req.no_wait, for_run=True) as hold_fd:
        # under the lock: snapshots and the mask layer must not change between plan and run
        prep = prepare(sess, project, req, foreign_stdin=not io.piped_stdin and io.inet_stdin())
        if prep.plan.uid_map.ranged():  # before it starts: its layers may get other ids' inodes
            from ..session import idrange

            idrange.record_plan(sess.dir, prep.plan)
        # subprocess.run's TimeoutExpired for the caller's own timeout (not the policy's)
        raise_timeout = req.timeout is not None and not io.forward_signals and prep.timeout == req.timeout
        return _run(sess, prep, io, hold_fd, raise_timeout=raise_timeout,
                    session_ahead=req.session_ahead and req.session is None)


def _run(sess: store.Session, prep: Prepared, io: RunIO, hold_fd: int, *, raise_timeout: bool,
         session_ahead: bool) -> RunResult:
    """Start, supervise and record one run. ``hold_fd``: the session's overlay lock."""
    record = RunRecord(sess, prep, io.quiet)
    launch = Launch(io)
    sup = None
    reaped = False  # init reaped: with its own PID namespace, nothing of the sandbox is left
    try:
        watch = disk_watch(sess, prep)  # (before the start: what the filesystem held before it)
        child = launch.start(sess, record.run_no, prep, hold_fd, session_ahead)
        sup = launch.supervisor(record.run_dir, prep.timeout)
        if io.on_start is not None:
            io.on_start(sup)
        sup.disk = watch
        sup.observe = launch.observe
        if io.forward_signals:
            with Forwarding(child.pidfd, winch_to=sup.out_r if io.pty else None, on_term=sup.terminate):
                sup.loop()
        else:
            sup.loop()
        reaped = sup.init_done
    except BaseException:
        reaped = launch.kill()
        raise
    finally:
        if sup is not None:
            sup.close_logs()
        stats = launch.close(reaped)
    assert sup is not None  # made, or the try above raised
    if sup.error is not None:
        raise record.setup_failed(sup, launch)
    observed = launch.observe.finish(sess, record.run_no) if launch.observe is not None else None
    return record.done(sup, stats, io, raise_timeout, net=launch.net_summary, observed=observed)


def disk_watch(sess: store.Session, prep: Prepared) -> DiskWatch | None:
    """The run's disk watchdog (``core/diskwatch.py``): its limits, tmpfs and layers."""
    plan, lim = prep.plan, prep.limits
    upper = None if plan.read_only else str(sess.upper)
    layers = [str(p) for p in sess.layers()] if upper is not None else []
    return diskwatch.for_run(lim.disk, lim.disk_floor, plan.writable_tmpfs, upper, layers)


def explain_plan(req: RunRequest) -> Prepared:
    """The Plan a run would execute, with its limits (``stockade explain``); creates nothing."""
    project = planmod.resolve_project(req.project)
    if req.session:
        store.validate_name(req.session)
        try:
            sess = store.open_session(req.session)
        except UsageError:
            sess = store.Session(req.session, store.sessions_dir() / req.session)
    else:
        sess = store.Session("(new)", store.sessions_dir() / "(new)")
    return prepare(sess, project, req, explain_only=True)


def discard_unused(sess: store.Session) -> None:
    """Bad input (or a sandbox that failed to start) leaves nothing behind: the session
    this call made is removed when no command ran in it. Every check that refuses a run
    happens after the session exists (the plan needs its layers), so this is the one
    place that undoes it, for every caller (API, in-process and served CLI, shell)."""
    import shutil

    from ..audit import read_events

    try:
        with sess.lock(wait=False):
            if sess.has_layer_entries() or any(r.get("status") not in ("setup-failed", "incomplete") for r in sess.runs()):
                return
            # a command the policy refused stays on record
            if any(e.get("operation") == "exec" and e.get("result") == "blocked" for e in read_events(sess.events_path)):
                return
            trash = sess.dir.with_name(f".clean-{sess.id}-{os.getpid()}")
            os.rename(sess.dir, trash)
    except (StockadeError, OSError):
        return  # in use by another run (a same-named session made meanwhile): not ours to remove
    from ..session import idrange

    try:  # its layers may hold the sandbox's other ids' inodes (session/idrange.py)
        idrange.remove_tree(trash)
    except (StockadeError, OSError):
        shutil.rmtree(trash, ignore_errors=True)
