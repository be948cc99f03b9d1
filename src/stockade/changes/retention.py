"""Which sessions stay and which go: a session's state, the collection rules, removal.

A session is **anonymous** when a run that named no session made it (``stockade.run``
without ``session=``, ``stockade run`` without ``--session``: meta.json's
``"anonymous": true``). Rules, in this order:

* never removed while in use: a run in it (its flock), a living sandbox holding it, an
  apply, discard or snapshot holding its lock, an interrupted apply whose journal
  needs its layers (``stockade recover``), or made in the last minute with no run yet
  (its first run is about to lock it);
* an anonymous session whose run changed nothing goes when its run ends
  (``after_run``): from the API at once; from the CLI when the next CLI run of the
  same project ends, so ``stockade log``/``status --latest``/``diff`` still reach the
  latest run;
* any other session with no unapplied change (empty, or all of it applied) goes once
  it is older than ``[sessions] keep`` (default 7 days; age = time since its last use),
  checked at most every ``AUTO_EVERY`` seconds at the end of a run, in a process of
  its own (``maybe_collect``: the run never waits for it);
* a session with unapplied changes goes only when asked
  (``stockade clean --older-than AGE --include-unapplied``, ``clean S``, ``clean --all``);
* a session whose project directory is gone (state ``project-gone``) is judged without
  the project: entries in its layers are unapplied changes (they can never be applied
  now), so it goes like a session with unapplied changes; with empty layers it goes by
  age like an empty one.

A collection never stops at one session: whatever fails for one (an unreadable
meta.json, a directory it may not open, a sandbox's ids it cannot reach) is reported
as that session skipped, with the reason, and the next is judged.

An apply's journal lives in ``<state>/applies/``, not in the session: ``stockade
rollback`` of an apply whose session was collected still restores the project exactly;
the entries it took from the session are then not put back anywhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import ProjectGone, SessionBusy, SessionNotFound, StockadeError
from ..linux.procs import pid_alive
from ..session import idrange, store
from ..session.age import DURATION_FORMS, parse_age
from ..session.store import Session

__all__ = ["DURATION_FORMS", "Outcome", "SessionInfo", "after_run", "clean", "list_infos", "maybe_collect",
           "parse_age", "remove"]

STATES = ("running", "idle", "locked", "has-changes", "applied", "empty", "project-gone", "unreadable")
AUTO_EVERY = 900.0  # seconds between two automatic collections (the stamp's age)
STARTING_GRACE = 60.0  # a session with no run yet, younger than this, is being started
_STAMP = ".collected"

# ---- a session's state ---------------------------------------------------------------------


@dataclass(frozen=True)
class SessionInfo:
    """One session as ``stockade status`` lists it and the collector judges it."""

    id: str
    project: str
    state: str  # one of STATES
    age_s: float  # since its last use
    created: str
    runs: int
    anonymous: bool
    reason: str = ""  # why it is in use (running, idle, locked), or why project-gone
    size: int | None = None  # bytes on disk (when asked for)
    changes: dict[str, int] | None = None  # added, modified, deleted (when scanned)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _living(sid: str) -> tuple[str, str] | None:
    """(state, reason) when a living sandbox's holder holds the session."""
    pid = store._living_holder(sid)
    if pid is None:
        return None
    try:
        with open(os.path.join(paths.state_dir(), "live", sid, "holder.json"), encoding="utf-8") as f:
            execs = int(json.load(f).get("execs") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        execs = 0
    if execs:
        return "running", f"living sandbox {sid} (holder pid {pid}) runs {execs} command(s)"
    return "idle", f"held by living sandbox {sid} (holder pid {pid}); `stockade stop {sid}` ends it"


def _pending() -> set[str]:
    """The sessions an interrupted apply or rollback needs (``stockade recover``)."""
    root = os.path.join(paths.state_dir(), "applies")
    try:
        names = os.listdir(os.path.join(root, "pending"))  # usually absent: one failed lookup
    except OSError:
        return set()
    out: set[str] = set()
    for n in names:
        try:
            with open(os.path.join(root, n, "plan.json"), encoding="utf-8") as f:
                out.add(str(json.load(f).get("session")))
        except (OSError, ValueError, AttributeError):
            continue
    return out


def _journals() -> tuple[set[str], set[str]]:
    """(sessions an interrupted apply or rollback needs, sessions a finished apply took from)."""
    from .journal import list_applies

    return _pending(), {a.session for a in list_applies() if a.state == "done"}


def _last_run_open(sess: Session) -> bool:
    """Whether the session's newest run has no record yet (it is running)."""
    try:
        names = [int(n) for n in os.listdir(sess.runs_dir) if n.isdigit()]
    except OSError:
        return False
    if not names:
        return False
    try:
        return os.stat(sess.runs_dir / str(max(names)) / "run.json").st_size == 0
    except FileNotFoundError:
        return True


def _counts(sess: Session) -> dict[str, int]:
    """The change counts (a scan of the session's layers against the project's entries
    at those paths only; never a walk of the project)."""
    from .walk import walk

    c = walk(sess, classify=False).counts()
    return {"added": c.added, "modified": c.modified, "deleted": c.deleted}


def _in_use(sess: Session, meta: dict[str, Any], runs: int, age: float,
            pending: set[str]) -> tuple[str, str] | None:
    living = _living(sess.id)
    if living is not None:
        return living
    if sess.id in pending:
        return "locked", "an interrupted apply needs it; run `stockade recover`"
    if runs == 0 and age < STARTING_GRACE and meta.get("anonymous"):
        # made by a run that locks it next (a named one is its caller's: `clean` is asked for)
        return "running", "just made; its first run is starting"
    return None


def _flock_free(sess: Session) -> bool:
    try:
        fd = os.open(sess.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _busy_reason(sess: Session) -> tuple[str, str]:
    if _last_run_open(sess):
        return "running", "a run is in progress"
    return "locked", "locked by another stockade command (apply, discard, snapshot, clean)"


class Unreadable(StockadeError):
    """A session's meta.json cannot be read as a session's record."""


def _meta(sess: Session) -> dict[str, Any]:
    try:
        meta = sess.meta()
    except (ValueError, UnicodeDecodeError) as e:
        raise Unreadable(f"its meta.json is unreadable ({e})") from None
    except IsADirectoryError:
        raise Unreadable("its meta.json is a directory") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("project"), str):
        raise Unreadable("its meta.json names no project") from None
    return meta


def _project_gone(project: str) -> bool:
    """The project directory no longer exists (a permission error is not that: it raises)."""
    try:
        return not stat.S_ISDIR(os.stat(project).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return True


def _gone(base: SessionInfo, sess: Session) -> SessionInfo:
    """A session whose project is gone: entries in its layers are changes that can never
    be applied (``changes`` None: they cannot be classified without the project)."""
    if not sess.has_layer_entries():
        return replace(base, state="project-gone", changes={"added": 0, "modified": 0, "deleted": 0},
                       reason=f"project {base.project} no longer exists; nothing in the session")
    return replace(base, state="project-gone",
                   reason=f"project {base.project} no longer exists: its changes can never be applied "
                          f"(the files are in {sess.upper}); `stockade clean {sess.id}` removes it")


def unapplied(info: SessionInfo) -> bool:
    """Whether the session holds changes not applied (a gone project's: any layer entry)."""
    return info.state == "has-changes" or (info.state == "project-gone" and info.changes is None)


def _judge(sess: Session, pending: set[str], applied: set[str], *, scan: bool = True,
           probe: bool = True) -> SessionInfo:
    """The session's state. ``probe``: try its lock (else the caller holds it)."""
    meta = _meta(sess)
    now = time.time()
    age = max(0.0, now - store.last_used(sess))
    try:
        runs = len([n for n in os.listdir(sess.runs_dir) if n.isdigit()])
    except OSError:
        runs = 0
    base = SessionInfo(sess.id, str(meta.get("project", "")), "empty", round(age, 1), str(meta.get("created", "")),
                       runs, bool(meta.get("anonymous")))
    used = _in_use(sess, meta, runs, age, pending)
    if used is None and probe and not _flock_free(sess):
        used = _busy_reason(sess)
    if used is not None:
        return replace(base, state=used[0], reason=used[1])
    if _project_gone(base.project):
        return _gone(base, sess)
    if not sess.has_layer_entries():
        counts: dict[str, int] | None = {"added": 0, "modified": 0, "deleted": 0}
    elif scan:
        try:
            counts = _counts(sess)
        except ProjectGone:  # removed since the check above
            return _gone(base, sess)
    else:
        counts = None
    if counts is not None and not any(counts.values()):
        kept = _snapshot_with_changes(sess) if scan else None
        if kept is not None:
            return replace(base, state="has-changes", changes=counts,
                           reason=f"snapshot {kept} holds changes (a restore point) that later runs undid")
        return replace(base, state="applied" if sess.id in applied else "empty", changes=counts)
    return replace(base, state="has-changes", changes=counts)


def _snapshot_with_changes(sess: Session) -> str | None:
    """The name of a snapshot whose restore point (it and the layers below) differs from
    the project, though the merged view does not (a later run undid it): `snapshot
    restore` would bring it back, so the session is not empty. None if there is none."""
    from .walk import walk

    layers = sess.layers()
    for k in range(len(layers) - 1, -1, -1):
        c = walk(sess, classify=False, stack=layers[:k + 1]).counts()
        if c.added or c.modified or c.deleted:
            return layers[k].name
    return None


def disk_usage(path: str) -> int:
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirs, files in os.walk(path):
        for n in dirs + files:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen.add(key)
                total += st.st_blocks * 512
    return total


def list_infos(*, size: bool = True) -> list[SessionInfo]:
    """Every session with its state (and size), oldest use first."""
    du = idrange.with_sandbox_ids()(disk_usage)  # a sandbox's other ids' directories count too
    pending, applied = _journals()
    out = []
    for s in store.list_sessions():
        try:
            info = _judge(s, pending, applied)
        except (SessionNotFound, FileNotFoundError):
            continue  # removed meanwhile
        except Unreadable as e:
            info = _unreadable(s, pending, str(e))
        except Exception as e:  # one session's failure never hides the others
            info = SessionInfo(s.id, "", "unreadable", 0.0, "", 0, False,
                               reason=f"{_why(e)}; `stockade clean {s.id}` removes it")
        if size:
            info = replace(info, size=du(str(s.dir)))
        out.append(info)
    out.sort(key=lambda i: -i.age_s)
    return out


# ---- removal -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a collection did with one session."""

    id: str
    action: str  # removed | would-remove | skipped
    state: str
    age_s: float
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _remove_locked(sess: Session, *, pointers: bool = True) -> None:
    """Remove ``sess``, whose lock the caller holds: renamed aside at once (a run that
    waited for the lock finds it gone: ``store._still_here``), then deleted."""
    try:
        meta = sess.meta()
    except (OSError, StockadeError, ValueError):
        meta = None
    qid = meta.get("quota_project") if isinstance(meta, dict) else None
    trash = sess.dir.with_name(f".clean-{sess.id}-{os.getpid()}-{os.urandom(3).hex()}")
    os.rename(sess.dir, trash)
    try:
        idrange.remove_tree(trash)
    except StockadeError:
        # its sandbox's ids cannot be reached now (a subordinate range gone): what is all
        # the caller's own goes all the same, else it stays a session
        if not _all_own(trash):
            os.rename(trash, sess.dir)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    except OSError:
        shutil.rmtree(trash, ignore_errors=True)
    forget_living(sess.id)
    if isinstance(qid, int):
        from ..linux import quota

        quota.release(sess.dir.parent, qid)  # its project quota (``core.prepare._project_quota``)
    if not pointers:
        return
    with contextlib.suppress(OSError):
        # a CLI run's pointer to its latest empty session
        for n in os.listdir(sess.dir.parent):
            if n.startswith(".latest-empty-") and _read_pointer(sess.dir.parent / n) == sess.id:
                os.unlink(sess.dir.parent / n)


def _all_own(path: Path) -> bool:
    """Every entry of the tree is the caller's (a directory of its own that it cannot
    read, such as overlayfs's work/work of mode 0, is opened up: it is being removed)."""
    uid = os.geteuid()
    todo = [str(path)]
    while todo:
        d = todo.pop()
        try:
            st = os.lstat(d)
            if st.st_uid != uid:
                return False
            if st.st_mode & stat.S_IRWXU != stat.S_IRWXU:
                os.chmod(d, stat.S_IRWXU)
            with os.scandir(d) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
                    elif e.stat(follow_symlinks=False).st_uid != uid:
                        return False
        except OSError:
            return False
    return True


def forget_living(sid: str) -> None:
    """A removed session's living sandbox record (stopped: its lock was free) goes with it."""
    if store._living_holder(sid) is None:
        shutil.rmtree(os.path.join(paths.state_dir(), "live", sid), ignore_errors=True)


def remove(sess: Session, *, include_unapplied: bool, older_than: float | None = None,
           dry_run: bool = False, pending: set[str] | None = None, applied: set[str] | None = None) -> Outcome:
    """Remove one session when the rules allow it, judged again under its lock. Never
    raises for the session's own trouble: that is an outcome ``skipped`` with the reason."""
    try:
        return _remove(sess, include_unapplied=include_unapplied, older_than=older_than, dry_run=dry_run,
                       pending=pending, applied=applied)
    except SessionBusy:
        state, why = _living(sess.id) or _busy_reason(sess)
        return Outcome(sess.id, "skipped", state, 0.0, f"in use: {why}")
    except (SessionNotFound, FileNotFoundError):
        return Outcome(sess.id, "skipped", "empty", 0.0, "removed meanwhile")
    except Exception as e:  # one session's failure never stops a collection
        return Outcome(sess.id, "skipped", "error", 0.0, _why(e))


def _why(e: BaseException) -> str:
    if isinstance(e, StockadeError):
        return str(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return f"{type(e).__name__}: {e}"


def _unreadable(sess: Session, pending: set[str], why: str) -> SessionInfo:
    """A session whose meta.json cannot be read: judged by its lock (held), its living
    sandbox and its journals only; what its layers hold counts as unapplied."""
    base = SessionInfo(sess.id, "", "unreadable", round(max(0.0, time.time() - store.last_used(sess)), 1),
                       "", 0, False, reason=f"{why}; `stockade clean {sess.id}` removes it")
    living = _living(sess.id)
    if living is not None:
        return replace(base, state=living[0], reason=living[1])
    if sess.id in pending:
        return replace(base, state="locked", reason="an interrupted apply needs it; run `stockade recover`")
    return base


def _remove(sess: Session, *, include_unapplied: bool, older_than: float | None, dry_run: bool,
            pending: set[str] | None, applied: set[str] | None) -> Outcome:
    if older_than is not None:
        young = time.time() - store.last_used(sess)
        if young < older_than:  # before any lock or scan: most sessions stop here
            return Outcome(sess.id, "kept", "", round(young, 1), "younger than the age asked for")
    if pending is None or applied is None:
        pending, applied = _journals()
    with sess.lock(wait=False):
        pending = pending | _pending()  # (again, under its lock: an apply interrupted meanwhile needs it)
        try:
            info = _judge(sess, pending, applied, probe=False)
        except Unreadable as e:
            info = _unreadable(sess, pending, str(e))
        if info.state in ("running", "idle", "locked"):
            return Outcome(sess.id, "skipped", info.state, info.age_s, f"in use: {info.reason}")
        if older_than is not None and info.age_s < older_than:
            return Outcome(sess.id, "kept", info.state, info.age_s, "younger than the age asked for")
        if info.state == "has-changes" and not include_unapplied:
            return Outcome(sess.id, "skipped", info.state, info.age_s,
                           f"{info.reason or 'unapplied changes'} (review: stockade diff {sess.id}; "
                           "--include-unapplied removes them)")
        if (unapplied(info) or info.state == "unreadable") and not include_unapplied:
            return Outcome(sess.id, "skipped", info.state, info.age_s,
                           f"{info.reason} (or --include-unapplied)")
        if dry_run:
            return Outcome(sess.id, "would-remove", info.state, info.age_s)
        _remove_locked(sess)
        return Outcome(sess.id, "removed", info.state, info.age_s)


def clean(older_than: float | None = None, *, include_unapplied: bool = False, dry_run: bool = False,
          sessions: Iterable[Session] | None = None) -> list[Outcome]:
    """Remove the sessions older than ``older_than`` seconds (None: any age) that no one
    uses; with unapplied changes only with ``include_unapplied``. Returns what was
    removed and what was skipped (with the reason); sessions kept for their age are
    not listed."""
    pending, applied = _journals()
    _sweep_trash()
    out = []
    for s in sessions if sessions is not None else store.list_sessions():
        o = remove(s, include_unapplied=include_unapplied, older_than=older_than, dry_run=dry_run,
                   pending=pending, applied=applied)
        if o.action != "kept":
            out.append(o)
    return out


def _sweep_trash() -> None:
    """``.clean-*`` directories of removals that a crash interrupted, and CLI pointers
    (``.latest-empty-*``) to sessions that are gone."""
    root = store.sessions_dir()
    try:
        listing = os.listdir(root)
    except OSError:
        return
    for n in listing:
        if n.startswith(".latest-empty-") and not n.endswith(".tmp"):
            sid = _read_pointer(root / n)
            if not sid or not (root / sid).is_dir():
                with contextlib.suppress(OSError):
                    os.unlink(root / n)
    names = [n for n in listing if n.startswith(".clean-")]
    for n in names:
        pid = n.rsplit("-", 2)[-2] if n.count("-") >= 3 else ""
        if pid.isdigit() and pid != str(os.getpid()) and pid_alive(int(pid)):
            continue
        try:
            idrange.remove_tree(root / n)
        except (StockadeError, OSError):
            shutil.rmtree(root / n, ignore_errors=True)


# ---- after a run: anonymous sessions ----------------------------------------------------------------


def _pointer(project: str) -> Path:
    return store.sessions_dir() / (".latest-empty-" + hashlib.sha256(project.encode()).hexdigest()[:16])


def _read_pointer(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _empty_now(sess: Session) -> bool:
    """No change in the session (the caller holds its lock): an empty upper layer, or a
    scan of what it holds that finds no change."""
    if not sess.has_layer_entries():
        return True
    return not any(_counts(sess).values())


# ---- removal off the run's path ----------------------------------------------------------------
# A run's empty session is renamed aside under its lock (from then on it does not exist)
# and deleted by a worker thread: the deletion waits for the overlay lock (the launcher's
# run child unmounts after it reported the run's end) and costs a few inodes' I/O, none
# of which the caller should wait for. Drained at exit (atexit; a CLI server's
# supervisor calls ``drain`` before its os._exit).

_work_cv = threading.Condition()
_work_todo: list[Path] = []
_work_busy = 0
_work_thread: threading.Thread | None = None
_work_registered = False


def _defer_erase(trash: Path) -> None:
    global _work_thread, _work_busy
    with _work_cv:
        _work_todo.append(trash)
        _work_busy += 1
        if _work_thread is None:
            global _work_registered
            if not _work_registered:
                import atexit

                atexit.register(drain)
                _work_registered = True
            _work_thread = threading.Thread(target=_work, name="stockade-session-erase", daemon=True)
            _work_thread.start()
        _work_cv.notify_all()


def _work() -> None:
    # Ends once the queue is empty: an embedding program keeps no idle thread of ours.
    global _work_busy, _work_thread
    while True:
        with _work_cv:
            if not _work_todo:
                _work_thread = None
                return
            trash = _work_todo.pop(0)
        try:
            _erase(trash)
        finally:
            with _work_cv:
                _work_busy -= 1
                _work_cv.notify_all()


def _erase(trash: Path) -> None:
    """Delete a session renamed aside, once no overlay on its layers is left."""
    try:
        fd = os.open(trash / "work", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # (the run's overlay lock: its unmount done)
        finally:
            os.close(fd)
    except OSError:
        pass
    try:
        idrange.remove_tree(trash)
    except StockadeError:
        if _all_own(trash):
            shutil.rmtree(trash, ignore_errors=True)
        # else left as .clean-*: swept once this process is gone (_sweep_trash)
    except OSError:
        shutil.rmtree(trash, ignore_errors=True)


def drain(timeout: float = 60.0) -> None:
    """Wait until the sessions handed to the worker are deleted."""
    deadline = time.monotonic() + timeout
    with _work_cv:
        while _work_busy and time.monotonic() < deadline:
            _work_cv.wait(0.1)


def _forget_work() -> None:
    global _work_cv, _work_thread, _work_busy
    _work_cv = threading.Condition()
    _work_todo.clear()  # the parent's: its worker deletes them
    _work_busy = 0
    _work_thread = None


os.register_at_fork(after_in_child=_forget_work)


@contextlib.contextmanager
def _lock_soon(sess: Session, timeout: float = 2.0) -> Iterator[int]:
    """The session's lock, waited for a little: its run has ended, but a sandbox another
    thread was starting at that moment may hold a copy of the lock's fd for an instant
    (a fork's inherited descriptors, closed once it confines itself)."""
    deadline = time.monotonic() + timeout
    while True:
        stack = contextlib.ExitStack()
        try:
            # for_run: not the overlay lock (the run's processes are gone, so its layer is
            # final; the overlay's unmount is waited for by the deletion, _erase)
            fd = stack.enter_context(sess.lock(wait=False, for_run=True))
        except SessionBusy:
            if time.monotonic() > deadline or _living(sess.id) is not None:
                raise
            time.sleep(0.005)
            continue
        with stack:
            yield fd
        return


def _drop_if_empty(sess: Session, *, scan: bool = True) -> bool:
    """Remove an anonymous session that holds no change and no one uses. ``scan``: also
    when its layers hold entries that make no change (else only an empty layer counts)."""
    try:
        with _lock_soon(sess):
            meta = sess.meta()
            if not meta.get("anonymous") or _living(sess.id) is not None:
                return False
            if meta.get("observed"):  # its audit log is what an observed run was for: the age rule decides
                return False
            if not (_empty_now(sess) if scan else not sess.has_layer_entries()):
                return False
            if sess.id in _pending():
                return False
            trash = sess.dir.with_name(f".clean-{sess.id}-{os.getpid()}-{os.urandom(3).hex()}")
            os.rename(sess.dir, trash)
    except (StockadeError, OSError):
        return False  # in use, removed meanwhile, or unreadable: the age rule decides later
    _defer_erase(trash)
    return True


def after_run(sid: str, *, keep_latest: bool) -> bool:
    """The run that made anonymous session ``sid`` ended. Returns whether it was removed.

    ``keep_latest`` (the CLI): an empty session stays as its project's latest until the
    next CLI run of that project ends; that run removes it (if still empty and unused).
    The CLI's check is the cheap one (an empty layer), as its summary line scans anyway."""
    try:
        sess = store.open_session(sid)
    except (StockadeError, OSError):
        return False
    if not keep_latest:
        return _drop_if_empty(sess)
    try:
        project = str(sess.meta().get("project", ""))
        with sess.lock(wait=False):
            empty = not sess.has_layer_entries()
    except (StockadeError, OSError):
        return False
    ptr = _pointer(project)
    old = _read_pointer(ptr)
    try:
        if empty:
            tmp = ptr.with_name(f"{ptr.name}.{os.getpid()}.tmp")
            tmp.write_text(sid + "\n", encoding="utf-8")
            os.replace(tmp, ptr)
        elif old:
            ptr.unlink(missing_ok=True)
    except OSError:
        pass
    if old and old != sid:
        with contextlib.suppress(StockadeError, OSError):
            _drop_if_empty(store.open_session(old), scan=False)
    return False


# ---- the automatic collection --------------------------------------------------------------


def keep_setting() -> float | None:
    """``[sessions] keep`` of the global config (seconds; None: never), else 7 days."""
    from ..policy import config

    return config.sessions_keep()


def maybe_collect() -> None:
    """At the end of a run: when the last automatic collection is older than
    ``AUTO_EVERY``, start one in a process of its own (the caller never waits for it).
    A state dir without a stamp gets one (nothing in it is old enough yet)."""
    stamp = os.path.join(paths.state_dir(), "sessions", _STAMP)
    now = time.time()
    try:
        if now - os.stat(stamp).st_mtime < AUTO_EVERY:
            return
        os.utime(stamp, (now, now))
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            os.close(os.open(stamp, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        return
    except OSError:
        return
    spawn_collector()


def spawn_collector() -> None:
    """``python -m stockade.changes.retention`` for this state dir, detached."""
    import subprocess
    import sys
    import threading

    env = dict(os.environ, STOCKADE_STATE_DIR=paths.state_dir())
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        p = subprocess.Popen([sys.executable, "-m", "stockade.changes.retention"], env=env, cwd="/",
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True)
    except OSError:
        return
    threading.Thread(target=p.wait, name="stockade-collect-reap", daemon=True).start()


def collect_auto() -> list[Outcome]:
    """The automatic collection: sessions with no unapplied change older than ``keep``."""
    try:
        keep = keep_setting()
    except StockadeError:
        return []  # a broken config: its error shows on the next command that reads it
    if keep is None:
        _sweep_trash()
        return []
    return clean(keep, include_unapplied=False)


if __name__ == "__main__":
    collect_auto()
