"""Audit log: one JSONL stream per session (``<session>/events.jsonl``).

Each line is one event::

    {"schema_version": 1, "timestamp": "2026-01-28T10:30:05.123Z", "session": "0128-a1b2c3",
     "run": 3, "operation": "read", "target": ".env", "result": "blocked",
     "policy": "sensitive-file-pattern", "reason": "matches .env (default)"}

Paths, never file contents.  Every string is scanned for secret-looking values
(token formats, ``KEY=value`` / ``--password x`` pairs with secret-looking names,
URL passwords) which are replaced by ``[REDACTED:<kind>]``; strings are capped at
``MAX_FIELD`` characters, lists at ``MAX_ITEMS`` items and a line at ``MAX_LINE``
bytes.  Lines are appended with one ``write`` on an ``O_APPEND`` descriptor so
concurrent writers do not interleave.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from json.encoder import encode_basestring as _json_str  # (C's when built: the encoder's own)
from pathlib import Path
from typing import Any, Protocol

from .redact import printable, record_argv, redact_text, secret_name, terminal_safe

SCHEMA_VERSION = 1
MAX_FIELD = 2048
MAX_ITEMS = 256
MAX_LINE = 65536
MAX_DEPTH = 4
RESULTS = ("allowed", "blocked", "ok", "failed", "error", "started", "info")
BLOCKED_RESULTS = frozenset({"blocked"})

class PolicyFacts(Protocol):
    """What the run records say of the policy (``policy.Effective``, or a cached copy)."""

    @property
    def digest(self) -> str: ...

    @property
    def files(self) -> Iterable[tuple[str, str]]: ...

    @property
    def read_only(self) -> bool: ...

    @property
    def warnings(self) -> Iterable[str]: ...


class MaskedFact(Protocol):
    """One masked path, as the run records name it (``policy.Masked``, or a cached copy)."""

    @property
    def path(self) -> Path: ...

    @property
    def is_dir(self) -> bool: ...

    @property
    def is_symlink(self) -> bool: ...

    @property
    def rule(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def origin(self) -> str: ...


class _SessionLike(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def events_path(self) -> Path: ...


_SCALARS = (bool, int, float)
_SEQUENCES = (list, tuple, set, frozenset)


def cap(value: Any, depth: int = 0) -> Any:
    """Redact and length-cap a JSON-able value."""
    t = type(value)
    if t is str:
        return _cap_str(value)
    if value is None or t in _SCALAR_TYPES:
        return value
    if isinstance(value, str):
        return _cap_str(str(value))
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Path):
        return cap(str(value), depth)
    if depth >= MAX_DEPTH:
        return cap(repr(value), depth)
    if isinstance(value, Mapping):
        items = list(value.items())
        out = {printable(str(k))[:128]: cap(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["_truncated"] = len(items) - MAX_ITEMS
        return out
    if isinstance(value, _SEQUENCES):
        seq = list(value)
        capped = [cap(v, depth + 1) for v in seq[:MAX_ITEMS]]
        if len(seq) > MAX_ITEMS:
            capped.append(f"...[+{len(seq) - MAX_ITEMS} items]")
        return capped
    return cap(str(value), depth)


_SCALAR_TYPES = frozenset({bool, int, float})


# short strings already capped (operations, results, reasons, policies recur in every event)
_CAPPED: dict[str, str] = {}


def _cap_str(s: str) -> str:
    hit = _CAPPED.get(s)
    if hit is not None:
        return hit
    v = redact_text(printable(s))
    if len(v) > MAX_FIELD:
        v = v[: MAX_FIELD - 20] + f"...[+{len(v) - MAX_FIELD + 20} chars]"
    if len(s) <= 160:
        if len(_CAPPED) >= 4096:
            _CAPPED.clear()
        _CAPPED[s] = v
    return v


# JSON of a capped string, by its raw value (operations, policies, reasons recur)
_STR_JSON: dict[str, str] = {}


def _str_json(s: str) -> str:
    """The JSON of a string as a line holds it (capped, redacted)."""
    hit = _STR_JSON.get(s)
    if hit is None:
        hit = _json_str(_cap_str(s))
        if len(s) <= 160:
            if len(_STR_JSON) >= 4096:
                _STR_JSON.clear()
            _STR_JSON[s] = hit
    return hit


def _plain_json(v: object) -> str | None:
    """The JSON of ``cap(v)`` for the plain values most events hold (a str, int, bool,
    None, a short list of ints): what ``_encode`` would make of it, without building
    the capped value; None for anything else (the general path)."""
    t = type(v)
    if t is str:
        return _str_json(v)  # type: ignore[arg-type]
    if t is int:
        return int.__repr__(v)  # type: ignore[arg-type]
    if v is None:
        return "null"
    if t is bool:
        return "true" if v else "false"
    if (t is list or t is tuple) and len(v) <= MAX_ITEMS:  # type: ignore[arg-type]
        for x in v:  # type: ignore[attr-defined]
            if type(x) is not int:
                return None
        return "[" + ",".join(map(int.__repr__, v)) + "]"  # type: ignore[call-overload]
    return None


_STANDARD = frozenset({"schema_version", "timestamp", "session", "run", "operation", "target", "result", "policy",
                       "reason"})
_KEY_JSON: dict[str, str] = {}


def plain_fields(items: Iterable[tuple[str, object]], *, extra: bool = True) -> str | None:
    """``,"key":value`` for each field, as a line holds it, when every value is plain
    (``_plain_json``); None when one is not, or (``extra``) when a key is a standard
    field's or ``argv``/``env`` (the general path refuses or redacts those)."""
    out = []
    for k, v in items:
        if extra and (k in _STANDARD or k == "argv" or k == "env"):
            return None
        kj = _KEY_JSON.get(k)
        if kj is None:
            kj = "," + _json_str(k) + ":"
            if len(_KEY_JSON) < 1024:
                _KEY_JSON[k] = kj
        j = _plain_json(v)
        if j is None:
            return None
        out.append(kj + j)
    return "".join(out)


