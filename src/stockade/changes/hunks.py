"""A file's text change as hunks, and the content made of the old side plus chosen hunks.

The hunks are exactly those of the unified diff (``diff.unified_hunks``: difflib's
grouped opcodes over lines, 3 lines of context, both from ``grouped_opcodes``), so a reviewer who takes hunk 2 of what
the page or ``stockade diff`` shows gets that hunk. ``merge(old, new, take)`` starts from
``old`` and replaces each changed region of a taken hunk with its ``new`` lines: taking
every hunk gives ``new``, taking none gives ``old``, byte for byte (lines keep their own
endings, so a missing newline at the end is kept as it is on the side it comes from)."""

from __future__ import annotations

import difflib
from bisect import bisect_left
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


# The pairs of equal lines one search of a diff may look at. difflib's longest-match
# search looks at every pair two sides share, again in each part it splits them into: a
# file of many repeated lines (a command's to write) costs it the square of that or worse
# (2,000 alternating lines took 52 s, and `stockade diff`, the review page and an apply of
# chosen hunks all wait on it). Past this count (about a second), the search again
# between the lines both sides start and end with; then there with the lines that fill
# over 1 % of the new side left out as anchors (difflib's "autojunk" rule: a large file's
# blank lines and braces), taken back where they adjoin a match; past that too, one
# replacement between the common ends. Counted, not timed: the same file gets the same
# hunks on every machine, so hunk N shown is hunk N applied.
MATCH_BUDGET = 8_000_000


class _TooCostly(Exception):
    pass


class _Matcher(difflib.SequenceMatcher[bytes]):
    """difflib's matcher with no junk (every line counts), whose longest-match search
    counts the pairs of equal lines it looks at and gives up past ``MATCH_BUDGET``: the
    same answer as difflib's while it does not, by the same search. ``popular``: lines
    over 1 % of ``b`` (of 200 lines or more) are no anchor, as difflib's autojunk."""

    def __init__(self, a: list[bytes], b: list[bytes], popular: bool = False) -> None:
        self.left = MATCH_BUDGET
        self._al, self._bl = a, b
        b2j: dict[bytes, list[int]] = {}  # (difflib's b2j with no junk: every line's places in b)
        for j, line in enumerate(b):
            b2j.setdefault(line, []).append(j)
        if popular and len(b) >= 200:
            most = len(b) // 100 + 1
            b2j = {line: js for line, js in b2j.items() if len(js) <= most}
        self._b2j = b2j
        super().__init__(None, a, b, autojunk=False)

    def find_longest_match(self, alo: int = 0, ahi: int | None = None, blo: int = 0,
                           bhi: int | None = None) -> difflib.Match:
        a, b, b2j = self._al, self._bl, self._b2j
        ahi = len(a) if ahi is None else ahi
        bhi = len(b) if bhi is None else bhi
        besti, bestj, bestsize = alo, blo, 0
        j2len: dict[int, int] = {}
        left = self.left
        for i in range(alo, ahi):
            js = b2j.get(a[i], ())
            lo, hi = (bisect_left(js, blo), bisect_left(js, bhi)) if js else (0, 0)
            left -= hi - lo + 1
            if left < 0:
                raise _TooCostly
            newj2len: dict[int, int] = {}
            for j in js[lo:hi]:  # (ascending: the first longest match wins, as in difflib)
                k = newj2len[j] = j2len.get(j - 1, 0) + 1
                if k > bestsize:
                    besti, bestj, bestsize = i - k + 1, j - k + 1, k
            j2len = newj2len
        # (difflib's extension over lines that are no anchor; without ``popular`` it
        # never moves: the match found is the longest there is)
        while besti > alo and bestj > blo and a[besti - 1] == b[bestj - 1]:
            besti, bestj, bestsize = besti - 1, bestj - 1, bestsize + 1
        while besti + bestsize < ahi and bestj + bestsize < bhi and a[besti + bestsize] == b[bestj + bestsize]:
            bestsize += 1
        self.left = left - bestsize
        if self.left < 0:
            raise _TooCostly
        return difflib.Match(besti, bestj, bestsize)


def _trimmed(al: list[bytes], bl: list[bytes]) -> list[Opcode]:
    """The lines both sides start and end with kept as they are, and between them the
    matcher's opcodes (every line an anchor, then not the popular ones) while it stays
    within its budget, else one replacement."""
    n = min(len(al), len(bl))
    p = 0
    while p < n and al[p] == bl[p]:
        p += 1
    s = 0
    while s < n - p and al[len(al) - 1 - s] == bl[len(bl) - 1 - s]:
        s += 1
    ae, be = len(al) - s, len(bl) - s
    mid: list[Opcode] = [("replace" if p < ae and p < be else "delete" if p < ae else "insert", p, ae, p, be)]
    for popular in (False, True):
        try:
            found = _Matcher(al[p:ae], bl[p:be], popular).get_opcodes()
        except _TooCostly:
            continue
        mid = [(tag, i1 + p, i2 + p, j1 + p, j2 + p) for tag, i1, i2, j1, j2 in found if i1 < i2 or j1 < j2]
        break
    # (the middle neither starts nor ends equal: the common ends are as long as they go)
    return [*([("equal", 0, p, 0, p)] if p else []), *mid, *([("equal", ae, len(al), be, len(bl))] if s else [])]


def grouped_opcodes(al: list[bytes], bl: list[bytes], context: int = CONTEXT) -> list[list[Opcode]]:
    """The hunks of lines ``al`` -> ``bl`` as difflib's grouped opcodes (``context``
    lines around each change); past ``MATCH_BUDGET``, of ``_trimmed``'s answer. One
    function for the diff shown and the hunks taken, so hunk N is the same in both."""
    if al == bl:
        return []
    sm: difflib.SequenceMatcher[bytes] = _Matcher(al, bl)
    try:
        sm.get_opcodes()
    except _TooCostly:
        sm = _Given(_trimmed(al, bl))
    return [list(g) for g in sm.get_grouped_opcodes(context)]


class _Given(difflib.SequenceMatcher[bytes]):
    """Opcodes made elsewhere, grouped by difflib's own grouping."""

    def __init__(self, codes: list[Opcode]) -> None:
        super().__init__(None, [], [], autojunk=False)
        self._codes = codes

    def get_opcodes(self) -> list[Opcode]:  # type: ignore[override]
        return self._codes


# the last file's lines and hunks: the review page counts a file's hunks, then merges
# the chosen ones (two searches of one file otherwise)
_LAST: tuple[bytes, bytes, int, list[bytes], list[bytes], list[list[Opcode]]] | None = None


def _groups(old: bytes, new: bytes, context: int) -> tuple[list[bytes], list[bytes], list[list[Opcode]]]:
    global _LAST
    last = _LAST
    if last is not None and last[2] == context and last[0] == old and last[1] == new:
        return last[3], last[4], last[5]
    al, bl = _split(old), _split(new)
    groups = grouped_opcodes(al, bl, context)
    _LAST = (old, new, context, al, bl, groups)
    return al, bl, groups


def hunks(old: bytes, new: bytes, context: int = CONTEXT) -> list[Hunk]:
    """The hunks of old -> new, numbered from 0."""
    al, bl, groups = _groups(old, new, context)
    out: list[Hunk] = []
    for n, group in enumerate(groups):
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
    al, bl, groups = _groups(old, new, context)
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
