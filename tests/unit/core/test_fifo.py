"""The pass-through FIFO core: bounded, ordered by urgency then arrival, deadlines honoured."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_svc.core.fifo import FifoScheduler
from scheduler_svc.core.types import (
    Admitted,
    Dispatch,
    Expired,
    ExpireReason,
    Rejected,
    RejectReason,
    Request,
    Urgency,
)


def req(rid: str, urgency: Urgency = Urgency.STANDARD, deadline: float | None = None) -> Request:
    return Request(rid, prompt_tokens=10, max_tokens=10, urgency=urgency, queue_deadline=deadline)


def test_dispatches_in_arrival_order_up_to_the_in_flight_cap() -> None:
    fifo = FifoScheduler(max_queued=10, max_in_flight=2)
    for rid in "abc":
        assert isinstance(fifo.submit(req(rid), now=0.0), Admitted)
    assert fifo.schedule(0.0) == [Dispatch("a", "fifo"), Dispatch("b", "fifo")]
    assert fifo.schedule(0.1) == []
    fifo.on_done("a", 0.2)
    assert fifo.schedule(0.2) == [Dispatch("c", "fifo")]


def test_urgency_goes_first_and_arrival_breaks_ties() -> None:
    fifo = FifoScheduler(max_queued=10, max_in_flight=1)
    fifo.submit(req("running"), 0.0)
    fifo.schedule(0.0)
    fifo.submit(req("batch1", Urgency.BATCH), 0.1)
    fifo.submit(req("std", Urgency.STANDARD), 0.2)
    fifo.submit(req("now1", Urgency.INTERACTIVE), 0.3)
    fifo.submit(req("now2", Urgency.INTERACTIVE), 0.4)
    order = []
    for t in range(4):
        fifo.on_done(order[-1] if order else "running", 1.0 + t)
        order.extend(d.request_id for d in fifo.schedule(1.0 + t))
    assert order == ["now1", "now2", "std", "batch1"]


def test_full_queue_rejects_at_once_with_a_retry_hint() -> None:
    fifo = FifoScheduler(max_queued=1, max_in_flight=1, retry_after_s=0.25)
    fifo.submit(req("a"), 0.0)
    fifo.schedule(0.0)
    fifo.submit(req("b"), 0.0)
    verdict = fifo.submit(req("c"), 0.0)
    assert isinstance(verdict, Rejected)
    assert verdict.reason == RejectReason.QUEUE_FULL and verdict.retry_after_s == 0.25
    assert "queue is full" in verdict.message
    dup = fifo.submit(req("a"), 0.0)
    assert isinstance(dup, Rejected) and dup.reason == RejectReason.DUPLICATE


def test_deadlines_expire_queued_requests_and_set_the_wakeup() -> None:
    fifo = FifoScheduler(max_queued=10, max_in_flight=1)
    fifo.submit(req("busy"), 0.0)
    fifo.schedule(0.0)
    fifo.submit(req("patient", deadline=None), 0.0)
    fifo.submit(req("hasty", deadline=0.5), 0.0)
    assert fifo.next_wakeup(0.1) == 0.5
    assert fifo.schedule(0.49) == []
    assert fifo.schedule(0.5) == [Expired("hasty", ExpireReason.QUEUE_TIMEOUT, "fifo")]
    assert fifo.next_wakeup(0.6) is None
    assert fifo.stats().queued == 1


def test_cancel_frees_queued_and_in_flight_places() -> None:
    fifo = FifoScheduler(max_queued=5, max_in_flight=1)
    fifo.submit(req("a"), 0.0)
    fifo.submit(req("b"), 0.0)
    fifo.schedule(0.0)
    fifo.cancel("b", 0.1)  # queued
    fifo.cancel("a", 0.1)  # in flight
    stats = fifo.stats()
    assert (stats.queued, stats.in_flight) == (0, 0)
    fifo.submit(req("c"), 0.2)
    assert fifo.schedule(0.2) == [Dispatch("c", "fifo")]


class FifoMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fifo = FifoScheduler(max_queued=3, max_in_flight=2)
        self.now = 0.0
        self.n = 0
        self.queued: set[str] = set()
        self.flying: set[str] = set()

    @rule(urgency=st.sampled_from(list(Urgency)), ttl=st.one_of(st.none(), st.floats(0.1, 3)))
    def submit(self, urgency: Urgency, ttl: float | None) -> None:
        rid = f"r{self.n}"
        self.n += 1
        deadline = None if ttl is None else self.now + ttl
        if isinstance(self.fifo.submit(req(rid, urgency, deadline), self.now), Admitted):
            self.queued.add(rid)

    @rule(dt=st.floats(0, 2))
    def tick(self, dt: float) -> None:
        self.now += dt
        for decision in self.fifo.schedule(self.now):
            assert decision.request_id in self.queued  # only queued requests are decided
            self.queued.discard(decision.request_id)
            if isinstance(decision, Dispatch):
                self.flying.add(decision.request_id)

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.flying)))
        self.flying.discard(rid)
        self.fifo.on_done(rid, self.now)

    @precondition(lambda self: bool(self.queued))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.queued)))
        self.queued.discard(rid)
        self.fifo.cancel(rid, self.now)

    @invariant()
    def bounded_and_consistent(self) -> None:
        stats = self.fifo.stats()
        assert stats.in_flight == len(self.flying) <= 2
        assert stats.queued == len(self.queued)
        assert stats.queued <= 3 + (2 - stats.in_flight)


TestFifoMachine = FifoMachine.TestCase
