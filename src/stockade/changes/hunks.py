"""A file's text change as hunks, and the content made of the old side plus chosen hunks.

The hunks are exactly those of the unified diff (``diff.unified_hunks``: difflib's
grouped opcodes over lines, 3 lines of context), so a reviewer who takes hunk 2 of what
the page or ``stockade diff`` shows gets that hunk. ``merge(old, new, take)`` starts from
``old`` and replaces each changed region of a taken hunk with its ``new`` lines: taking
every hunk gives ``new``, taking none gives ``old``, byte for byte (lines keep their own
endings, so a missing newline at the end is kept as it is on the side it comes from)."""

from __future__ import annotations

import difflib
from collections.abc import Collection
from dataclasses import dataclass

CONTEXT = 3


@dataclass(frozen=True)
class Hunk:
    index: int
    old_start: int  # 0-based first line of the old side shown (context included)
    old_count: int
    new_start: int
    new_count: int
    # (' ' | '-' | '+', line with its ending) in display order
    lines: tuple[tuple[str, bytes], ...]

    @property
    def header(self) -> str:
        def rng(start: int, n: int) -> str:
            return f"{start + (1 if n else 0)}" + ("" if n == 1 else f",{n}")

        return f"@@ -{rng(self.old_start, self.old_count)} +{rng(self.new_start, self.new_count)} @@"


Opcode = tuple[str, int, int, int, int]


def _split(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def _groups(al: list[bytes], bl: list[bytes], context: int) -> list[list[Opcode]]:
    sm = difflib.SequenceMatcher(None, al, bl, autojunk=False)
    if al == bl:
        return []
    return [list(g) for g in sm.get_grouped_opcodes(context)]


def hunks(old: bytes, new: bytes, context: int = CONTEXT) -> list[Hunk]:
    """The hunks of old -> new, numbered from 0."""
    al, bl = _split(old), _split(new)
    out: list[Hunk] = []
    for n, group in enumerate(_groups(al, bl, context)):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        lines: list[tuple[str, bytes]] = []
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                lines += [(" ", line) for line in al[x1:x2]]
                continue
            lines += [("-", line) for line in al[x1:x2]]
            lines += [("+", line) for line in bl[y1:y2]]
        out.append(Hunk(n, i1, i2 - i1, j1, j2 - j1, tuple(lines)))
    return out


def merge(old: bytes, new: bytes, take: Collection[int], context: int = CONTEXT) -> bytes:
    """``old`` with the changes of the hunks numbered in ``take`` made; the others left out.
    A number that names no hunk is a ValueError (the caller's view of the file is stale)."""
    al, bl = _split(old), _split(new)
    groups = _groups(al, bl, context)
    bad = [t for t in take if not 0 <= t < len(groups)]
    if bad:
        raise ValueError(f"no hunk {bad[0]} (the file has {len(groups)})")
    chosen = set(take)
    out: list[bytes] = []
    pos = 0  # next old line not yet copied
    for n, group in enumerate(groups):
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                continue
            out += al[pos:x1]
            out += bl[y1:y2] if n in chosen else al[x1:x2]
            pos = x2
    out += al[pos:]
    return b"".join(out)