_second: tuple[int, str] = (-1, "")


def _now() -> str:
    global _second
    t = time.time()
    sec = int(t)
    if _second[0] != sec:  # (an observed run writes thousands of events in one second)
        _second = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
    return _second[1] + f".{int(t * 1000) % 1000:03d}Z"


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class AuditLog:
    """Appends events to a session's ``events.jsonl``."""

    def __init__(self, session: _SessionLike, *, batch: bool = False) -> None:
        self.session_id = session.id
        self.path = session.events_path
        self._head = '{"schema_version":' + str(SCHEMA_VERSION) + ',"timestamp":"'
        self._session_json = '","session":' + _json_str(self.session_id) + ',"run":'
        # batch: events are kept until flush(), which appends them with one write
        self._batch: list[bytes] | None = [] if batch else None

    def render(
        self,
        operation: str,
        target: str,
        result: str,
        /,
        *,
        run: int | None = None,
        policy: str | None = None,
        reason: str | None = None,
        **extra: Any,
    ) -> bytes:
        """One event's line (newline included), as ``event`` appends it: made directly
        when every field is plain (``_render_plain``), else capped, redacted and encoded
        here (the same bytes either way)."""
        line = self._render_plain(operation, target, result, run, policy, reason, extra)
        if line is not None:
            return line
        rec: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "timestamp": _now(),
            "session": self.session_id,
            "run": run,
            "operation": cap(operation),
            "target": cap(target),
            "result": cap(result),
            "policy": cap(policy),
            "reason": cap(reason),
        }
        for k, v in extra.items():
            if k in rec:
                raise ValueError(f"audit: extra field {k!r} collides with a standard field")
            if k == "argv" and isinstance(v, (list, tuple)):
                v = record_argv(str(a) for a in v)
            elif k == "env" and isinstance(v, Mapping):
                v = {n: ("[REDACTED]" if secret_name(str(n)) else val) for n, val in v.items()}
            rec[k] = cap(v)
        data = _encode(rec).encode("utf-8")
        if len(data) + 1 > MAX_LINE:
            for k in sorted(extra, key=lambda k: -len(json.dumps(rec.get(k)))):
                rec[k] = "[truncated]"
                data = json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
                if len(data) + 1 <= MAX_LINE:
                    break
            else:
                rec["target"] = str(rec["target"])[:256]
                rec["reason"] = str(rec["reason"] or "")[:256]
                data = json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return data + b"\n"

    def line_start(self, run: int | None) -> str | None:
        """A line's start up to its run number (``plain_fields`` go after it, then
        ``"}\n"``), stamped now; None for a run number that is not a plain int."""
        if run is None:
            r = "null"
        elif type(run) is int:
            r = int.__repr__(run)
        else:
            return None
        return self._head + _now() + self._session_json + r

    def _render_plain(self, operation: str, target: str, result: str, run: int | None, policy: str | None,
                      reason: str | None, extra: Mapping[str, object]) -> bytes | None:
        """``render``'s very line, made directly when every field is a plain value (an
        observed run writes thousands of events); None: the general path."""
        start = self.line_start(run)
        std = plain_fields((("operation", operation), ("target", target), ("result", result), ("policy", policy),
                            ("reason", reason)), extra=False)
        more = plain_fields(extra.items())
        if start is None or std is None or more is None:
            return None
        data = (start + std + more + "}\n").encode("utf-8")
        return data if len(data) <= MAX_LINE else None

    def event(self, operation: str, target: str, result: str, /, **fields: Any) -> None:
        """Append one event (``render``'s arguments: run=, policy=, reason= and extras)."""
        self.add(self.render(operation, target, result, **fields))

    def add(self, line: bytes) -> None:
        """Append a line ``render`` made."""
        if self._batch is not None:
            self._batch.append(line)
            return
        self._append(line)

    def flush(self) -> None:
        """Append the batched events (one write: O_APPEND keeps them together)."""
        if self._batch:
            data = b"".join(self._batch)
            self._batch.clear()
            self._append(data)

    def _append(self, data: bytes) -> None:
        from .session.store import write_file

        write_file(str(self.path), data, os.O_APPEND, 0o600)

    # ---- the standard policy events -------------------------------------------------
    def session_start(self, eff: PolicyFacts, *, project: str) -> None:
        self.event("session-start", project, "ok", policy=eff.digest, reason="policy digest",
                   files=[f"{n}:{f}" for n, f in eff.files])

    def run_start(self, run: int, argv: list[str], cwd: str, eff: PolicyFacts) -> None:
        self.event("run", cwd, "started", run=run, policy=eff.digest, argv=argv,
                   read_only=eff.read_only)

    def masked(self, run: int | None, masked: Iterable[MaskedFact], *, relative_to: str | None = None) -> None:
        for m in masked:
            target = str(m.path)
            if relative_to and (target == relative_to or target.startswith(relative_to.rstrip("/") + "/")):
                target = "./" + os.path.relpath(target, relative_to)
            self.event("read", target, "blocked", run=run, policy="sensitive-file-pattern",
                       reason=f"masked: matches {m.rule} ({m.origin or m.source})", is_dir=m.is_dir)

    def env_removed(self, run: int | None, names: Iterable[str]) -> None:
        for n in names:
            self.event("env", n, "blocked", run=run, policy="env-filter", reason="variable removed (name only logged)")

    def command_refused(self, run: int | None, argv: list[str], reason: str) -> None:
        self.event("exec", " ".join(record_argv(argv)), "blocked", run=run, policy="commands.deny", reason=reason)

    def read_only(self, run: int | None, project: str) -> None:
        self.event("write", project, "blocked", run=run, policy="read-only",
                   reason="project mounted read-only: every write fails with EROFS")

    def plan_denials(self, run: int | None, plan: Any) -> None:
        """What this run's plan denies that a program would see only as an errno. The
        kernel gives stockade no per-call record of a Landlock or seccomp denial (its
        audit records, where enabled, go to the host's audit daemon), so these are the
        rules, logged when the run starts."""
        ll = plan.landlock
        if ll is not None and ll.handled_net:
            why = next((n for n in plan.notes if n.startswith("network none:")), "")
            self.event("net", "tcp bind/connect (every address and port)", "blocked", run=run, policy="landlock-net",
                       reason=why + "; calls fail with EACCES")
        for n in getattr(plan, "env_warnings", ()):
            self.event("env", n.split(" ", 1)[0], "info", run=run, policy="env-hidden-path", reason=n)
        if plan.seccomp_name:
            self.event("syscall", f"seccomp profile {plan.seccomp_name}", "blocked", run=run, policy="seccomp",
                       reason="syscalls outside the profile fail with EPERM (unknown ones ENOSYS); the kernel logs "
                              "no per-call record for them: `stockade profiles` and `stockade explain` list the rules")

    def outcome(self, run: int, result: str, **details: Any) -> None:
        self.event("outcome", f"run {run}", result, run=run, **details)


