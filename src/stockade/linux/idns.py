"""Run a Python callable with the caller's sandboxes' ids: ``podman unshare`` for stockade.

A sandbox of an unprivileged caller with a subordinate id range (linux/idmap.py) may
leave files in its session's upper layer owned, on the host, by the caller's
subordinate ids, with any mode (``tar x`` as root inside, ``chown 1000 f; chmod 600
f``). The caller cannot read them, enter those directories or delete entries in them.

``call(fn, *args)`` runs ``fn`` in a forked child that has unshared a user namespace
mapped like the caller's sandboxes (the caller's uid and gid are 0 inside, the
subordinate range 1..N, written by newuidmap/newgidmap), so the child has
capabilities over the caller's and the subordinate ids' inodes and over no others
(capabilities in a user namespace never reach an inode whose owner it does not map).
The child's result comes back pickled over a pipe; its exception is raised again in
the parent with the same type, message and attributes; stdout and stderr are the
caller's.

Inside the child ``INSIDE`` is true: ``os.geteuid()`` is 0 there but the child is no
real root (``acting_root``), and the ids ``stat`` reports are the child's own
(``host_ids`` turns them back into the host's).
"""

from __future__ import annotations

import errno as _errno
import os
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import SandboxError

if TYPE_CHECKING:  # loaded when a child is made: scanning a session needs none of it
    from . import idmap

T = TypeVar("T")

CLONE_NEWUSER = 0x10000000

# Set in the child once its maps are written: (uid entries, gid entries) of its user
# namespace, (inside, outside, count) each.
INSIDE = False
_MAPS: tuple[tuple[idmap.Entry, ...], tuple[idmap.Entry, ...]] = ((), ())

_LEN = struct.Struct("!Q")


def acting_root() -> bool:
    """Real root (host root's powers over every inode), not the id-mapped child's 0."""
    return os.geteuid() == 0 and not INSIDE


def _to_host(entries: tuple[idmap.Entry, ...], i: int) -> int:
    for inside, outside, count in entries:
        if inside <= i < inside + count:
            return outside + (i - inside)
    return i  # unmapped ids read as the overflow id; nothing to translate


def host_ids(uid: int, gid: int) -> tuple[int, int]:
    """The host's ids for an owner ``stat`` reported in this process (the child's own
    view inside ``call``, the host's everywhere else)."""
    if not INSIDE:
        return uid, gid
    return _to_host(_MAPS[0], uid), _to_host(_MAPS[1], gid)


def maps_for(euid: int, egid: int, urange: idmap.Range, grange: idmap.Range) -> tuple[tuple[idmap.Entry, ...], tuple[idmap.Entry, ...]]:
    """The child's maps: the caller's ids as 0, the whole subordinate range after them."""
    return ((0, euid, 1), (1, urange.start, urange.count)), ((0, egid, 1), (1, grange.start, grange.count))


def caller_ranges() -> tuple[idmap.Range, idmap.Range]:
    """The caller's ranges (the ones its sandboxes map), or a SandboxError saying why none."""
    from . import idmap

    u, g, why = idmap.ranges(os.geteuid())
    if u is None or g is None:
        raise SandboxError(
            "map the session's subordinate ids (to read files a sandbox gave to other ids)",
            path="/etc/subuid",
            errno=_errno.EPERM,
            detail=why,
            remedy="restore this user's /etc/subuid and /etc/subgid entries (the ones its sandboxes used) "
                   "and install newuidmap/newgidmap (package uidmap); then retry",
        )
    return u, g


# ---- exceptions across the pipe -------------------------------------------------------------


def _pack_exc(e: BaseException) -> bytes:
    """Type (by module and name), args and attributes: enough to raise it again as it was
    (a plain pickle would call ``SandboxError(*args)`` and format the message twice)."""
    import pickle

    cls = type(e)
    state = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
        except Exception:
            continue
        state[k] = v
    if isinstance(e, OSError):  # errno and the file names are slots, not in vars()
        state.update({k: getattr(e, k) for k in ("errno", "strerror", "filename", "filename2")})
    args: tuple[Any, ...]
    try:
        pickle.dumps(e.args)
        args = e.args
    except Exception:
        args = (str(e),)
    return pickle.dumps(("exc", cls.__module__, cls.__qualname__, args, state, str(e)))


