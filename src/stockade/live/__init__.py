"""Living sandboxes: start once, exec many commands at the cost of a fork, stop.

``start`` spawns a holder (``live.holder``) that starts the sandbox through the core
run path with its init serving execs, and returns once it serves (or with the error
that stopped it). ``Channel`` (``live.client``) execs into it. ``warm`` keeps one
ready for a project; ``claim`` takes it for a start or a run with the same policy.

Layer: above the core (it prepares and launches through it), below the API and CLI.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from ..errors import StockadeError, UsageError
from . import registry
from .client import Channel, LiveError, LivePopen
from .holder import DEFAULT_IDLE, StartSpec

if TYPE_CHECKING:
    from ..core.request import RunRequest

__all__ = ["DEFAULT_IDLE", "Channel", "LiveError", "LivePopen", "StartSpec", "start", "stop", "warm_key"]

HOLDER_ENTRY = "import sys; from stockade.live.holder import main; sys.exit(main())"


def _holder_log() -> int:
    root = registry.live_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(root / "holders.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)


def start(spec: StartSpec, *, timeout: float = 120.0) -> registry.Living:
    """Start a holder for ``spec`` and wait until its sandbox serves. A bad request
    raises its ``UsageError`` here, with nothing left behind."""
    if spec.name is not None:
        from ..session import store

        store.validate_name(spec.name)
    claimed = claim(spec)
    if claimed is not None:
        _keep_warm(claimed, spec)
        return claimed
    r, w = os.pipe2(os.O_CLOEXEC)
    log = _holder_log()
    try:
        # -P: the project directory (our cwd) must not shadow a module of ours
        proc = subprocess.Popen([sys.executable, "-P", "-c", HOLDER_ENTRY, str(w)], stdin=subprocess.PIPE,
                                stdout=log, stderr=log, pass_fds=[w], close_fds=True,
                                start_new_session=spec.detached)
    finally:
        os.close(w)
        os.close(log)
    try:
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.close()
        if spec.detached:
            proc.wait()  # it forked the holder and exited (the holder is nobody's child of ours)
        line = _read_line(r, timeout)
    finally:
        os.close(r)
    if line is None:
        if not spec.detached:
            proc.kill()
            proc.wait()
        raise LiveError(f"the sandbox's holder did not start within {timeout:g} s "
                        f"(its log: {registry.live_root() / 'holders.log'})")
    if not line:
        rc = proc.wait()
        raise LiveError(f"the sandbox's holder exited ({rc if not spec.detached else 'detached'}) before it served "
                        f"(its log: {registry.live_root() / 'holders.log'})")
    msg = json.loads(line)
    if not msg.get("ok"):
        if not spec.detached:
            proc.wait()
        err = str(msg.get("error"))
        raise UsageError(err) if msg.get("status") == 2 else LiveError(err)
    lv = registry.read(str(msg["id"]))
    if lv is None:
        raise LiveError(f"sandbox {msg['id']!r} started but left no record")
    if not spec.detached:
        _HOLDERS[lv.id] = proc
    if not spec.warm:
        _keep_warm(lv, spec)
    return lv


_HOLDERS: dict[str, subprocess.Popen[bytes]] = {}  # the holders this process started (reaped at stop)


def _keep_warm(lv: registry.Living, spec: StartSpec) -> None:
    """[prewarm] enabled: after a start, one sandbox is made ready for the next start or
    run of the same options (in the background: this start does not wait for it)."""
    if not lv.data.get("prewarm") or os.environ.get("STOCKADE_PREWARM", "1") == "0":
        return
    try:
        key = warm_key(spec.request)
    except (OSError, StockadeError):
        return
    if any(o.data.get("warm_key") == key and o.status == "warm" for o in registry.all_living()):
        return
    ttl = float(lv.data.get("prewarm_ttl") or 300.0)
    warm = StartSpec(spec.request, detached=True, idle=ttl, warm=True, warm_key=key)
    log = _holder_log()
    try:
        proc = subprocess.Popen([sys.executable, "-P", "-c", HOLDER_ENTRY, "-1"], stdin=subprocess.PIPE,
                                stdout=log, stderr=log, close_fds=True, start_new_session=True)
    finally:
        os.close(log)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(warm))
    proc.stdin.close()
    proc.wait()  # it forks the holder (detached) and exits


def run_claimed(req: RunRequest, io: Any) -> Any:
    """A one-shot run in a pre-warmed sandbox of the same options (``stockade warm`` or
    [prewarm]): claimed, the command exec'd, the sandbox stopped (its session keeps the
    change set). None when there is none to claim or the request needs a fresh sandbox
    (a named session, passed fds, a pty)."""
    if req.session is not None or req.pass_fds or getattr(io, "pty", False) or req.observe:
        return None  # (observe mode needs a sandbox of its own: its filter is installed at start)
    if not registry.warm_waiting():
        return None  # the common case: one listing, no policy load
    spec = StartSpec(req, owner_pid=os.getpid())
    lv = claim(spec)
    if lv is None:
        return None
    chan = Channel(lv)
    try:
        from .. import plan as planmod
        from ..core.prepare import load_policy

        project = planmod.resolve_project(req.project)
        env, _removed = load_policy(project, None, req.policy, req.env, req).env(os.environ)
        res = chan.exec(req.args, io=io, env=env, env_replace=True, cwd=req.cwd, timeout=req.timeout,
                        shell=req.shell, here=_here())
        res.new_session = True  # type: ignore[attr-defined]  # (the CLI names a new session)
        return res
    finally:
        chan.close()
        stop(lv, wait=False)  # the session is free; its holder removes the cgroups on its own time
        _keep_warm(lv, spec)


def _here() -> str | None:
    try:
        return os.getcwd()
    except OSError:
        return None


def _read_line(fd: int, timeout: float) -> bytes | None:
    """The holder's one line (b"": it ended without one; None: no line in time)."""
    buf = b""
    end = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        r, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not r:
            return None
        data = os.read(fd, 65536)
        if not data:
            return buf
        buf += data
    return buf


