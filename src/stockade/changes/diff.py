"""git-compatible diffs of a change set (``git apply`` accepts the output).

Formats exactly what git emits for the same change: ``diff --git`` headers with
git's C-style quoting of odd names (core.quotePath=true), ``new file mode`` /
``deleted file mode`` / ``old mode``+``new mode``, full ``index`` lines, unified
hunks with 3 lines of context and ``\\ No newline at end of file``, symlinks as
mode 120000 blobs, type changes as a deletion plus an addition, and binary files
as ``GIT binary patch`` literals (zlib + git's base85, forward and reverse).
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from ..session.idrange import with_sandbox_ids
from ._safefs import Roots
from .hunks import grouped_opcodes
from .model import Change, Changes, Kind

NULL_SHA = "0" * 40

_C_ESCAPES = {
    0x07: b"\\a",
    0x08: b"\\b",
    0x09: b"\\t",
    0x0A: b"\\n",
    0x0B: b"\\v",
    0x0C: b"\\f",
    0x0D: b"\\r",
    0x22: b'\\"',
    0x5C: b"\\\\",
}


def _needs_quote(name: bytes) -> bool:
    return any(b < 0x20 or b >= 0x7F or b in (0x22, 0x5C) for b in name)


def quote_path(prefix: bytes, name: bytes) -> bytes:
    """git's quote_c_style for ``prefix + name`` (quotes only when needed)."""
    full = prefix + name
    if not _needs_quote(full):
        return full
    out = bytearray(b'"')
    for b in full:
        esc = _C_ESCAPES.get(b)
        if esc is not None:
            out += esc
        elif b < 0x20 or b >= 0x7F:
            out += b"\\%03o" % b
        else:
            out.append(b)
    out += b'"'
    return bytes(out)


def git_mode(mode: int) -> int:
    if stat.S_ISLNK(mode):
        return 0o120000
    if stat.S_ISDIR(mode):
        return 0o040000
    return 0o100755 if mode & stat.S_IXUSR else 0o100644


def blob_sha(data: bytes) -> str:
    h = hashlib.sha1(b"blob %d\0" % len(data), usedforsecurity=False)
    h.update(data)
    return h.hexdigest()


def is_binary(data: bytes) -> bool:
    return b"\0" in data[:8000]


# ---- git base85 binary literals ---------------------------------------------------


def _len_char(n: int) -> bytes:
    return bytes([ord("A") + n - 1]) if n <= 26 else bytes([ord("a") + n - 27])


def binary_literal(data: bytes) -> bytes:
    """``literal N`` block: zlib-deflated data in git's base85 lines of <= 52 bytes."""
    z = zlib.compress(data, 9)
    out = [b"literal %d\n" % len(data)]
    for i in range(0, len(z), 52):
        chunk = z[i : i + 52]
        out.append(_len_char(len(chunk)) + base64.b85encode(chunk, pad=True) + b"\n")
    out.append(b"\n")
    return b"".join(out)


def decode_binary_literal(lines: list[bytes]) -> bytes:
    """Inverse of :func:`binary_literal` (for tests and ``export`` self-checks)."""
    raw = bytearray()
    for line in lines:
        if not line:
            continue
        c = line[0]
        n = c - ord("A") + 1 if c <= ord("Z") else c - ord("a") + 27
        raw += base64.b85decode(line[1:])[:n]
    return zlib.decompress(bytes(raw))


# ---- text hunks -----------------------------------------------------------------------


def _range(start: int, length: int) -> bytes:
    beginning = start + 1
    if length == 1:
        return b"%d" % beginning
    if not length:
        beginning -= 1
    return b"%d,%d" % (beginning, length)


def _emit(out: list[bytes], sign: bytes, line: bytes) -> None:
    if line.endswith(b"\n"):
        out.append(sign + line)
    else:
        out.append(sign + line + b"\n\\ No newline at end of file\n")


_FUNC_START = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_$")


def _funcname(lines: list[bytes], start: int) -> bytes:
    """git's default hunk-header context: the nearest earlier line starting with [A-Za-z_$]."""
    for k in range(start - 1, -1, -1):
        line = lines[k]
        if line and line[0] in _FUNC_START:
            text = line[:80].rstrip(b" \t\n\r\v\f")
            return b" " + text
    return b""


