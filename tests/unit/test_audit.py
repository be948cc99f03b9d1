"""Audit log: schema, redaction, caps, torn lines, concurrent appends, formatting."""

from __future__ import annotations

import json
import multiprocessing
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stockade import _tokens, audit, redact


@dataclass(frozen=True)
class FakeSession:
    id: str
    dir: Path

    @property
    def events_path(self) -> Path:
        return self.dir / "events.jsonl"


@pytest.fixture()
def log(tmp_path: Path) -> audit.AuditLog:
    return audit.AuditLog(FakeSession("0101-abcdef", tmp_path))


def _events(log: audit.AuditLog) -> list[dict[str, object]]:
    return list(audit.read_events(log.path))


def test_schema(log: audit.AuditLog) -> None:
    log.event("read", "./.env", "blocked", run=3, policy="sensitive-file-pattern", reason="matches .env", is_dir=False)
    (rec,) = _events(log)
    assert rec["schema_version"] == 1 and rec["session"] == "0101-abcdef" and rec["run"] == 3
    assert rec["operation"] == "read" and rec["target"] == "./.env" and rec["result"] == "blocked"
    assert rec["policy"] == "sensitive-file-pattern" and rec["reason"] == "matches .env" and rec["is_dir"] is False
    assert str(rec["timestamp"]).endswith("Z") and "T" in str(rec["timestamp"])
    assert (log.path.stat().st_mode & 0o777) == 0o600


def test_extra_cannot_override_standard_fields(log: audit.AuditLog) -> None:
    with pytest.raises(ValueError, match="collides"):
        log.event("x", "y", "ok", session="forged")


def test_redaction(log: audit.AuditLog) -> None:
    tok = "ghp_" + "Q" * 36
    log.event("run", "/p", "started", run=1,
              argv=["curl", "-H", "Authorization: Bearer abc.def", "--token", "s3cr3t", "--password=pw1",
                    f"GITHUB_TOKEN={tok}", "https://user:hunter2@host/x", "plain", "--api-key", "k", "--keyboard", "--key", "file.pem"],
              env={"API_TOKEN": "v", "PATH": "/bin"}, reason=f"saw {tok}")
    raw = log.path.read_text()
    for secret in (tok, "s3cr3t", "pw1", "hunter2", "abc.def", '"k"'):
        assert secret not in raw
    (rec,) = _events(log)
    argv = rec["argv"]
    assert isinstance(argv, list)
    assert argv[0] == "curl" and argv[4] == "[REDACTED]" and argv[5] == "--password=[REDACTED]"
    assert argv[6] == "GITHUB_TOKEN=[REDACTED]" and argv[7] == "https://user:[REDACTED]@host/x"
    assert argv[8] == "plain" and argv[10] == "[REDACTED]" and argv[11] == "--keyboard"
    assert argv[12:] == ["--key", "file.pem"]  # a bare --key names a file, not a secret
    assert rec["env"] == {"API_TOKEN": "[REDACTED]", "PATH": "/bin"}
    assert rec["reason"] == "saw [REDACTED:github-token]"


def test_caps(log: audit.AuditLog) -> None:
    log.event("run", "x" * 10_000, "ok", argv=["a"] * 1000, blob={"k": "v" * 100_000})
    (rec,) = _events(log)
    assert len(str(rec["target"])) <= audit.MAX_FIELD
    assert isinstance(rec["argv"], list) and len(rec["argv"]) == audit.MAX_ITEMS + 1
    assert all(len(line) <= audit.MAX_LINE for line in log.path.read_bytes().splitlines())


def test_line_cap_truncates_extras(log: audit.AuditLog) -> None:
    log.event("run", "t", "ok", **{f"f{i}": ["y" * 2000] * 100 for i in range(3)})
    (rec,) = _events(log)
    assert len(log.path.read_bytes()) <= audit.MAX_LINE
    assert "[truncated]" in rec.values()


def test_torn_last_line_is_skipped(log: audit.AuditLog) -> None:
    log.event("a", "t", "ok")
    with open(log.path, "a") as f:
        f.write('{"schema_version": 1, "operation": "b"')
    assert [r["operation"] for r in _events(log)] == ["a"]


def _writer(d: str, n: int) -> None:
    lg = audit.AuditLog(FakeSession("s", Path(d)))
    for i in range(200):
        lg.event("op", f"w{n}-{i}", "ok", pad="z" * 3000)


def test_concurrent_appends_do_not_interleave(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), n)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 800
    assert len({json.loads(x)["target"] for x in lines}) == 800


