"""Secrets in what stockade records and prints: a command line (``record_argv``) and
any string (``redact_text``). Below both the plan (``explain`` prints the command as
the records keep it) and the audit log, which import it."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from . import _tokens

_SECRET_NAME_GLOBS = (
    "*KEY", "*SECRET*", "*TOKEN*", "*PASSWORD*", "*PASSWD*", "*CREDENTIAL*", "*AUTH*", "AWS_*", "GITHUB_*",
)
_ASSIGN = re.compile(r"^(-{0,2})([A-Za-z_][A-Za-z0-9_.-]*)([=:])(.+)$", re.S)
_FLAG = re.compile(r"^-{1,2}([A-Za-z][A-Za-z0-9_-]*)$")
_HEADER = re.compile(r"(?i)\b(authorization|proxy-authorization|x-api-key|cookie)\s*:\s*\S.*")


def secret_name(name: str) -> bool:
    """Does a variable or flag name look like it holds a secret?"""
    up = name.upper().replace("-", "_").lstrip("_")
    return any(fnmatch.fnmatchcase(up, g) for g in _SECRET_NAME_GLOBS) and up not in {"KEY", "AUTHOR", "AUTHORS"}


_ANY_SECRET: re.Pattern[str] | None = None


def _any_secret() -> re.Pattern[str]:
    """One regex that finds whatever a redaction pattern would."""
    global _ANY_SECRET
    if _ANY_SECRET is None:
        alts = [f"(?:{src})" for _label, src in _tokens.SOURCES]
        alts.append(r"(?i:\b(?:authorization|proxy-authorization|x-api-key|cookie)\s*:\s*\S)")
        _ANY_SECRET = re.compile("|".join(alts))
    return _ANY_SECRET


# strings already checked (the same operations, paths, digests and reasons recur in
# every run of a process): string -> its redacted form
_REDACTED: dict[str, str] = {}
_REDACTED_MAX = 4096
_REDACTED_LEN = 512


def redact_text(s: str) -> str:
    """Replace token-looking substrings of ``s``."""
    hit = _REDACTED.get(s)
    if hit is not None:
        return hit
    out = _redact(s)
    if len(s) <= _REDACTED_LEN:
        if len(_REDACTED) >= _REDACTED_MAX:
            _REDACTED.clear()
        _REDACTED[s] = out
    return out


def _redact(s: str) -> str:
    if not _tokens.may_hold_secret(s) or _any_secret().search(s) is None:
        return s
    for label, rx in _tokens.patterns():
        if label == "url-password":
            s = rx.sub(lambda m: re.sub(r":[^/\s:@]+@$", ":[REDACTED]@", m.group(0)), s)
        else:
            s = rx.sub(f"[REDACTED:{label}]", s)
    return _HEADER.sub(lambda m: f"{m.group(1)}: [REDACTED]", s)


def printable(s: str) -> str:
    """``s`` as valid Unicode: bytes of an argument or path that were not UTF-8
    (``os.fsdecode``'s surrogate escapes) become ``\\xNN`` text, so that a record
    always encodes, prints and parses."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        pass
    try:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte (API callers)
        return s.encode("utf-8", "backslashreplace").decode("utf-8")



# what a terminal would act on rather than show: C0 controls (newline, CR, ESC starts an
# escape sequence), DEL, C1 controls (U+009B is a one-character CSI to some terminals),
# and the Unicode line separators and bidi overrides that reorder or split what is shown
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m.group(0)
    short = _SHORT.get(c)
    if short is not None:
        return short
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def terminal_safe(s: str) -> str:
    """``s`` as one line a terminal shows as it is: what the sandbox chose (a path it
    opened, an address, an argument) can hold a newline that forges a line of the
    report, or an escape sequence that rewrites the screen. Control characters become
    ``\\n``, ``\\r``, ``\\t`` or ``\\xNN`` (bidi and line-separator characters
    ``\\uNNNN``), bytes that were not UTF-8 ``\\xNN`` (as ``printable``). A backslash
    stays as it is: ``--json`` is the exact form."""
    s = printable(s)
    if s.isprintable() and s.isascii():
        return s
    return _CONTROL.sub(_escape, s)


# inside a shell script argument (``sh -c '...'``): NAME=value, --name=value, --name value
_WORD_ASSIGN = re.compile(r"""(?<![^\s'";&|(])(-{0,2})([A-Za-z_][A-Za-z0-9_.-]*)=("[^"]*"|'[^']*'|[^\s;&|)]+)""")
_WORD_FLAG = re.compile(r"""(?<![^\s'";&|(])(-{1,2})([A-Za-z][A-Za-z0-9_-]*)(\s+)("[^"]*"|'[^']*'|[^\s;&|)-][^\s;&|)]*)""")


def _redact_words(s: str) -> str:
    if "=" in s:
        s = _WORD_ASSIGN.sub(lambda m: f"{m.group(1)}{m.group(2)}=[REDACTED]" if secret_name(m.group(2)) else m.group(0), s)
    if "-" in s:
        s = _WORD_FLAG.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}[REDACTED]" if secret_name(m.group(2)) else m.group(0), s)
    return s


def redact_argv(argv: Iterable[str]) -> list[str]:
    """Redact values of secret-looking ``NAME=value``, ``--name=value`` and ``--name value``
    (as arguments, and as words of an argument that is a script), token formats and URL
    passwords; non-UTF-8 bytes become ``\\xNN`` (``printable``)."""
    out: list[str] = []
    hide_next = False
    for raw in argv:
        arg = printable(raw)
        if hide_next:
            out.append("[REDACTED]")
            hide_next = False
            continue
        m = _ASSIGN.match(arg)
        if m and secret_name(m.group(2)):
            out.append(f"{m.group(1)}{m.group(2)}{m.group(3)}[REDACTED]")
            continue
        f = _FLAG.match(arg)
        if f and secret_name(f.group(1)):
            hide_next = True
        elif any(c.isspace() for c in arg):
            arg = _redact_words(arg)
        out.append(redact_text(arg))
    return out


def record_argv(argv: Iterable[str]) -> list[str]:
    """A command line as every record keeps it (``run.json``, ``events.jsonl``, and
    through them ``stockade status``, ``log`` and ``export``): secrets redacted,
    non-UTF-8 bytes escaped. The one place a record's argv is made."""
    return redact_argv(argv)