def unified_hunks(a: bytes, b: bytes, context: int = 3) -> tuple[list[bytes], int, int]:
    """Unified hunks for a -> b, plus (insertions, deletions)."""
    al = a.splitlines(keepends=True)
    bl = b.splitlines(keepends=True)
    out: list[bytes] = []
    ins = dels = 0
    for group in grouped_opcodes(al, bl, context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(b"@@ -" + _range(i1, i2 - i1) + b" +" + _range(j1, j2 - j1) + b" @@"
                   + _funcname(al, i1) + b"\n")
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                for line in al[x1:x2]:
                    _emit(out, b" ", line)
                continue
            if tag in ("replace", "delete"):
                for line in al[x1:x2]:
                    _emit(out, b"-", line)
                    dels += 1
            if tag in ("replace", "insert"):
                for line in bl[y1:y2]:
                    _emit(out, b"+", line)
                    ins += 1
    return out, ins, dels


# ---- per-change rendering ------------------------------------------------------------


@dataclass
class FileDiff:
    path: str
    text: bytes
    insertions: int
    deletions: int
    binary: bool
    old_size: int
    new_size: int


class _Reader(Roots):
    def __init__(self, cs: Changes) -> None:
        super().__init__(cs.project, cs.session.lower_stack())
        self.cs = cs

    def old(self, c: Change, limit: int | None = None) -> bytes:
        assert c.old_mode is not None
        if stat.S_ISLNK(c.old_mode):
            return os.fsencode(self.host.readlink(c.path))
        return self.host.read_bytes(c.path, limit)

    def new(self, c: Change, limit: int | None = None) -> bytes:
        assert c.new_mode is not None
        r = self.layer(c.layer)
        if stat.S_ISLNK(c.new_mode):
            return os.fsencode(r.readlink(c.path))
        return r.read_bytes(c.path, limit)


def _is_blob(mode: int | None) -> bool:
    return mode is not None and (stat.S_ISREG(mode) or stat.S_ISLNK(mode))


def _header(path: bytes) -> bytes:
    return b"diff --git " + quote_path(b"a/", path) + b" " + quote_path(b"b/", path) + b"\n"


def _body(
    path: bytes, old: bytes | None, new: bytes | None, old_mode: int | None, new_mode: int | None
) -> FileDiff:
    out = [_header(path)]
    om = git_mode(old_mode) if old_mode is not None else 0
    nm = git_mode(new_mode) if new_mode is not None else 0
    if old is None:
        out.append(b"new file mode %o\n" % nm)
    elif new is None:
        out.append(b"deleted file mode %o\n" % om)
    elif om != nm:
        out.append(b"old mode %o\nnew mode %o\n" % (om, nm))
    osha = NULL_SHA if old is None else blob_sha(old)
    nsha = NULL_SHA if new is None else blob_sha(new)
    binary = is_binary(old or b"") or is_binary(new or b"")
    ins = dels = 0
    name = os.fsdecode(path)
    if osha == nsha:  # mode-only change
        return FileDiff(name, b"".join(out), 0, 0, False, len(old or b""), len(new or b""))
    idx = b"index " + osha.encode() + b".." + nsha.encode()
    if old is not None and new is not None and om == nm:
        idx += b" %o" % om
    out.append(idx + b"\n")
    if (old or b"") == b"" and (new or b"") == b"" and not binary:
        # empty file created or deleted: no hunk at all (what git prints)
        return FileDiff(name, b"".join(out), 0, 0, False, 0, 0)
    a_name = b"/dev/null" if old is None else quote_path(b"a/", path)
    b_name = b"/dev/null" if new is None else quote_path(b"b/", path)
    if binary:
        out.append(b"GIT binary patch\n")
        out.append(binary_literal(new or b""))
        out.append(binary_literal(old or b""))
    else:
        tab = b"\t" if b" " in path else b""  # git marks names with spaces this way
        out.append(b"--- " + a_name + tab + b"\n+++ " + b_name + tab + b"\n")
        hunks, ins, dels = unified_hunks(old or b"", new or b"")
        out.extend(hunks)
    return FileDiff(name, b"".join(out), ins, dels, binary, len(old or b""), len(new or b""))


def file_diffs(cs: Changes, changes: Iterable[Change]) -> list[FileDiff]:
    """Per-path diffs for the blob changes among ``changes`` (directories have none)."""
    rd = _Reader(cs)
    out: list[FileDiff] = []
    try:
        for c in changes:
            if c.kind is Kind.REFUSED:
                continue
            old_blob = _is_blob(c.old_mode)
            new_blob = _is_blob(c.new_mode)
            if not old_blob and not new_blob:
                continue
            path = os.fsencode(c.path)
            old = rd.old(c) if old_blob else None
            new = rd.new(c) if new_blob else None
            if old is not None and new is not None and (
                stat.S_IFMT(c.old_mode or 0) != stat.S_IFMT(c.new_mode or 0)
            ):
                # file <-> symlink: git shows a deletion and an addition
                out.append(_body(path, old, None, c.old_mode, None))
                out.append(_body(path, None, new, None, c.new_mode))
            else:
                out.append(_body(path, old, new, c.old_mode if old_blob else None,
                                 c.new_mode if new_blob else None))
    finally:
        rd.close()
    return out


# ---- colour -----------------------------------------------------------------------

_BOLD, _RED, _GREEN, _CYAN, _RESET = b"\x1b[1m", b"\x1b[31m", b"\x1b[32m", b"\x1b[36m", b"\x1b[m"


def colorize(text: bytes) -> bytes:
    out = []
    in_header = False
    for line in text.splitlines(keepends=True):
        body, nl = (line[:-1], b"\n") if line.endswith(b"\n") else (line, b"")
        if body.startswith(b"diff --git "):
            in_header = True
        if in_header and body.startswith(b"@@"):
            in_header = False
        if in_header:
            out.append(_BOLD + body + _RESET + nl)
        elif body.startswith(b"@@"):
            end = body.find(b"@@", 2)
            out.append(_CYAN + body[: end + 2] + _RESET + body[end + 2 :] + nl)
        elif body.startswith(b"+"):
            out.append(_GREEN + body + _RESET + nl)
        elif body.startswith(b"-"):
            out.append(_RED + body + _RESET + nl)
        else:
            out.append(line)
    return b"".join(out)


@with_sandbox_ids(retry=True)
def render_diff(cs: Changes, changes: Iterable[Change], *, color: bool = False) -> bytes:
    text = b"".join(d.text for d in file_diffs(cs, changes))
    return colorize(text) if color else text


@with_sandbox_ids(retry=True)
def render_stat(cs: Changes, changes: Iterable[Change], width: int = 80) -> str:
    """``git diff --stat`` style summary."""
    diffs = file_diffs(cs, changes)
    if not diffs:
        return ""
    # merge the two halves of a type change
    merged: dict[str, list[FileDiff]] = {}
    for d in diffs:
        merged.setdefault(d.path, []).append(d)
    rows: list[tuple[str, str, int]] = []
    ins_total = del_total = 0
    for path, ds in merged.items():
        name = quote_path(b"", os.fsencode(path)).decode("utf-8", "backslashreplace")
        if any(d.binary for d in ds):
            rows.append((name, f"Bin {ds[0].old_size} -> {ds[-1].new_size} bytes", 0))
            continue
        i = sum(d.insertions for d in ds)
        dl = sum(d.deletions for d in ds)
        ins_total += i
        del_total += dl
        rows.append((name, f"{i + dl}", i + dl))
        rows[-1] = (name, f"{i + dl} " + "+" * i + "-" * dl, i + dl)
    name_w = max(len(r[0]) for r in rows)
    max_changes = max(r[2] for r in rows)
    num_w = len(str(max_changes)) if max_changes else 1
    graph_w = max(10, width - name_w - num_w - 5)
    lines = []
    for path, ds in merged.items():
        name = quote_path(b"", os.fsencode(path)).decode("utf-8", "backslashreplace")
        if any(d.binary for d in ds):
            lines.append(f" {name.ljust(name_w)} | Bin {ds[0].old_size} -> {ds[-1].new_size} bytes")
            continue
        i = sum(d.insertions for d in ds)
        dl = sum(d.deletions for d in ds)
        total = i + dl
        if total > graph_w:
            scale = graph_w / max_changes
            pi, pd = int(i * scale + 0.5), int(dl * scale + 0.5)
        else:
            pi, pd = i, dl
        lines.append(f" {name.ljust(name_w)} | {str(total).rjust(num_w)} {'+' * pi}{'-' * pd}".rstrip())
    n = len(merged)
    summary = f" {n} file{'s' if n != 1 else ''} changed"
    if ins_total:
        summary += f", {ins_total} insertion{'s' if ins_total != 1 else ''}(+)"
    if del_total:
        summary += f", {del_total} deletion{'s' if del_total != 1 else ''}(-)"
    if not ins_total and not del_total:
        summary += ", 0 insertions(+), 0 deletions(-)"
    lines.append(summary)
    return "\n".join(lines) + "\n"


@with_sandbox_ids(retry=True)
def read_sides(cs: Changes, c: Change, limit: int | None = None) -> tuple[bytes | None, bytes | None]:
    """(old, new) content of a change's blobs (a file's bytes, a symlink's target), None for
    a side that is absent or no blob, or larger than ``limit`` bytes (then not read)."""
    rd = _Reader(cs)
    cap = None if limit is None else limit + 1  # (a file that grew past the limit since: not read whole)
    try:
        old = new = None
        if _is_blob(c.old_mode):
            st = rd.host.lstat(c.path)
            if limit is None or st is None or st.st_size <= limit:
                old = rd.old(c, cap)
        if _is_blob(c.new_mode) and (limit is None or c.size <= limit):
            new = rd.new(c, cap)
        if limit is not None:
            old = None if old is not None and len(old) > limit else old
            new = None if new is not None and len(new) > limit else new
        return old, new
    finally:
        rd.close()