# --------------------------------------------------------------------------- reading


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Events of a stream; a torn last line (writer interrupted) is skipped."""
    try:
        f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        return
    with f:
        for line in f:
            if not line.endswith("\n"):
                return
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec


def is_blocked(rec: Mapping[str, Any]) -> bool:
    if rec.get("operation") == "net-suppressed":  # repeats only counted: blocked ones among them
        counts = rec.get("counts")
        return isinstance(counts, Mapping) and any(str(k).endswith(" blocked") for k in counts)
    return rec.get("result") in BLOCKED_RESULTS


def is_network(rec: Mapping[str, Any]) -> bool:
    """A network event: a connection attempt or DNS name through a run's proxy
    (net-connect, net-dns), or the network rule a run started with (net)."""
    op = str(rec.get("operation", ""))
    return op == "net" or op.startswith("net-")


# printed after `log --blocked-only`: what the log can and cannot hold
BLOCKED_NOTE = (
    "note: these are stockade's own decisions: the rules each run started with, and each connection "
    "and DNS name the proxy of a --net allow run refused (one line each); a single denied call "
    "(Landlock EACCES, seccomp EPERM/ENOSYS) is not reported to stockade by the kernel: "
    "`stockade explain -- CMD` shows the rules, strace -f inside shows the call; a run with --observe "
    "logs each exec, open and connect it tried with the walls' predicted answer (`stockade log --observed`)"
)


def _size(n: Any) -> str:
    try:
        v = float(n)
    except (TypeError, ValueError):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{int(v)} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} GiB"


def _duration(ms: Any) -> str:
    try:
        v = float(ms)
    except (TypeError, ValueError):
        return "?"
    return f"{v:.0f} ms" if v < 1000 else f"{v / 1000:.2f} s"


def _format_net(rec: Mapping[str, Any], head: list[str]) -> str:
    """A proxy's event: ``host:port -> address  ALLOWED  [rule]  how, bytes, time  reason``."""
    target = str(rec.get("target", ""))
    if rec.get("address"):
        target += f" -> {rec['address']}"
    parts = [*head, target, str(rec.get("result", "")).upper()]
    if rec.get("policy"):
        parts.append(f"[{rec['policy']}]")
    facts = [str(rec["kind"])] if rec.get("kind") and rec.get("operation") != "net-dns" else []
    if rec.get("url"):
        facts.append(str(rec["url"]))
    if rec.get("operation") == "net-connect" and (rec.get("bytes_out") or rec.get("bytes_in")):
        facts.append(f"{_size(rec.get('bytes_out') or 0)} out, {_size(rec.get('bytes_in') or 0)} in")
    if rec.get("operation") == "net-connect" and rec.get("duration_ms") is not None:
        facts.append(_duration(rec["duration_ms"]))
    if facts:
        parts.append(", ".join(facts))
    if rec.get("reason"):
        parts.append(str(rec["reason"]))
    return "  ".join(parts)


