"""One asyncio task owns the scheduler core; everyone else sends it messages.

Data moves one way. A handler `submit`s a request with its engine input and is answered at once
(admitted, or an `OverloadedError`); it then awaits its ticket's decision and reads its row's
channel. The owner task feeds the core the time (monotonic seconds), and hands each batch the
core releases, whole, to the runner of its target, which streams into the members' channels.
Runners report rows' progress and ends back here (`RowReport`); the KV poller feeds
`observe_kv`; admin calls run on the owner task through `call`. A handler that leaves calls
`leave`: queued, its request is cancelled in the core; dispatched, its channel closes and the
runner stops its row. The task also wakes at the core's next deadline, keeps a stats snapshot
for the metrics thread, and reclaims KV reservations that outlived their request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.types import (
    Admitted,
    BatchInfo,
    Decision,
    Dispatch,
    Expired,
    Rejected,
    RejectReason,
    Request,
    Scheduler,
    SchedulerStats,
    StepFailedError,
    Target,
)
from scheduler_svc.errors import (
    BackendUnavailableError,
    BadRequestError,
    InternalError,
    OverloadedError,
    ShuttingDownError,
)
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.metrics import SidecarMetrics
from scheduler_svc.serving.rows import BatchJob, Row, RowChannel, Runner

log = structlog.get_logger("scheduler_svc.loop")

SNAPSHOT_EVERY_S = 0.5
LEAK_CHECK_EVERY_S = 5.0


@dataclass
class Ticket:
    """An admitted request: `decision` resolves when the core decides; a dispatched request's
    tokens then arrive on `channel`."""

    request_id: str
    decision: asyncio.Future[Decision]
    channel: RowChannel
    row: GenerationInput
    deadline: float | None  # monotonic; the engine call is cut off then
    submitted_at: float = 0.0


@dataclass
class _Submit:
    request: Request
    row: GenerationInput
    deadline: float | None
    reply: asyncio.Future[Ticket]


@dataclass
class _Leave:
    ticket: Ticket  # the ticket itself: a later request may reuse its id


@dataclass
class _RowDone:
    request_id: str
    output_tokens: int | None


@dataclass
class _Progress:
    request_id: str
    output_tokens: int


@dataclass
class _ObserveKv:
    free_blocks: int
    total_blocks: int


@dataclass
class _Call:
    fn: Callable[[Scheduler, float], Any]
    reply: asyncio.Future[Any] = field(repr=False)


@dataclass
class _Stop:
    pass


_Message = _Submit | _Leave | _RowDone | _Progress | _ObserveKv | _Call | _Stop


def event_loop_time() -> float:
    """The running event loop's clock, in monotonic seconds."""
    return asyncio.get_running_loop().time()