def _unpack_exc(module: str, qualname: str, args: tuple[Any, ...], state: dict[str, Any],
                text: str) -> BaseException:
    import importlib

    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not (isinstance(obj, type) and issubclass(obj, BaseException)):
            raise TypeError(qualname)
        e = obj.__new__(obj)
        e.args = args
        if isinstance(e, OSError):  # a full disk must be seen as ENOSPC again (store.disk_space)
            for k in ("errno", "strerror", "filename", "filename2"):
                v = state.pop(k, None)
                if v is not None:
                    setattr(e, k, v)
        e.__dict__.update(state)
        return e
    except Exception:
        return RuntimeError(f"{module}.{qualname}: {text}")


# ---- the child ---------------------------------------------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv):]


def _child(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], sync_w: int, go_r: int,
           res_w: int, maps: tuple[tuple[idmap.Entry, ...], tuple[idmap.Entry, ...]], state: str) -> None:
    global INSIDE, _MAPS
    import pickle

    status = 0
    try:
        try:
            from . import libc

            if libc.unshare(CLONE_NEWUSER) != 0:
                err = libc.errno()
                raise SandboxError("unshare (new user namespace, to reach a session's subordinate ids)",
                                   errno=err, remedy=_userns_remedy(err))
            os.write(sync_w, b"u")
            if os.read(go_r, 1) != b"k":  # the parent could not write the maps: it says why
                os._exit(0)
            INSIDE, _MAPS = True, maps
            # the state dir from the caller, never from root's home (~ of uid 0 here)
            os.environ["STOCKADE_STATE_DIR"] = state
            payload = pickle.dumps(("ok", fn(*args, **kwargs)))
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            payload = pickle.dumps(("exit", status))
        except BaseException as e:
            try:
                payload = _pack_exc(e)
            except Exception:
                payload = pickle.dumps(("exc", "builtins", "RuntimeError", (str(e),), {}, str(e)))
        _write_all(res_w, _LEN.pack(len(payload)) + payload)
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
    finally:
        os._exit(status)  # never the parent's atexit handlers, never back into its stack


def _userns_remedy(err: int) -> str:
    """The same cause and fix a run's namespace step gives (remedies.userns)."""
    from . import remedies

    rem = remedies.userns(err, remedies.detect())
    return f"{rem.cause}; {rem.fix}"


# ---- the parent --------------------------------------------------------------------------------


def _read_exact(fd: int, n: int, pidfd: int) -> bytes:
    """``n`` bytes from ``fd``, or fewer when the child has exited with nothing more to say
    (its pidfd is polled too: a pipe end another thread's fork holds keeps EOF away)."""
    import select

    buf = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if pidfd >= 0:
        poller.register(pidfd, select.POLLIN)
    child_gone = pidfd < 0  # no pidfd (a kernel before 5.3): EOF alone ends the read
    while len(buf) < n:
        ready = dict(poller.poll())
        if fd in ready:
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                break
            buf += chunk
            continue
        if child_gone:
            break  # pragma: no cover - only after the child exited without EOF
        child_gone = True  # one more look at the pipe: what it wrote before exiting
        poller.unregister(pidfd)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(0):
            break
    return buf


