"""Observe mode's records are taken on the supervisor's own timer: every PUMP_EVERY
while they come, slowing down to PUMP_IDLE while the command is quiet, and not at all
once init is gone (the run's end takes the rest)."""

from __future__ import annotations

from types import SimpleNamespace

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
