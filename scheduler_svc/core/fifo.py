"""The pass-through scheduler: a bounded queue served in arrival order within urgency.

Invariants:
- len(in_flight) <= max_in_flight, and len(queue) <= max_queued + free in-flight places (a
  request admitted while a place is free is dispatched by the next `schedule`);
- a request id is in at most one of queue and in_flight;
- order: by urgency (interactive first), then by arrival (a sequence number this object owns);
- a queued request whose deadline has passed is expired, never dispatched.
"""

from __future__ import annotations

import heapq
import itertools

from scheduler_svc.core.types import (
    Admitted,
    Decision,
    Dispatch,
    Expired,
    ExpireReason,
    Rejected,
    RejectReason,
    Request,
    SchedulerStats,
)

LANE = "fifo"


class FifoScheduler:
    """Bounded FIFO with urgency levels and queue deadlines."""

    name = "fifo"

    def __init__(self, max_queued: int, max_in_flight: int, retry_after_s: float = 0.5) -> None:
        if max_queued < 0 or max_in_flight < 1:
            raise ValueError("max_queued must be >= 0 and max_in_flight >= 1")
        self.max_queued = max_queued
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self._seq = itertools.count()
        self._heap: list[tuple[int, int, str]] = []  # (urgency, seq, request_id)
        self._queued: dict[str, Request] = {}
        self._in_flight: set[str] = set()

    def submit(self, request: Request, now: float) -> Admitted | Rejected:
        rid = request.request_id
        if rid in self._queued or rid in self._in_flight:
            return Rejected(
                rid, RejectReason.DUPLICATE, f"request id {rid!r} is already in use", 0.0
            )
        free_slots = self.max_in_flight - len(self._in_flight)
        if len(self._queued) >= self.max_queued + free_slots:
            return Rejected(
                rid,
                RejectReason.QUEUE_FULL,
                f"the sidecar queue is full ({self.max_queued} waiting, "
                f"{self.max_in_flight} in flight)",
                self.retry_after_s,
            )
        self._queued[rid] = request
        heapq.heappush(self._heap, (int(request.urgency), next(self._seq), rid))
        return Admitted(rid)

    def schedule(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        for rid, request in list(self._queued.items()):
            if request.queue_deadline is not None and now >= request.queue_deadline:
                del self._queued[rid]
                decisions.append(Expired(rid, ExpireReason.QUEUE_TIMEOUT, LANE))
        while self._heap and len(self._in_flight) < self.max_in_flight:
            _, _, rid = heapq.heappop(self._heap)
            if rid not in self._queued:
                continue  # cancelled or expired while queued
            del self._queued[rid]
            self._in_flight.add(rid)
            decisions.append(Dispatch(rid, LANE))
        return decisions

    def cancel(self, request_id: str, now: float) -> None:
        self._queued.pop(request_id, None)
        self._in_flight.discard(request_id)

    def on_done(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        self._in_flight.discard(request_id)

    def on_progress(self, request_id: str, output_tokens: int, now: float) -> None:
        pass  # FIFO keeps no per-token accounting

    def observe_kv(self, free_blocks: int, total_blocks: int, now: float) -> None:
        pass  # FIFO does not model the backend's KV cache

    def next_wakeup(self, now: float) -> float | None:
        deadlines = [
            r.queue_deadline for r in self._queued.values() if r.queue_deadline is not None
        ]
        return min(deadlines) if deadlines else None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            queued=len(self._queued),
            in_flight=len(self._in_flight),
            max_queued=self.max_queued,
            max_in_flight=self.max_in_flight,
        )