class CoreLoop:
    """Owns a `Scheduler` and hands its released batches to the runners."""

    def __init__(
        self,
        scheduler: Scheduler,
        clock: Callable[[], float] | None = None,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self.scheduler = scheduler
        # The one clock the core, the service's deadlines and asyncio's timeouts share: the
        # running event loop's (time.monotonic() in production; virtual time in the shell's
        # tests, scheduler_svc/testing/clock.py).
        self.clock = clock or event_loop_time
        self.metrics = metrics or SidecarMetrics()
        self.metrics.admission = lambda: (self.accepted, self.rejected)
        self.runners: dict[Target, Runner] = {}
        self._inbox: asyncio.Queue[_Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.accepted = 0
        self.rejected = 0
        self.leaked = 0
        self._tickets: dict[str, Ticket] = {}
        self._snapshot_at = 0.0
        self._leak_check_at = 0.0

    def set_runners(self, runners: Mapping[Target, Runner]) -> None:
        """Where each target's batches go (set once, before `start`)."""
        self.runners = dict(runners)

    # -- the handlers' side ------------------------------------------------------------------

    async def submit(
        self, request: Request, row: GenerationInput, deadline: float | None
    ) -> Ticket:
        """Queue a request; raise OverloadedError (with a retry hint) if the core refuses it."""
        if self._closed:
            raise ShuttingDownError("the sidecar is shutting down; retry on another instance")
        reply: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Submit(request, row, deadline, reply))
        try:
            return await reply
        except asyncio.CancelledError:
            # Admitted just as the caller left: leave, or it would hold its place forever.
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                self.leave(reply.result())
            raise

    def leave(self, ticket: Ticket) -> None:
        """The handler is done with its request (finished, failed or gone)."""
        ticket.channel.close()
        self._inbox.put_nowait(_Leave(ticket))

    async def call(self, fn: Callable[[Scheduler, float], Any]) -> Any:
        """Run `fn(scheduler, now)` on the owner task (admin changes); return its result."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Call(fn, reply))
        return await reply

    async def idle(self, poll_s: float = 0.05) -> None:
        """Return once no request is queued or running (for a drain)."""
        while self._tickets:
            await asyncio.sleep(poll_s)

    async def expel(self, error: Exception) -> int:
        """End every open request with `error`: a queued one leaves the core, a running one's
        reader gets the error at once (its engine call is stopped when the loop closes).
        Returns how many."""

        def expel_all(scheduler: Scheduler, now: float) -> int:
            count = 0
            for rid, ticket in list(self._tickets.items()):
                if not ticket.decision.done():
                    ticket.decision.set_exception(error)
                    del self._tickets[rid]
                    scheduler.cancel(rid, now)
                else:
                    ticket.channel.end(error)
                count += 1
            return count

        result: int = await self.call(expel_all)
        return result

    def observe_kv(self, free_blocks: int, total_blocks: int) -> None:
        """The backend's own KV block counts (from its metrics)."""
        self._inbox.put_nowait(_ObserveKv(free_blocks, total_blocks))

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -- the runners' side (RowReport) -------------------------------------------------------

    def progress(self, request_id: str, output_tokens: int) -> None:
        self._inbox.put_nowait(_Progress(request_id, output_tokens))

    def done(self, request_id: str, output_tokens: int | None) -> None:
        self._inbox.put_nowait(_RowDone(request_id, output_tokens))

    # -- the owner task ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="core-loop")

    async def close(self) -> None:
        """Stop admitting, stop the owner task, then every request the runners still run."""
        self._closed = True
        if self._task is not None:
            # A message, not a cancel: on Python 3.11 a cancel that lands as a timed wait ends
            # can be lost, and the task would run on.
            self._inbox.put_nowait(_Stop())
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for runner in self.runners.values():
            await runner.close()

    async def _run(self) -> None:
        while True:
            message = await self._next_message()
            now = self.clock()
            while message is not None:
                if isinstance(message, _Stop):
                    return
                try:
                    self._apply(message, now)
                except Exception as exc:  # the owner task must outlive any one bad message
                    self._failed(message, exc)
                message = None if self._inbox.empty() else self._inbox.get_nowait()
            try:
                decisions = self.scheduler.schedule(now)
            except StepFailedError as exc:  # what it decided before failing still goes out
                log.error("scheduling step failed", exc_info=exc.__cause__)
                self.metrics.internal_errors.labels("core.schedule").inc()
                decisions = exc.decisions
            try:
                self._decide(decisions, now)
                self._housekeeping(now)
            except Exception as exc:
                log.error("core loop step failed", exc_info=exc)
                self.metrics.internal_errors.labels("core.loop").inc()

    def _failed(self, message: _Message, exc: Exception) -> None:
        """A message the core could not take: its sender gets an INTERNAL answer, not silence."""
        log.error("core loop message failed", message=type(message).__name__, exc_info=exc)
        self.metrics.internal_errors.labels("core.loop").inc()
        reply = getattr(message, "reply", None)
        if reply is not None and not reply.done():
            reply.set_exception(InternalError("the scheduler failed to take this request"))

    async def _next_message(self) -> _Message | None:
        now = self.clock()
        wake = self.scheduler.next_wakeup(now)
        housekeeping = min(
            self._snapshot_at + SNAPSHOT_EVERY_S, self._leak_check_at + LEAK_CHECK_EVERY_S
        )
        wake = housekeeping if wake is None else min(wake, housekeeping)
        if not self._inbox.empty():
            return self._inbox.get_nowait()
        try:
            async with asyncio.timeout(max(wake - now, 0.0)):
                return await self._inbox.get()
        except TimeoutError:
            return None

    def _apply(
        self, message: _Submit | _Leave | _RowDone | _Progress | _ObserveKv | _Call, now: float
    ) -> None:
        if isinstance(message, _RowDone):
            if self._tickets.pop(message.request_id, None) is not None:
                self.scheduler.on_done(message.request_id, now, message.output_tokens)
        elif isinstance(message, _Leave):
            ticket = message.ticket
            rid = ticket.request_id
            # Only this very ticket: its id may already belong to a later request (found by
            # `scheduler-svc chaos`: a late leave cancelled the next request with the same id).
            if self._tickets.get(rid) is ticket and not ticket.decision.done():  # still queued
                ticket.decision.cancel()
                del self._tickets[rid]
                self.scheduler.cancel(rid, now)
            # dispatched: its runner reports the row's end; expired: already forgotten
        elif isinstance(message, _Progress):
            if message.request_id in self._tickets:
                self.scheduler.on_progress(message.request_id, message.output_tokens, now)
        elif isinstance(message, _ObserveKv):
            self.scheduler.observe_kv(message.free_blocks, message.total_blocks, now)
        elif isinstance(message, _Call):
            self._run_call(message, now)
        else:
            self._admit(message, now)

    def _run_call(self, message: _Call, now: float) -> None:
        if message.reply.done():
            return
        try:
            message.reply.set_result(message.fn(self.scheduler, now))
        except Exception as exc:  # the caller gets the error (a bad policy update, say)
            message.reply.set_exception(exc)

    def _admit(self, message: _Submit, now: float) -> None:
        if message.reply.done():  # the handler gave up before we got here
            return
        verdict = self.scheduler.submit(message.request, now)
        if isinstance(verdict, Rejected):
            self.rejected += 1
            error: Exception
            if verdict.reason in (RejectReason.DUPLICATE, RejectReason.UNKNOWN_LANE):
                error = BadRequestError(verdict.message)
            elif verdict.reason == RejectReason.TOO_LARGE:
                error = BadRequestError(
                    f"the request is too large for the backend: {verdict.message}"
                )
            else:
                error = OverloadedError(
                    verdict.message, verdict.retry_after_s, verdict.reason.value
                )
            message.reply.set_exception(error)
            return
        assert isinstance(verdict, Admitted)
        self.accepted += 1
        decision: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        rid = message.request.request_id
        ticket = Ticket(rid, decision, RowChannel(), message.row, message.deadline, now)
        self._tickets[rid] = ticket
        message.reply.set_result(ticket)

    def _decide(self, decisions: list[Decision], now: float) -> None:
        """Answer expired requests; hand each released batch, whole, to its target's runner."""
        jobs: dict[int, tuple[Target, BatchJob]] = {}
        for decision in decisions:
            ticket = self._tickets.get(decision.request_id)
            if isinstance(decision, Expired):
                self._tickets.pop(decision.request_id, None)
                if ticket is not None and not ticket.decision.done():
                    self.metrics.observe_wait(decision.lane, now - ticket.submitted_at)
                    ticket.decision.set_result(decision)
                continue
            if ticket is None:  # cannot happen while leaves go through the loop; stay whole
                self.scheduler.on_done(decision.request_id, now, None)
                continue
            batch = decision.batch or BatchInfo(
                -len(jobs) - 1, decision.lane, decision.target, 1, (len(ticket.row.prompt_ids),)
            )
            if batch.batch_id not in jobs:
                jobs[batch.batch_id] = (decision.target, BatchJob(batch))
                if decision.batch is not None:
                    self.metrics.observe_batch(batch)
            row = Row(ticket.request_id, self._input(ticket, decision, now), ticket.channel)
            jobs[batch.batch_id][1].rows.append(row)
            self.metrics.observe_wait(decision.lane, now - ticket.submitted_at)
            ticket.decision.set_result(decision)
        for target, job in jobs.values():
            runner = self.runners.get(target)
            if runner is None:
                self._no_runner(target, job, now)
            else:
                runner.start(job)

    def _input(self, ticket: Ticket, decision: Dispatch, now: float) -> GenerationInput:
        """The row as the engine gets it: max_tokens after any degrade, the time left, its lane
        (for routing to a backend group)."""
        row = replace(ticket.row, route=replace(ticket.row.route, lane=decision.lane))
        if decision.max_tokens is not None:
            row = replace(row, max_tokens=decision.max_tokens)
        if ticket.deadline is not None:
            row = replace(row, timeout_s=max(ticket.deadline - now, 0.001))
        return row

    def _no_runner(self, target: Target, job: BatchJob, now: float) -> None:
        for row in job.rows:
            row.channel.end(BackendUnavailableError(f"no {target.value} backend is configured"))
            self._tickets.pop(row.request_id, None)
            self.scheduler.on_done(row.request_id, now, None)

    def _housekeeping(self, now: float) -> None:
        if now >= self._snapshot_at + SNAPSHOT_EVERY_S:
            self._snapshot_at = now
            self.metrics.snapshot = self.scheduler.stats()
        if now >= self._leak_check_at + LEAK_CHECK_EVERY_S:
            self._leak_check_at = now
            self.reclaim_leaks(now)

    def reclaim_leaks(self, now: float) -> int:
        """KV reservations whose request is no longer live: log, count and free them (the
        source document's leak runbook, done by the sidecar itself). Returns how many."""
        if not isinstance(self.scheduler, PolicyScheduler):
            return 0
        leaked = [rid for rid in self.scheduler.mirror.held() if rid not in self._tickets]
        for rid in leaked:
            log.warning("reclaimed a leaked KV reservation", request_id=rid)
            self.scheduler.cancel(rid, now)
        self.leaked += len(leaked)
        self.metrics.leaked.inc(len(leaked))
        return len(leaked)
