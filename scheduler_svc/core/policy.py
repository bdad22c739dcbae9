"""The full policy: lanes by length, length buckets, fair shares, KV admission, aging, breaker.

`submit` classifies a request into a lane (its prompt length, or the lane the client pinned;
the circuit breaker may demote it one lane), predicts its output and either queues it in a
length bucket or rejects it at once with a reason and a retry hint. `schedule(now)` then, in
this order: fires due timers (bucket release, lane timeouts with each lane's action, client
deadlines, aging), settles KV growth owed to requests that outran their prediction, dispatches
buckets holding promoted requests oldest-first (if one cannot fit, nothing else goes: the freed
capacity is kept for it), and finally shares what is left between lanes by deficit round robin
on tokens (prompt + predicted output), work-conserving: a lane with nothing ready lends its share.
A bucket goes whole (up to its lane's max batch) once the KV mirror and the backend's sequence
limit can hold it; it goes in part only when nothing is running, or when it holds a promoted
request. For an engine with continuous (in-flight) batching (`continuous_batching`), buckets are
ready as soon as they are formed and go in part whenever there is room: the engine merges rows
into its running batch at every step, so waiting to fill or keep a batch only adds latency.
With `max_batches_in_flight` (a static-batching engine: as many as it runs at once), no bucket
goes while that many released batches still have a member running: the engine then runs each
bucket as its own batch, and buckets fill while it works.

Invariants (tests/unit/test_policy.py's state machine):
- every submitted request ends in exactly one of: rejected at submission, expired, cancelled,
  done; it is never both queued and in flight;
- primary in-flight requests hold exactly one KV reservation each; nothing else holds one;
- released batches respect their lane's max batch and max ratio;
- no request stays queued past its lane's aging bound + its batch timeout while the capacity
  it needs is free, unless an older overdue request is waiting for more (freed capacity is kept
  for the oldest: that is what stops a large request from starving);
- each lane's queue stays within its cap;
- primary batches with a member in flight never exceed `max_batches_in_flight`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass

from scheduler_svc.core.breaker import Breaker
from scheduler_svc.core.bucketing import Bucket, Entry, LaneQueue
from scheduler_svc.core.config import OnTimeout, PolicyConfig
from scheduler_svc.core.kv import BlockMirror
from scheduler_svc.core.predict import OutputPredictor
from scheduler_svc.core.shares import DeficitRoundRobin
from scheduler_svc.core.types import (
    Admitted,
    BatchInfo,
    Decision,
    Dispatch,
    Expired,
    ExpireReason,
    KvStats,
    LaneStats,
    Rejected,
    RejectReason,
    Request,
    SchedulerStats,
    StepFailedError,
    Target,
)

# Every event the policy counts in `stats().counters` (a metric's label values).
EVENTS = (
    "batches",
    "step_failed",
    "promoted",
    "demoted",
    "requeued",
    "mispredicted",
    "elastic",
    "degraded_backend",
    "degraded_max_tokens",
    "expired_queue_timeout",
    "expired_no_fallback",
    "expired_requeue_limit",
    "rejected_queue_full",
    "rejected_too_large",
    "rejected_duplicate_request_id",
    "rejected_unknown_lane",
    "cancelled",
    "reconfigured",
)

# Timer kinds; a timer is void once its request left the lane or was requeued (version).
_BATCH, _TIMEOUT, _DEADLINE, _AGING = "batch", "timeout", "deadline", "aging"


@dataclass
class _InFlight:
    lane: str
    tenant: str
    prompt_tokens: int
    max_tokens: int
    predicted_output: int
    target: Target
    batch_id: int = 0
    mispredicted: bool = False


@dataclass(frozen=True)
class _Timer:
    kind: str
    lane: str
    request_id: str = ""
    version: int = 0
    bucket: Bucket | None = None


class PolicyScheduler:
    """The scheduling policy of DESIGN.md over the `Scheduler` seam."""

    name = "policy"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config = config or PolicyConfig()
        self.lanes = {lane.name: LaneQueue(lane) for lane in config.lanes}
        self.mirror = BlockMirror(config.kv)
        self.predictor = OutputPredictor(config.predict)
        self.breaker = Breaker(config.breaker)
        self.counters: Counter[str] = Counter()
        self._seq = itertools.count()
        self._batch_ids = itertools.count(1)
        self._timers: list[tuple[float, int, _Timer]] = []
        self._queued: dict[str, tuple[str, Entry]] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._outbox: list[Decision] = []
        self.shares = DeficitRoundRobin(
            {lane.name: lane.share for lane in config.lanes}, config.quantum_tokens
        )
        self._rows_in_flight = 0
        self._batch_rows: dict[int, int] = {}  # primary batch id -> members still in flight
        self._now = 0.0

    # -- arrivals ----------------------------------------------------------------------------

    def classify(self, request: Request) -> str:
        """The lane a request's prompt length puts it in."""
        chosen = self.config.lanes[0].name
        for lane in self.config.lanes:
            if request.prompt_tokens >= lane.min_prompt_tokens:
                chosen = lane.name
        return chosen

    def submit(self, request: Request, now: float) -> Admitted | Rejected:
        """Queue the request in its lane's buckets, or reject it at once."""
        self._now = now
        rid = request.request_id
        if rid in self._queued or rid in self._in_flight:
            return self._reject(
                rid, RejectReason.DUPLICATE, f"request id {rid!r} is already in use"
            )
        if request.lane is not None and request.lane not in self.lanes:
            known = ", ".join(self.lanes)
            return self._reject(
                rid, RejectReason.UNKNOWN_LANE, f"unknown lane {request.lane!r} (lanes: {known})"
            )
        lane = request.lane or self.classify(request)
        self.breaker.update(len(self.lanes[self.config.breaker.watch_lane]), now)
        if (
            request.lane is None
            and lane == self.config.breaker.demote_lane
            and self.breaker.demote()
        ):
            lane = self.config.breaker.to_lane
            self.counters["demoted"] += 1
        max_tokens = max(1, request.max_tokens)
        predicted = self.predictor.predict(request.tenant, lane, max_tokens)
        if self.mirror.need(request.prompt_tokens, predicted) > self.mirror.total_blocks:
            return self._too_large(request, lane, max_tokens, predicted)
        cap = self.config.max_queued
        if cap is not None and len(self._queued) >= cap:
            return self._reject(
                rid,
                RejectReason.QUEUE_FULL,
                f"the sidecar queue is full ({cap} waiting)",
                self.config.retry_after_s,
            )
        queue = self.lanes[lane]
        if len(queue) >= queue.config.max_queued:
            return self._reject(
                rid,
                RejectReason.QUEUE_FULL,
                f"lane {lane!r} is full ({queue.config.max_queued} waiting)",
                self.config.retry_after_s,
            )
        entry = Entry(request, next(self._seq), now, now, predicted, max_tokens)
        self._enqueue(lane, entry, now)
        if request.queue_deadline is not None:
            self._timer(request.queue_deadline, _Timer(_DEADLINE, lane, rid, -1))
        if queue.config.max_wait_s is not None:
            self._timer(now + queue.config.max_wait_s, _Timer(_AGING, lane, rid, -1))
        return Admitted(rid)

    def _enqueue(self, lane: str, entry: Entry, now: float) -> None:
        queue = self.lanes[lane]
        bucket = queue.add(entry, now)
        self._queued[entry.request_id] = (lane, entry)
        if self.config.continuous_batching:
            queue.mark_ready(bucket)
        elif len(bucket.members) == 1 and not bucket.ready:
            self._timer(now + queue.config.batch_timeout_s, _Timer(_BATCH, lane, bucket=bucket))
        if queue.config.queue_timeout_s is not None:
            when = now + queue.config.queue_timeout_s
            self._timer(when, _Timer(_TIMEOUT, lane, entry.request_id, entry.version))

    def _too_large(
        self, request: Request, lane: str, max_tokens: int, predicted: int
    ) -> Admitted | Rejected:
        rid = request.request_id
        if not self.config.elastic_backend:
            blocks = self.mirror.need(request.prompt_tokens, predicted)
            return self._reject(
                rid,
                RejectReason.TOO_LARGE,
                f"needs {blocks} KV blocks; the backend has {self.mirror.total_blocks} in all",
            )
        self._in_flight[rid] = _InFlight(
            lane, request.tenant, request.prompt_tokens, max_tokens, predicted, Target.ELASTIC
        )
        self._outbox.append(self._single(rid, lane, request.prompt_tokens, Target.ELASTIC))
        self.counters["elastic"] += 1
        return Admitted(rid)

    def _reject(
        self, rid: str, reason: RejectReason, message: str, retry_after_s: float = 0.0
    ) -> Rejected:
        self.counters[f"rejected_{reason.value}"] += 1
        return Rejected(rid, reason, message, retry_after_s)

    def _timer(self, when: float, timer: _Timer) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), timer))

    # -- decisions ---------------------------------------------------------------------------

    def schedule(self, now: float) -> list[Decision]:
        """Everything to dispatch or expire now, batch by batch."""
        self._now = now
        out, self._outbox = self._outbox, []
        try:
            self.mirror.forget_stale(now)
            self._fire_timers(now, out)
            self.breaker.update(len(self.lanes[self.config.breaker.watch_lane]), now)
            self.mirror.settle_shortfalls()
            if not self._dispatch_promoted(out):
                self._dispatch_fair(out)
        except Exception as exc:  # what was decided stays decided: hand it over
            self.counters["step_failed"] += 1
            raise StepFailedError(out) from exc
        return out

    def _fire_timers(self, now: float, out: list[Decision]) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            queue = self.lanes[timer.lane]
            if timer.kind == _BATCH:
                if timer.bucket is not None and timer.bucket.alive:
                    queue.mark_ready(timer.bucket)
                continue
            found = self._queued.get(timer.request_id)
            if found is None or found[0] != timer.lane:
                continue
            entry = found[1]
            if timer.kind == _DEADLINE:
                self._drop(timer.lane, entry)
                out.append(Expired(entry.request_id, ExpireReason.QUEUE_TIMEOUT, timer.lane))
                self.counters["expired_queue_timeout"] += 1
            elif timer.kind == _AGING:
                if not entry.promoted:
                    queue.promote(entry)
                    self.counters["promoted"] += 1
            elif timer.version == entry.version:
                self._on_lane_timeout(timer.lane, entry, now, out)

    def _on_lane_timeout(self, lane: str, entry: Entry, now: float, out: list[Decision]) -> None:
        action = self.lanes[lane].config.on_timeout
        rid = entry.request_id
        if action is OnTimeout.DEGRADE:
            if self.config.degrade_backend:
                self._drop(lane, entry)
                self._send_elsewhere(lane, entry, Target.DEGRADE, out)
                self.counters["degraded_backend"] += 1
            elif self.config.degrade_max_tokens is not None:
                entry.max_tokens = min(entry.max_tokens, self.config.degrade_max_tokens)
                entry.predicted_output = min(entry.predicted_output, entry.max_tokens)
                if not entry.promoted:
                    self.lanes[lane].promote(entry)
                self.counters["degraded_max_tokens"] += 1
            else:
                self._drop(lane, entry)
                out.append(Expired(rid, ExpireReason.NO_FALLBACK, lane))
                self.counters["expired_no_fallback"] += 1
        elif action is OnTimeout.REQUEUE:
            if entry.requeues < self.lanes[lane].config.max_requeues:
                promoted = entry.promoted
                self._drop(lane, entry)
                entry.requeues += 1
                entry.version += 1
                entry.enqueued_at = now
                self._enqueue(lane, entry, now)
                if promoted:
                    self.lanes[lane].promote(entry)
                self.counters["requeued"] += 1
            else:
                self._drop(lane, entry)
                out.append(Expired(rid, ExpireReason.REQUEUE_LIMIT, lane))
                self.counters["expired_requeue_limit"] += 1
        elif self.config.elastic_backend:  # ELASTIC; without a pool the request keeps waiting
            self._drop(lane, entry)
            self._send_elsewhere(lane, entry, Target.ELASTIC, out)
            self.counters["elastic"] += 1

    def _drop(self, lane: str, entry: Entry) -> None:
        self.lanes[lane].remove(entry)
        del self._queued[entry.request_id]

    def _single(self, rid: str, lane: str, prompt_tokens: int, target: Target) -> Dispatch:
        batch = BatchInfo(next(self._batch_ids), lane, target, 1, (max(1, prompt_tokens),))
        return Dispatch(rid, lane, batch, target)

    def _send_elsewhere(self, lane: str, entry: Entry, target: Target, out: list[Decision]) -> None:
        req = entry.request
        self._in_flight[entry.request_id] = _InFlight(
            lane, req.tenant, entry.prompt_tokens, entry.max_tokens, entry.predicted_output, target
        )
        out.append(self._single(entry.request_id, lane, entry.prompt_tokens, target))

    # -- dispatch ----------------------------------------------------------------------------

    def _fits(self, bucket: Bucket, max_batch: int) -> list[Entry]:
        """The members, in fair order, that the KV pool and the sequence limit can hold now
        (at most `max_batch`: a bucket filled before the lane's max batch shrank goes in parts)."""
        free = self.mirror.free_blocks
        rows = self.config.kv.max_in_flight - self._rows_in_flight
        chosen: list[Entry] = []
        for entry in sorted(bucket.members, key=lambda e: (e.tag, e.seq)):
            need = self.mirror.need(entry.prompt_tokens, entry.predicted_output)
            if need > free or rows == 0 or len(chosen) == max_batch:
                break
            free -= need
            rows -= 1
            chosen.append(entry)
        return chosen

    def _release(self, lane: str, entries: list[Entry], out: list[Decision]) -> int:
        queue = self.lanes[lane]
        bucket = entries[0].bucket
        assert bucket is not None
        # Everything that can fail is worked out before anything changes: a batch is released
        # whole or not at all, and never leaves a reservation behind.
        blocks = [self.mirror.need(e.prompt_tokens, e.predicted_output) for e in entries]
        if sum(blocks) > self.mirror.free_blocks:
            raise ValueError(f"{sum(blocks)} blocks wanted, {self.mirror.free_blocks} free")
        cost = sum(e.cost_tokens for e in entries)
        batch = BatchInfo(
            next(self._batch_ids),
            lane,
            Target.PRIMARY,
            queue.config.max_batch,
            tuple(e.prompt_tokens for e in entries),
        )
        queue.take(bucket, len(entries))
        self._batch_rows[batch.batch_id] = len(entries)
        for entry, need in zip(entries, blocks, strict=True):
            rid = entry.request_id
            del self._queued[rid]
            self.mirror.reserve(rid, need, entry.prompt_tokens)
            self._rows_in_flight += 1
            self._in_flight[rid] = _InFlight(
                lane,
                entry.request.tenant,
                entry.prompt_tokens,
                entry.max_tokens,
                entry.predicted_output,
                Target.PRIMARY,
                batch.batch_id,
            )
            shorter = entry.max_tokens if entry.max_tokens < entry.request.max_tokens else None
            out.append(Dispatch(rid, lane, batch, Target.PRIMARY, shorter))
        self.counters["batches"] += 1
        return cost

    def _engine_has_room(self) -> bool:
        """Whether another batch may go to the engine now (`max_batches_in_flight`)."""
        limit = self.config.max_batches_in_flight
        return limit is None or len(self._batch_rows) < limit

    def _dispatch_promoted(self, out: list[Decision]) -> bool:
        """Dispatch buckets holding promoted requests; True if one is blocked (drain for it)."""
        waiting = [
            (bucket.first_arrival, bucket.bucket_id, name, bucket)
            for name, queue in self.lanes.items()
            for bucket in queue.urgent_buckets()
        ]
        for _, _, name, bucket in sorted(waiting, key=lambda w: (w[0], w[1], w[2])):
            while bucket.alive and any(e.promoted for e in bucket.members):
                entries = self._fits(bucket, self.lanes[name].config.max_batch)
                if not entries or not self._engine_has_room():
                    return True
                self._release(name, entries, out)
        return False

    def _dispatch_fair(self, out: list[Decision]) -> None:
        """Share the room between lanes with ready buckets by deficit round robin on tokens."""
        blocked: set[str] = set()
        while self._engine_has_room():
            heads: dict[str, Bucket] = {}
            for name, queue in self.lanes.items():
                head = None if name in blocked else queue.head()
                if head is not None:
                    heads[name] = head
                elif name not in blocked:
                    self.shares.idle(name)
            if not heads:
                return
            name = self.shares.choose(
                {lane: sum(e.cost_tokens for e in head.members) for lane, head in heads.items()}
            )
            head, max_batch = heads[name], self.lanes[name].config.max_batch
            entries = self._fits(head, max_batch)
            whole = min(len(head.members), max_batch)
            partial = len(entries) < whole and self._rows_in_flight > 0
            if not entries or (partial and not self.config.continuous_batching):
                # Keep a batch whole while running requests will free room for all of it; go
                # in part only when nothing runs (waiting could not help), or when the engine
                # batches continuously anyway.
                blocked.add(name)
                continue
            self.shares.charge(name, self._release(name, entries, out))

    # -- changes while running -------------------------------------------------------------

    def reconfigure(self, config: PolicyConfig, now: float) -> None:
        """Switch to `config` without losing a request: queued and in-flight requests stay; new
        thresholds, shares, batching and breaker knobs apply from the next decision. Lanes
        cannot be added, removed or renamed, nor the KV block size or mode changed."""
        self._now = now
        if [lane.name for lane in config.lanes] != [lane.name for lane in self.config.lanes]:
            raise ValueError("lanes cannot be added, removed or renamed while running")
        old_kv, new_kv = self.config.kv, config.kv
        if (old_kv.mode, old_kv.tokens_per_block) != (new_kv.mode, new_kv.tokens_per_block):
            raise ValueError("kv.mode and kv.tokens_per_block cannot change while running")
        self.config = config
        for lane in config.lanes:
            self.lanes[lane.name].reconfigure(lane)
        self.breaker.config = config.breaker
        self.shares.reconfigure(
            {lane.name: lane.share for lane in config.lanes}, config.quantum_tokens
        )
        self.predictor.config = config.predict
        self.mirror.config = new_kv
        self.counters["reconfigured"] += 1

    # -- departures and feedback -------------------------------------------------------------

    def cancel(self, request_id: str, now: float) -> None:
        """The client left: forget the request, queued or in flight, and free what it held."""
        self._now = now
        found = self._queued.get(request_id)
        if found is not None:
            self._drop(found[0], found[1])
            self.counters["cancelled"] += 1
        elif self._finish(request_id) is not None:
            self.counters["cancelled"] += 1

    def on_done(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        """A dispatched request ended; learn from its output length and free its blocks."""
        self._now = now
        flight = self._finish(request_id)
        if flight is None or output_tokens is None:
            return
        if output_tokens > flight.predicted_output and not flight.mispredicted:
            self.counters["mispredicted"] += 1
        self.predictor.observe(flight.tenant, flight.lane, flight.max_tokens, output_tokens)

    def _finish(self, request_id: str) -> _InFlight | None:
        flight = self._in_flight.pop(request_id, None)
        if flight is not None and flight.target is Target.PRIMARY:
            self.mirror.release(request_id)
            self._rows_in_flight -= 1
            left = self._batch_rows[flight.batch_id] - 1
            if left:
                self._batch_rows[flight.batch_id] = left
            else:
                del self._batch_rows[flight.batch_id]
        return flight

    def on_progress(self, request_id: str, output_tokens: int, now: float) -> None:
        """Tokens generated so far; a request past its prediction gets its reservation grown."""
        self._now = now
        flight = self._in_flight.get(request_id)
        if flight is None or flight.target is not Target.PRIMARY:
            return
        used = flight.prompt_tokens + output_tokens
        self.mirror.progress(request_id, used, flight.prompt_tokens + flight.max_tokens)
        if output_tokens > flight.predicted_output and not flight.mispredicted:
            flight.mispredicted = True
            self.counters["mispredicted"] += 1

    def observe_kv(self, free_blocks: int, total_blocks: int, now: float) -> None:
        """The backend's own KV counts reconcile the mirror."""
        self._now = now
        self.mirror.observe(free_blocks, total_blocks, now)

    # -- time and reporting ------------------------------------------------------------------

    def _timer_live(self, timer: _Timer) -> bool:
        if timer.kind == _BATCH:
            return timer.bucket is not None and timer.bucket.alive and not timer.bucket.ready
        found = self._queued.get(timer.request_id)
        if found is None or found[0] != timer.lane:
            return False
        entry = found[1]
        if timer.kind == _AGING:
            return not entry.promoted
        return timer.kind == _DEADLINE or timer.version == entry.version

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time a timer could change a decision (now, if work is waiting)."""
        if self._outbox:
            return now
        while self._timers and not self._timer_live(self._timers[0][2]):
            heapq.heappop(self._timers)
        times = [self._timers[0][0]] if self._timers else []
        close = self.breaker.next_check(now)
        if close is not None:
            times.append(close)
        return min(times) if times else None

    def queued_ids(self) -> dict[str, str]:
        """Queued request ids and their lanes."""
        return {rid: lane for rid, (lane, _) in self._queued.items()}

    def in_flight_ids(self) -> dict[str, Target]:
        return {rid: flight.target for rid, flight in self._in_flight.items()}

    def stats(self) -> SchedulerStats:
        lanes = []
        for name, queue in self.lanes.items():
            oldest = min((e.arrived_at for e in queue.entries.values()), default=self._now)
            lanes.append(
                LaneStats(
                    name,
                    len(queue),
                    queue.config.max_queued,
                    max(0.0, self._now - oldest),
                    queue.config.max_wait_s,
                )
            )
        mirror = self.mirror
        return SchedulerStats(
            queued=len(self._queued),
            in_flight=len(self._in_flight),
            batches_in_flight=len(self._batch_rows),
            max_queued=min(
                sum(q.config.max_queued for q in self.lanes.values()),
                self.config.max_queued if self.config.max_queued is not None else 1 << 62,
            ),
            max_in_flight=self.config.kv.max_in_flight,
            lanes=tuple(lanes),
            kv=KvStats(
                mirror.total_blocks,
                mirror.free_blocks,
                mirror.reserved_blocks,
                mirror.external_blocks,
                mirror.tokens_per_block,
                mirror.fragmentation(),
                mirror.is_stale(self._now),
            ),
            breaker_open=self.breaker.is_open,
            counters=tuple(sorted(self.counters.items())),
        )
