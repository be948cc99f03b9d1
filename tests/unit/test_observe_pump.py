"""Observe mode's records are taken on the supervisor's own timer: every PUMP_EVERY
while they come, slowing down to PUMP_IDLE while the command is quiet, and not at all
once init is gone (the run's end takes the rest)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from stockade.core import supervise
from stockade.core.supervise import PUMP_EVERY, PUMP_IDLE, Supervisor


class Feed:
    def __init__(self, batches: list[bool]) -> None:
        self.batches = batches
        self.calls = 0

    def pump(self) -> bool:
        self.calls += 1
        return self.batches.pop(0) if self.batches else False


def test_the_timer_follows_the_records() -> None:
    feed = Feed([True, True, False, False, False, True])
    sup = SimpleNamespace(observe=feed, init_done=False, _pump_at=None, _pump_every=PUMP_EVERY)
    due = Supervisor._pump_due
    t = 100.0
    at = due(sup, t)  # type: ignore[arg-type]
    assert at == t + PUMP_EVERY and feed.calls == 0  # armed, nothing taken yet
    gaps = []
    for _ in range(6):
        t = at
        nxt = due(sup, t)  # type: ignore[arg-type]
        assert nxt is not None
        gaps.append(round(nxt - t, 6))
        at = nxt
    assert feed.calls == 6
    assert gaps == [PUMP_EVERY, PUMP_EVERY, 2 * PUMP_EVERY, 4 * PUMP_EVERY, 8 * PUMP_EVERY, PUMP_EVERY]
    assert due(sup, at - 0.001) == at and feed.calls == 6  # not yet due: nothing taken
    for _ in range(20):  # a long quiet spell: the timer slows down to PUMP_IDLE, no further
        t = at
        at = due(sup, t)  # type: ignore[arg-type]
        assert at is not None
    assert round(at - t, 6) == PUMP_IDLE
    sup.init_done = True
    calls = feed.calls
    assert due(sup, at + 10) is None and feed.calls == calls  # init gone: the end takes the rest
    assert supervise.PUMP_EVERY < supervise.PUMP_IDLE


def test_a_session_is_marked_observed_and_its_meta_read_again_only_when_rewritten(tmp_path: Path) -> None:
    """Every observed run marks its session (kept for its log); a run of a session this
    process marked reads its meta.json again only when it is not the file marked (a
    rewrite without the mark, a session made again under the name)."""
    from stockade.core import observe as cobs
    from stockade.session import store

    sess = store.Session("s1", tmp_path / "s1")
    sess.dir.mkdir()
    store.write_json_atomic(sess.meta_path, {"project": "/p"})
    reads = []
    real_meta = store.Session.meta

    def meta(self: store.Session) -> dict[str, object]:
        reads.append(1)
        return real_meta(self)

    def mark() -> None:
        ro = object.__new__(cobs.RunObserve)
        ro._sess = sess
        ro._marked = False
        with mock.patch.object(store.Session, "meta", meta):
            ro._mark_session()

    mark()
    assert sess.meta().get("observed") is True and reads
    n = len(reads)
    mark()
    assert len(reads) == n  # the file marked: not read again
    store.write_json_atomic(sess.meta_path, {"project": "/p"})  # rewritten without the mark
    mark()
    assert sess.meta().get("observed") is True and len(reads) > n