def format_event(rec: Mapping[str, Any]) -> str:
    """One event as one line of text; what the sandbox chose (a path, an address, an
    argument) is escaped so that it cannot forge a line or drive the terminal."""
    return terminal_safe(_format_event(rec))


def _format_event(rec: Mapping[str, Any]) -> str:
    ts = str(rec.get("timestamp", ""))
    run = rec.get("run")
    if rec.get("operation") in ("net-connect", "net-dns"):
        return _format_net(rec, [ts, f"run {run}" if run is not None else "-", str(rec["operation"])])
    if rec.get("operation") == "net-suppressed" and isinstance(rec.get("counts"), Mapping):
        # which targets' repeats were only counted, and how many
        counts = ", ".join(f"{k} {v}x" for k, v in rec["counts"].items())
        rec = {**rec, "reason": f"{rec.get('reason') or ''}: {counts}" if counts else rec.get("reason")}
    parts = [ts, f"run {run}" if run is not None else "-", str(rec.get("operation", "")),
             str(rec.get("target", "")), str(rec.get("result", "")).upper()]
    if rec.get("policy"):
        parts.append(f"[{rec['policy']}]")
    line = "  ".join(parts)
    if rec.get("reason"):
        line += f"  {rec['reason']}"
    if rec.get("argv"):
        line += "  argv=" + json.dumps(rec["argv"])
    return line


def follow(path: Path, *, poll: float = 0.2, stop: Any = None) -> Iterator[dict[str, Any]]:
    """Yield events as they are appended (``tail -f``); starts at the beginning."""
    buf = b""
    pos = 0
    while stop is None or not stop():
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        if chunk:
            pos += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    yield rec
        else:
            time.sleep(poll)
