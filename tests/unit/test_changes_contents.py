"""The review page's engine parts: hunks and their merge, ``apply_changes(contents=, expect=)``
(replacement bytes journaled, conflict-checked, undone after a crash, rolled back), and the
review package's place on top of the layers."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.changes import hunks as H
from stockade.changes.apply import StaleChangeSet, apply_changes
from stockade.changes.diff import unified_hunks
from stockade.changes.fingerprint import fingerprint
from stockade.changes.journal import applies_dir
from stockade.changes.recovery import recover_pending
from stockade.changes.rollback import rollback
from stockade.changes.scan import scan
from stockade.errors import UsageError
from tests.conftest import ROOT
from tests.unit.test_changes_support import Builder, overlay_shell, tree_snapshot

# ---- hunks -----------------------------------------------------------------------------------

OLD = b"".join(b"line %d\n" % i for i in range(1, 41))
NEW = OLD.replace(b"line 2\n", b"LINE 2\n").replace(b"line 20\n", b"LINE 20\nextra\n").replace(b"line 39\n", b"")


def test_hunks_are_the_diffs_hunks_and_merge_takes_each_exactly() -> None:
    hs = H.hunks(OLD, NEW)
    assert len(hs) == 3
    diff_headers = [line for line in unified_hunks(OLD, NEW)[0] if line.startswith(b"@@")]
    assert [h.header.encode() for h in hs] == [d.split(b" @@")[0] + b" @@" for d in diff_headers]
    assert H.merge(OLD, NEW, [0, 1, 2]) == NEW
    assert H.merge(OLD, NEW, []) == OLD
    assert H.merge(OLD, NEW, [0, 2]) == OLD.replace(b"line 2\n", b"LINE 2\n").replace(b"line 39\n", b"")
    assert H.merge(OLD, NEW, [1]) == OLD.replace(b"line 20\n", b"LINE 20\nextra\n")
    with pytest.raises(ValueError, match="no hunk 3"):
        H.merge(OLD, NEW, [3])
    assert H.hunks(OLD, OLD) == [] and H.merge(OLD, OLD, []) == OLD


def test_a_missing_newline_at_the_end_stays_with_its_side() -> None:
    old, new = b"a\nb\nc\nd\ne\nf\ng\nh\ni\nlast", b"A\nb\nc\nd\ne\nf\ng\nh\ni\nlast\n"
    assert len(H.hunks(old, new)) == 2
    assert H.merge(old, new, [0]) == b"A\nb\nc\nd\ne\nf\ng\nh\ni\nlast"
    assert H.merge(old, new, [1]) == b"a\nb\nc\nd\ne\nf\ng\nh\ni\nlast\n"


lines = st.lists(st.sampled_from([b"a\n", b"b\n", b"c\n", b"d\n", b"e", b"\n", b"x\r\n"]), max_size=40)


@settings(max_examples=300, deadline=None)
@given(lines, lines, st.data())
def test_merge_properties(a: list[bytes], b: list[bytes], data: st.DataObject) -> None:
    old, new = b"".join(a), b"".join(b)
    n = len(H.hunks(old, new))
    assert H.merge(old, new, range(n)) == new
    assert H.merge(old, new, []) == old
    take = data.draw(st.sets(st.integers(0, max(n - 1, 0))) if n else st.just(set()))
    mid = H.merge(old, new, take)
    # what was taken and what was not add up: from the merge, the rest of the way is the others
    rest = H.hunks(mid, new)
    assert len(rest) <= n - len(take) or n == 0
    assert H.merge(mid, new, range(len(rest))) == new


@settings(max_examples=300, deadline=None)
@given(lines, lines)
def test_the_bounded_matcher_answers_as_difflib(a: list[bytes], b: list[bytes]) -> None:
    """Within its budget the diff's matcher is difflib's, hunk for hunk."""
    import difflib

    want = [list(g) for g in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(3)] \
        if a != b else []
    assert H.grouped_opcodes(a, b, 3) == want


def _searches_over_budget(mp: pytest.MonkeyPatch) -> list[H._Matcher]:
    """The searches that gave up at their budget, from now on (the last file's hunks
    forgotten: every file is searched)."""
    raised: list[H._Matcher] = []
    real = H._Matcher.find_longest_match

    def counted(self: H._Matcher, *args: int) -> object:
        try:
            return real(self, *args)
        except H._TooCostly:
            raised.append(self)
            raise

    mp.setattr(H, "_LAST", None)
    mp.setattr(H._Matcher, "find_longest_match", counted)
    return raised


@pytest.mark.parametrize("ends", [False, True])
def test_a_diff_of_many_repeated_lines_is_bounded_and_still_exact(ends: bool) -> None:
    """Lines two sides share many times over (a command's to write: 2,000 alternating
    lines cost difflib 52 s) stop the search at its budget, counted in pairs of equal
    lines looked at, not in time: then the search runs again between the lines both
    sides start and end with, and past the budget there too, one replacement between
    them. Either way the hunks are a diff: all taken give the new side, none the old, and
    the diff shown has the hunks an apply takes."""
    body_a = b"".join(b"x\n" if i % 2 else b"y\n" for i in range(3000))
    body_b = b"".join(b"y\n" if i % 3 else b"x\n" for i in range(3000))
    old, new = (b"head\n" + body_a + b"tail\n", b"head\n" + body_b + b"tail\n") if ends else (body_a, body_b)
    with pytest.MonkeyPatch.context() as mp:
        raised = _searches_over_budget(mp)
        mp.setattr(H, "MATCH_BUDGET", 100_000)  # (the default bound, 80 times this, is reached the same way)
        hs = H.hunks(old, new)
        diff_headers = [line for line in unified_hunks(old, new)[0] if line.startswith(b"@@")]
    assert len(raised) >= 2  # (the whole, then the part between the common ends, over budget)
    assert H.merge(old, new, range(len(hs))) == new and H.merge(old, new, []) == old
    assert [h.header.encode() for h in hs] == [d.split(b" @@")[0] + b" @@" for d in diff_headers]
    if ends:
        assert hs[0].lines[0] == (" ", b"head\n") and hs[-1].lines[-1] == (" ", b"tail\n")


def test_a_large_ordinary_file_keeps_its_hunks_past_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large file whose blank lines and braces alone pass the budget (their pairs are
    the square of their count) is searched again with those lines no anchor (difflib's
    autojunk rule), taken back where they adjoin a match: each edit stays its own hunk."""
    import random

    rnd = random.Random(5)
    a = [b"\n" if (r := rnd.random()) < .08 else b"    }\n" if r < .12 else b"line %d\n" % i for i in range(5000)]
    b = list(a)
    for k in rnd.sample(range(5000), 40):
        b[k] = b"changed %d\n" % k
    old, new = b"".join(a), b"".join(b)
    exact = H.hunks(old, new)  # (within the default budget: difflib's answer)
    monkeypatch.setattr(H, "MATCH_BUDGET", 200_000)  # (400 blank lines a side: 160,000 pairs, and 200 braces)
    raised = _searches_over_budget(monkeypatch)
    hs = H.hunks(old, new)
    assert len(raised) == 2  # the whole and the part between the common ends; not with the popular lines left out
    assert len(hs) == len(exact) and len(hs) <= 40
    assert sum(1 for h in hs for t, _ in h.lines if t == "-") == 40  # one line out per edit, no block replaced
    assert H.merge(old, new, range(len(hs))) == new and H.merge(old, new, []) == old


