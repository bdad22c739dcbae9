"""One asyncio task owns the scheduler core; request handlers talk to it through messages.

A handler `submit`s a request and is answered at once (admitted, or an `OverloadedError`); it
then awaits its ticket, which the owner task resolves with the core's decision (dispatch now, or
expired). When the request ends, for whatever reason, the handler `release`s it. The owner task
feeds the core the time (monotonic seconds) and wakes at the core's next deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from scheduler_svc.core.types import (
    Admitted,
    Decision,
    Dispatch,
    Expired,
    Rejected,
    RejectReason,
    Request,
    Scheduler,
    SchedulerStats,
)
from scheduler_svc.errors import BadRequestError, OverloadedError, ShuttingDownError

log = structlog.get_logger("scheduler_svc.dispatcher")


@dataclass
class Ticket:
    """A request admitted to the queue; `decision` resolves when the core decides."""

    request_id: str
    decision: asyncio.Future[Decision]


@dataclass
class _Submit:
    request: Request
    reply: asyncio.Future[Ticket]


@dataclass
class _Release:
    request_id: str
    dispatched: bool


class Dispatcher:
    """Owns a `Scheduler`; everything else sends it messages."""

    def __init__(self, scheduler: Scheduler, clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self._inbox: asyncio.Queue[_Submit | _Release] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.accepted = 0
        self.rejected = 0
        self._tickets: dict[str, Ticket] = {}

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

    def release(self, ticket: Ticket) -> None:
        """The request is over (finished, failed or abandoned); free what it held."""
        dispatched = ticket.decision.done() and not ticket.decision.cancelled()
        self._inbox.put_nowait(_Release(ticket.request_id, dispatched))

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
                self._decide(self.scheduler.schedule(now))
            except Exception:  # the owner task must outlive any one bad message
                log.exception("dispatcher step failed")

    async def _next_message(self) -> _Submit | _Release | None:
        wake = self.scheduler.next_wakeup(self.clock())
        if wake is None:
            return await self._inbox.get()
        try:
            return await asyncio.wait_for(self._inbox.get(), max(wake - self.clock(), 0.0))
        except TimeoutError:
            return None

    def _apply(self, message: _Submit | _Release, now: float) -> None:
        if isinstance(message, _Release):
            if message.dispatched:
                self.scheduler.on_done(message.request_id, now)
            else:
                self.scheduler.cancel(message.request_id, now)
            self._tickets.pop(message.request_id, None)
            return
        if message.reply.done():  # the handler gave up before we got here
            return
        verdict = self.scheduler.submit(message.request, now)
        if isinstance(verdict, Rejected):
            self.rejected += 1
            error: Exception
            if verdict.reason == RejectReason.DUPLICATE:
                error = BadRequestError(verdict.message)
            else:
                error = OverloadedError(verdict.message, verdict.retry_after_s)
            message.reply.set_exception(error)
            return
        assert isinstance(verdict, Admitted)
        self.accepted += 1
        decision: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        ticket = Ticket(message.request.request_id, decision)
        self._tickets[ticket.request_id] = ticket
        message.reply.set_result(ticket)

    def _decide(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            ticket = self._tickets.get(decision.request_id)
            if ticket is None or ticket.decision.done():
                # The handler left between our decision and now; its release will follow.
                continue
            assert isinstance(decision, Dispatch | Expired)
            ticket.decision.set_result(decision)