def test_blocked_filter_and_format(log: audit.AuditLog) -> None:
    log.event("env", "GITHUB_TOKEN", "blocked", run=1, policy="env-filter", reason="removed")
    log.event("run", "/p", "started", run=1, argv=["ls"])
    recs = _events(log)
    assert [audit.is_blocked(r) for r in recs] == [True, False]
    line = audit.format_event(recs[0])
    assert "run 1" in line and "GITHUB_TOKEN" in line and "BLOCKED" in line and "[env-filter]" in line


def test_follow_yields_appended_events(log: audit.AuditLog) -> None:
    log.event("a", "t", "ok")
    seen: list[str] = []

    def stop() -> bool:
        if len(seen) == 1:
            log.event("b", "t", "ok")
        return len(seen) >= 2

    for rec in audit.follow(log.path, poll=0.01, stop=stop):
        seen.append(str(rec["operation"]))
    assert seen == ["a", "b"]


def test_policy_helpers(log: audit.AuditLog, tmp_path: Path) -> None:
    from stockade.policy import Masked

    log.masked(2, [Masked(tmp_path / "p" / ".env", False, ".env", "default", "default")], relative_to=str(tmp_path / "p"))
    log.env_removed(2, ["AWS_SECRET_ACCESS_KEY"])
    log.command_refused(2, ["git", "push", "--token", "t0ken"], "denied by workspace")
    log.read_only(2, "/p")
    recs = _events(log)
    assert [r["target"] for r in recs[:2]] == ["./.env", "AWS_SECRET_ACCESS_KEY"]
    assert all(r["result"] == "blocked" for r in recs)
    assert "t0ken" not in log.path.read_text()


@pytest.mark.parametrize("label,src", _tokens.SOURCES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_needles_cover_every_token_pattern(label: str, src: str, data: st.DataObject) -> None:
    """The redactor's cheap pre-check never skips a string a pattern would redact."""
    s = data.draw(st.from_regex(src))
    assert _tokens.may_hold_secret(s), (label, s)


@given(st.from_regex(r"(?i)(authorization|proxy-authorization|x-api-key|cookie)\s*:\s*\S.*", fullmatch=True))
@settings(max_examples=200, deadline=None)
def test_needles_cover_secret_headers(s: str) -> None:
    assert _tokens.may_hold_secret(s)
    assert redact.redact_text(s) != s


# ---- one redaction for every record (issue #12 item 4) and non-UTF-8 argv (item 18) ----------

# (argv, the secret values it holds): each form a secret takes on a command line
SECRET_ARGVS: list[tuple[list[str], tuple[str, ...]]] = [
    (["mysql", "--password=hunter2"], ("hunter2",)),
    (["gh", "--token", "tok3n55"], ("tok3n55",)),
    (["env", "API_KEY=k3yv4lue", "make"], ("k3yv4lue",)),
    (["git", "clone", "https://bob:pw9zzq@h.example/r.git"], ("pw9zzq",)),
    (["sh", "-c", "deploy DB_PASSWORD=scr1ptpw --auth-token scr1pttok && curl -H 'Authorization: Bearer hdr9x'"],
     ("scr1ptpw", "scr1pttok", "hdr9x")),
    (["sh", "-c", "x --password=\"two words\"; y"], ("two words",)),
]


@pytest.mark.parametrize("argv,secrets", SECRET_ARGVS)
def test_record_argv_redacts_every_form(argv: list[str], secrets: tuple[str, ...]) -> None:
    out = redact.record_argv(argv)
    assert len(out) == len(argv) and out[0] == argv[0]
    for s in secrets:
        assert s not in " ".join(out), out
    assert "[REDACTED]" in " ".join(out)


def test_record_argv_keeps_what_is_no_secret() -> None:
    argv = ["sh", "-c", "make -j4 KEYMAP=us --key file.pem && echo done", "--keyboard", "x=1"]
    assert redact.record_argv(argv) == argv


def test_non_utf8_argv_is_recorded_as_escapes(log: audit.AuditLog) -> None:
    import os

    arg = os.fsdecode(b"\x9b|caf\xc3\xa9")  # a stray byte, then valid UTF-8
    assert redact.record_argv(["echo", arg]) == ["echo", "\\x9b|café"]
    assert redact.printable("\ud800x") == "\\ud800x"  # a lone surrogate an API caller passed
    # every field of an event: argv, target (a path), reason, extras and their keys
    log.event("run", "/p/" + arg, "started", argv=["echo", arg], reason=arg, extra={arg: [arg]})
    (rec,) = _events(log)
    assert rec["argv"] == ["echo", "\\x9b|café"] and rec["target"] == "/p/\\x9b|café"
    assert rec["extra"] == {"\\x9b|café": ["\\x9b|café"]}
    log.path.read_bytes().decode("utf-8")  # the file is valid UTF-8


def test_terminal_safe_escapes_controls_and_undecodable_bytes() -> None:
    import os

    from stockade.redact import terminal_safe

    assert terminal_safe("/usr/lib/x86_64-linux-gnu/libc.so.6") == "/usr/lib/x86_64-linux-gnu/libc.so.6"
    assert terminal_safe("héllo wörld ✓") == "héllo wörld ✓"
    assert terminal_safe("a\nb") == "a\\nb" and terminal_safe("a\rb\tc") == "a\\rb\\tc"
    assert terminal_safe("\x1b[2J\x00\x07\x7f") == "\\x1b[2J\\x00\\x07\\x7f"
    assert terminal_safe("\x85\x9b\x80") == "\\x85\\x9b\\x80"  # C1: U+009B is a CSI to some terminals
    assert terminal_safe("a\u202eb\u2066c\u2028d") == "a\\u202eb\\u2066c\\u2028d"
    assert terminal_safe(os.fsdecode(b"/tmp/\xff\xfe\n")) == "/tmp/\\xff\\xfe\\n"  # not UTF-8
    assert terminal_safe("\ud800") == "\\ud800"  # a lone surrogate that is no escaped byte
    for c in map(chr, range(0x110000)):
        if 0xd800 <= ord(c) <= 0xdfff:
            continue
        out = terminal_safe(c)
        assert all(ord(x) >= 0x20 and not 0x7f <= ord(x) <= 0x9f for x in out), repr(c)


def render_general(log: audit.AuditLog, /, *args: object, **kwargs: object) -> bytes:
    """``render``'s line made by its general path (the plain one turned off)."""
    plain = audit.AuditLog._render_plain
    try:
        audit.AuditLog._render_plain = lambda *a: None  # type: ignore[method-assign,assignment,misc]
        return log.render(*args, **kwargs)  # type: ignore[arg-type]
    finally:
        audit.AuditLog._render_plain = plain  # type: ignore[method-assign]


_plain_values = st.one_of(
    st.text(max_size=40), st.text(min_size=2040, max_size=2100), st.integers(), st.booleans(), st.none(),
    st.lists(st.integers(), max_size=5), st.tuples(st.integers(), st.integers()),
    st.sampled_from(["ghp_" + "a" * 36, "token=hunter2hunter2", "\x1b[31mred\x00", "caf\u00e9 \ud83d\ude00"]),
)
_other_values = st.one_of(st.floats(allow_nan=False), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                          st.lists(st.text(max_size=5), max_size=3), st.just(Path("/a/b")))


@given(fields=st.dictionaries(st.sampled_from(["operation", "target", "result", "policy", "reason"]),
                              st.one_of(st.text(max_size=30), st.none(), st.integers()), max_size=5),
       extra=st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in audit._STANDARD),
                             st.one_of(_plain_values, _other_values), max_size=6),
       run=st.one_of(st.none(), st.integers(0, 10**6)))