def test_a_files_hunks_are_searched_once_to_count_and_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review page counts a file's hunks, then merges the chosen ones: one search."""
    calls = []
    real = H.grouped_opcodes
    monkeypatch.setattr(H, "grouped_opcodes", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(H, "_LAST", None)
    assert len(H.hunks(OLD, NEW)) == 3 and H.merge(OLD, NEW, [1]) == OLD.replace(b"line 20\n", b"LINE 20\nextra\n")
    assert len(calls) == 1
    assert H.merge(OLD, NEW + b"more\n", []) == OLD and len(calls) == 2  # another file: searched


def test_a_large_change_near_both_ends_is_searched_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the budget as a whole but not between the lines both sides start and end
    with: the search there gives a real diff (one changed line, not a replacement)."""
    old = b"".join(b"line %d\n" % (i % 50) for i in range(2000))
    new = old.replace(b"line 7\nline 8\n", b"line 7\nLINE 8\n", 1)
    monkeypatch.setattr(H, "MATCH_BUDGET", 200)
    monkeypatch.setattr(H, "_LAST", None)
    hs = H.hunks(old, new)
    assert len(hs) == 1 and [t for t, _ in hs[0].lines].count("-") == 1
    assert H.merge(old, new, [0]) == new


# ---- apply with replacement contents -----------------------------------------------------------


def _changed(tmp_path: Path) -> Builder:
    b = Builder(tmp_path, {"mod": "old\n", "keep": "k\n", "exe": "#!/bin/sh\n"})
    b.new_session()
    overlay_shell(b.session, "echo new > mod; echo added > add; ln -s keep lnk; echo '#!/bin/sh\necho x' > exe; "
                  "chmod 755 exe")
    return b


def test_contents_are_written_journaled_and_rolled_back(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    before = tree_snapshot(b.project)
    cs = scan(b.session)
    only = [c for c in cs.changes if c.path in ("mod", "add", "exe")]
    res = apply_changes(cs, only=only, contents={"mod": b"reviewed\n", "add": b"", "exe": b"#!/bin/sh\n:\n"})
    assert sorted(res.applied) == ["add", "exe", "mod"]
    assert (b.project / "mod").read_bytes() == b"reviewed\n"
    assert (b.project / "add").read_bytes() == b""
    assert (b.project / "exe").read_bytes() == b"#!/bin/sh\n:\n" and (b.project / "exe").stat().st_mode & 0o777 == 0o755
    # kept in the journal, and the entries left the session as with a plain apply
    assert sorted(os.listdir(applies_dir() / str(res.apply_id) / "contents")) == ["0", "1", "2"]
    assert {c.path for c in scan(b.session).changes} == {"lnk"}
    rollback(res.apply_id)
    assert tree_snapshot(b.project) == before
    back = scan(b.session)
    assert {c.path for c in back.changes} == {"mod", "add", "lnk", "exe"}
    assert back.diff(["mod"]).endswith("-old\n+new\n")  # the session's own version came back


def test_contents_only_for_files_that_are_applied(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    before = tree_snapshot(b.project)
    cs = scan(b.session)
    with pytest.raises(UsageError, match="only a regular file's content can be replaced"):
        apply_changes(cs, only=[c for c in cs.changes if c.path == "lnk"], contents={"lnk": b"x"})
    with pytest.raises(UsageError, match="replacement content for keep, which is not applied"):
        apply_changes(cs, only=[c for c in cs.changes if c.path == "mod"], contents={"keep": b"x"})
    with pytest.raises(UsageError, match="replacement content for mod, which is not applied"):
        apply_changes(cs, only=[c for c in cs.changes if c.path == "add"], contents={"mod": b"x"})
    assert tree_snapshot(b.project) == before
    assert len(scan(b.session).changes) == 4


def test_expect_refuses_a_change_set_that_moved_on(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    before = tree_snapshot(b.project)
    cs = scan(b.session)
    seen = fingerprint(cs)
    assert fingerprint(scan(b.session, classify=False)) == seen  # cheap and stable
    overlay_shell(b.session, "echo newer > mod")
    assert fingerprint(scan(b.session)) != seen
    with pytest.raises(StaleChangeSet, match="changed since it was reviewed"):
        apply_changes(cs, only=list(cs.changes), expect=seen)
    assert tree_snapshot(b.project) == before
    # a host-side edit of a changed path moves it too (of another path: not a change, no)
    cs = scan(b.session)
    seen = fingerprint(cs)
    (b.project / "keep").write_text("host\n")
    assert fingerprint(scan(b.session)) == seen
    (b.project / "mod").write_text("host\n")
    assert fingerprint(scan(b.session)) != seen
    with pytest.raises(StaleChangeSet):
        apply_changes(cs, only=[c for c in cs.changes if c.path == "add"], expect=seen)
    res = apply_changes(cs, only=[c for c in cs.changes if c.path == "add"], expect=fingerprint(scan(b.session)))
    assert res.applied == ("add",) and (b.project / "add").read_text() == "added\n"


_CHILD = """
import sys
from stockade.session import store
from stockade.changes.apply import apply_changes
from stockade.changes.scan import scan
cs = scan(store.open_session(sys.argv[1]))
apply_changes(cs, contents={"mod": b"reviewed\\n", "exe": b"#!/bin/sh\\n:\\n"})
"""


def test_sigkill_at_every_step_recovers_with_the_contents(tmp_path: Path, state_dir: Path) -> None:
    n = 1
    while True:
        b = _changed(tmp_path / f"k{n}")
        old = tree_snapshot(b.project)
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "STOCKADE_TEST_CRASH_AFTER": str(n)}
        r = subprocess.run([sys.executable, "-c", _CHILD, b.session.id], env=env, capture_output=True)
        if r.returncode == 0:
            break
        assert r.returncode == -9, r.stderr
        msgs = recover_pending()
        assert msgs
        if "finished" in msgs[0]:
            assert (b.project / "mod").read_bytes() == b"reviewed\n"
            assert (b.project / "exe").read_bytes() == b"#!/bin/sh\n:\n"
            assert scan(b.session).changes == ()
        else:
            assert tree_snapshot(b.project) == old, (n, msgs)
            assert len(scan(b.session).changes) == 4
        n += 1
        assert n < 100
    assert n > 5
    assert (b.project / "mod").read_bytes() == b"reviewed\n"


# ---- the review package sits on top ------------------------------------------------------------

SRC = ROOT / "src" / "stockade"


def test_nothing_below_imports_the_review_page() -> None:
    users = []
    for p in SRC.rglob("*.py"):
        module = ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        if module.startswith(("stockade.review", "stockade.cli", "stockade.mcp")):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if isinstance(node, ast.ImportFrom) and node.level and "review" in (node.module or ""):
                names = ["stockade.review"]
            users += [module for n in names if n == "stockade.review" or n.startswith("stockade.review.")]
    assert not users, users


def test_the_cli_does_not_load_the_web_stack() -> None:
    code = ("import sys; import stockade.cli; from stockade.cli import table; table.parse(['review', 'x']); "
            "table.parse(['run', '--', 'true']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'anyio') "
            "or m.startswith('stockade.review')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
