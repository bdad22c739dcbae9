"""One asyncio task owns the scheduler core; request handlers talk to it through messages.

A handler `submit`s a request and is answered at once (admitted, or an `OverloadedError`); it
then awaits its ticket, which the owner task resolves with the core's decision (dispatch now, as
a row of a batch, or expired). While the answer streams the handler reports `progress`; when the
request ends, for whatever reason, it `release`s it with the tokens it produced. The KV poller
feeds `observe_kv`; admin calls run on the owner task through `call`. The owner task feeds the
core the time (monotonic seconds), wakes at the core's next deadline, keeps a stats snapshot
for the metrics thread, and checks for KV reservations that outlived their request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.types import (
    Admitted,
    Decision,
    Dispatch,
    Rejected,
    RejectReason,
    Request,
    Scheduler,
    SchedulerStats,
)
from scheduler_svc.errors import BadRequestError, OverloadedError, ShuttingDownError
from scheduler_svc.metrics import SidecarMetrics

log = structlog.get_logger("scheduler_svc.dispatcher")

SNAPSHOT_EVERY_S = 0.5
LEAK_CHECK_EVERY_S = 5.0


@dataclass
class Ticket:
    """A request admitted to the queue; `decision` resolves when the core decides."""

    request_id: str
    decision: asyncio.Future[Decision]
    submitted_at: float = 0.0


@dataclass
class _Submit:
    request: Request
    reply: asyncio.Future[Ticket]


@dataclass
class _Release:
    request_id: str
    dispatched: bool
    output_tokens: int | None = None


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


_Message = _Submit | _Release | _Progress | _ObserveKv | _Call


class Dispatcher:
    """Owns a `Scheduler`; everything else sends it messages."""

    def __init__(
        self,
        scheduler: Scheduler,
        clock: Callable[[], float] = time.monotonic,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.metrics = metrics or SidecarMetrics()
        self.metrics.admission = lambda: (self.accepted, self.rejected)
        self._inbox: asyncio.Queue[_Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.accepted = 0
        self.rejected = 0
        self.leaked = 0
        self._tickets: dict[str, Ticket] = {}
        self._snapshot_at = 0.0
        self._leak_check_at = 0.0

    # -- handler side ------------------------------------------------------------------------

    async def submit(self, request: Request) -> Ticket:
        """Queue a request; raise OverloadedError (with a retry hint) if the core refuses it."""
        if self._closed:
            raise ShuttingDownError("the sidecar is shutting down; retry on another instance")
        reply: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Submit(request, reply))
        try:
            return await reply
        except asyncio.CancelledError:
            # Admitted just as the caller left: release it, or it would hold its place forever.
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                self.release(reply.result())
            raise

    def progress(self, ticket: Ticket, output_tokens: int) -> None:
        """The request has produced `output_tokens` so far."""
        self._inbox.put_nowait(_Progress(ticket.request_id, output_tokens))

    def release(self, ticket: Ticket, output_tokens: int | None = None) -> None:
        """The request is over (finished, failed or abandoned); free what it held."""
        dispatched = (
            ticket.decision.done()
            and not ticket.decision.cancelled()
            and isinstance(ticket.decision.result(), Dispatch)
        )
        self._inbox.put_nowait(_Release(ticket.request_id, dispatched, output_tokens))

    def observe_kv(self, free_blocks: int, total_blocks: int) -> None:
        """The backend's own KV block counts (from its metrics)."""
        self._inbox.put_nowait(_ObserveKv(free_blocks, total_blocks))

    async def call(self, fn: Callable[[Scheduler, float], Any]) -> Any:
        """Run `fn(scheduler, now)` on the owner task (admin changes); return its result."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Call(fn, reply))
        return await reply

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -- the owner task ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dispatcher")

    async def close(self) -> None:
        """Stop admitting; the owner task ends once every admitted request is released."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            message = await self._next_message()
            try:
                now = self.clock()
                if message is not None:
                    self._apply(message, now)
                while not self._inbox.empty():
                    self._apply(self._inbox.get_nowait(), now)
                self._decide(self.scheduler.schedule(now), now)
                self._housekeeping(now)
            except Exception:  # the owner task must outlive any one bad message
                log.exception("dispatcher step failed")

    async def _next_message(self) -> _Message | None:
        now = self.clock()
        wake = self.scheduler.next_wakeup(now)
        housekeeping = min(
            self._snapshot_at + SNAPSHOT_EVERY_S, self._leak_check_at + LEAK_CHECK_EVERY_S
        )
        wake = housekeeping if wake is None else min(wake, housekeeping)
        try:
            return await asyncio.wait_for(self._inbox.get(), max(wake - now, 0.0))
        except TimeoutError:
            return None

    def _apply(self, message: _Message, now: float) -> None:
        if isinstance(message, _Release):
            if message.dispatched:
                self.scheduler.on_done(message.request_id, now, message.output_tokens)
            else:
                self.scheduler.cancel(message.request_id, now)
            self._tickets.pop(message.request_id, None)
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
                error = OverloadedError(verdict.message, verdict.retry_after_s)
            message.reply.set_exception(error)
            return
        assert isinstance(verdict, Admitted)
        self.accepted += 1
        decision: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        ticket = Ticket(message.request.request_id, decision, now)
        self._tickets[ticket.request_id] = ticket
        message.reply.set_result(ticket)

    def _decide(self, decisions: list[Decision], now: float) -> None:
        batches: set[int] = set()
        for decision in decisions:
            batch = decision.batch if isinstance(decision, Dispatch) else None
            if batch is not None and batch.batch_id not in batches:
                batches.add(batch.batch_id)
                self.metrics.observe_batch(batch)
            ticket = self._tickets.get(decision.request_id)
            if ticket is None or ticket.decision.done():
                # The handler left between our decision and now; its release will follow.
                continue
            self.metrics.observe_wait(decision.lane, now - ticket.submitted_at)
            ticket.decision.set_result(decision)

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