def stop(lv: registry.Living, grace: float | None = None, *, wait: bool = True) -> dict[str, Any]:
    """Stop a living sandbox: SIGTERM to its processes, ``grace`` seconds, then the
    rest killed; the overlay unmounted; the change set kept. Returns once the session
    is free; ``wait``: also once its holder has exited (its cgroups removed)."""
    if lv.status not in ("running", "warm", "stopping", "starting"):
        return {"ok": True, "status": lv.status, "reason": lv.data.get("reason")}
    chan = Channel(lv)
    try:
        out = chan.request("stop", timeout=(grace or 2.0) + 60, grace=grace)
    except LiveError:
        if lv.holder_alive():
            raise
        out = {"ok": True, "status": "stopped"}
    if wait:
        deadline = time.monotonic() + 10
        while lv.holder_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    _reap_holders()
    return out


def _reap_holders() -> None:
    """Holders this process started and that have exited since (no zombies kept)."""
    for sid, proc in list(_HOLDERS.items()):
        if proc.poll() is not None:
            del _HOLDERS[sid]


# --------------------------------------------------------------------------- pre-warming


def warm_key(req: RunRequest) -> str:
    """What a pre-warmed sandbox must match to be claimed: the project, the options,
    the policy's digest (a changed policy file changes it) and the project's identity."""
    import hashlib

    from .. import plan as planmod
    from ..core.prepare import load_policy

    project = planmod.resolve_project(req.project)
    st = os.stat(project)
    try:
        pol = load_policy(project, None, req.policy, req.env, req)
        digest = pol.digest
    except StockadeError:
        digest = "?"
    opts = (str(project), st.st_ino, st.st_dev, req.cwd and os.fspath(req.cwd), req.root, req.user, req.read_only,
            req.network, tuple(req.allow_hosts), tuple(str(x) for x in req.forward), req.seccomp,
            tuple(req.allow_degraded), req.landlock, repr(req.limits), os.getuid())
    # "options:policy": a sandbox warmed for these options under another policy is stale
    return hashlib.sha256(repr(opts).encode()).hexdigest()[:16] + ":" + digest[:16]


def claim(spec: StartSpec) -> registry.Living | None:
    """A pre-warmed sandbox for ``spec``, claimed, or None. Only a start over a new
    session can take one (a pre-warmed sandbox's session is new)."""
    if spec.warm or spec.name is not None or os.environ.get("STOCKADE_PREWARM", "1") == "0":
        return None
    try:
        key = warm_key(spec.request)
    except (OSError, StockadeError):
        return None
    opts = key.split(":", 1)[0]
    for lv in registry.all_living():
        if lv.data.get("status") != "warm" or not lv.holder_alive():
            continue
        if lv.data.get("warm_key") != key:
            if str(lv.data.get("warm_key") or "").split(":", 1)[0] == opts:
                try:  # warmed for these options under a policy that has changed since: stale
                    stop(lv, wait=False)
                except StockadeError:
                    pass
            continue
        try:
            Channel(lv).request("claim", owner_pid=spec.owner_pid, detached=spec.detached,
                                idle=spec.idle if spec.detached else None)
        except StockadeError:
            continue  # another claimant was first
        got = registry.read(lv.id)
        if got is not None:
            return got
    return None