@settings(max_examples=300, deadline=None)
@example(fields={}, extra={"log": None}, run=None)  # an extra named like a parameter (CI found it)
@example(fields={}, extra={"self": 1, "fields": 2}, run=1)
def test_plain_lines_are_the_general_path_lines(tmp_path_factory: pytest.TempPathFactory,
                                                fields: dict[str, object], extra: dict[str, object],
                                                run: int | None) -> None:
    """The direct renderer of plain events writes, byte for byte, what the general path
    (capped and redacted values, json's encoder) writes, or leaves the event to it."""
    log = audit.AuditLog(FakeSession("0101-abcdef", tmp_path_factory.getbasetemp()))
    args = {"operation": "observed-open", "target": "/usr/lib/x", "result": "allowed", **fields}
    now = audit._now
    try:
        audit._now = lambda: "2026-01-01T00:00:00.000Z"  # one timestamp for both
        general = render_general(log, args["operation"], args["target"], args["result"], run=run,
                                 policy=args.get("policy"), reason=args.get("reason"), **extra)
        plain = log._render_plain(args["operation"], args["target"], args["result"], run,  # type: ignore[arg-type]
                                  args.get("policy"), args.get("reason"), extra)  # type: ignore[arg-type]
    finally:
        audit._now = now
    assert plain is None or plain == general
    if all(audit._plain_json(v) is not None for v in (*args.values(), *extra.values())) and len(general) < 60000:
        assert plain == general  # a plain event takes the direct path


def test_observed_event_takes_the_direct_path(log: audit.AuditLog) -> None:
    ev = {"access": "read", "syscall": "openat", "count": 3, "host_pids": [10, 11], "basis": "predicted"}
    assert log._render_plain("observed-open", "/usr/lib/x", "allowed", 2, "view", "system directory", ev) is not None
    (rec,) = [json.loads(log.render("observed-open", "/usr/lib/x", "allowed", run=2, policy="view",
                                    reason="ghp_" + "a" * 36, **ev))]
    assert rec["host_pids"] == [10, 11] and "ghp_" not in json.dumps(rec)