def _write_maps(pid: int, maps: tuple[tuple[idmap.Entry, ...], tuple[idmap.Entry, ...]],
                urange: idmap.Range | None, grange: idmap.Range | None) -> None:
    from . import idmap

    if urange is None or grange is None:
        # the caller's own ids only: any process may map its own, setgroups denied first
        for what, data in (("setgroups", "deny"), ("uid_map", f"0 {maps[0][0][1]} 1"),
                           ("gid_map", f"0 {maps[1][0][1]} 1")):
            path = f"/proc/{pid}/{what}"
            try:
                with open(path, "w") as f:
                    f.write(data + "\n")
            except OSError as e:
                raise SandboxError(f"write {what} (the caller's own ids)", path=path, errno=e.errno or 0,
                                   remedy="see `stockade doctor`") from None
        return
    if urange.helper and grange.helper:
        # the setuid helpers check the entries against /etc/subuid and /etc/subgid
        idmap.write_with_helper(pid, urange.helper, maps[0], "uid_map")
        idmap.write_with_helper(pid, grange.helper, maps[1], "gid_map")
        return
    for what, entries in (("uid_map", maps[0]), ("gid_map", maps[1])):  # real root writes them itself
        path = f"/proc/{pid}/{what}"
        try:
            with open(path, "w") as f:
                f.write("".join(f"{i} {o} {c}\n" for i, o, c in entries))
        except OSError as e:
            raise SandboxError(f"write {what}", path=path, errno=e.errno or 0,
                               remedy="check the /etc/subuid and /etc/subgid entries of root") from None


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a child with the caller's sandboxes' ids (see the module
    docstring); in this process when already inside one, or for real root, which needs none."""
    return _call(fn, args, kwargs, True)


def call_own(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call``, for files of the caller's own that a sandbox made unreadable (``chmod 000
    d``): with the caller's range where it has one, else with its own ids alone (the
    capabilities reach its own inodes, which it owns anyway)."""
    return _call(fn, args, kwargs, False)


def _call(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], need_range: bool) -> T:
    if INSIDE or acting_root():
        return fn(*args, **kwargs)
    import pickle

    from .. import paths

    urange: idmap.Range | None
    grange: idmap.Range | None
    try:
        urange, grange = caller_ranges()
        maps = maps_for(os.geteuid(), os.getegid(), urange, grange)
    except SandboxError:
        if need_range:
            raise
        urange = grange = None
        maps = ((0, os.geteuid(), 1),), ((0, os.getegid(), 1),)
    state = paths.state_dir()
    # the child imports nothing: a module another thread is importing now would hang it
    # (its import lock is copied held, by a thread the child does not have)
    from . import libc, remedies  # noqa: F401
    sync_r, sync_w = os.pipe()  # CLOEXEC (PEP 446): nothing the child runs inherits them
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    # buffered output would be written twice (by the child too) otherwise
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    try:
        pid = os.fork()
    except BaseException:
        for fd in (sync_r, sync_w, go_r, go_w, res_r, res_w):
            os.close(fd)
        raise
    if pid == 0:
        os.close(sync_r)
        os.close(go_w)
        os.close(res_r)
        _child(fn, args, kwargs, sync_w, go_r, res_w, maps, state)
    os.close(sync_w)
    os.close(go_r)
    os.close(res_w)
    pidfd = -1
    status = None
    try:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = -1
        mapped = False
        map_error: BaseException | None = None
        if _read_exact(sync_r, 1, pidfd) == b"u":
            try:
                _write_maps(pid, maps, urange, grange)
                mapped = True
            except BaseException as e:
                map_error = e
            # "k" lets it go on; anything else (EOF included) makes it exit
            os.write(go_w, b"k" if mapped else b"x")
        head = _read_exact(res_r, _LEN.size, pidfd)
        body = _read_exact(res_r, _LEN.unpack(head)[0], pidfd) if len(head) == _LEN.size else b""
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:  # SIGCHLD ignored (a CLI server): the kernel reaped it
            status = 0
        if map_error is not None:
            raise map_error
    finally:
        for fd in (sync_r, go_w, res_r):
            os.close(fd)
        if pidfd >= 0:
            os.close(pidfd)
        if status is None:  # interrupted (Ctrl-C reached the child too): never leave it unreaped
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    try:
        msg = pickle.loads(body) if body else None
    except Exception:
        msg = None
    if msg is None:
        code = os.waitstatus_to_exitcode(status)
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        raise SandboxError(
            "the id-mapped helper process" + ("" if mapped else " (before its ids were mapped)"),
            detail=f"it ended ({how}) without a result", remedy="see the messages above; retry")
    if msg[0] == "ok":
        result: T = msg[1]
        return result
    if msg[0] == "exit":
        raise SystemExit(msg[1])
    raise _unpack_exc(*msg[1:])
