"""Batch runners: a released batch goes to the backend as the unit the engine runs.

The core loop hands each batch the core releases to the runner of its target, as a `BatchJob`:
the batch and, for each member, its engine input and its `RowChannel`. The runner works in its
own tasks, so the loop never waits on I/O:
- `RowRunner` (in-flight engines, and the degrade / elastic targets): one stream per row. The
  engine merges rows into its running batch at every step, so rows need not travel together.
- `StaticRunner` (static-batching engines): one multi-row request per batch, its answers routed
  to each row by `batch_index`. The engine runs exactly the batch the policy formed.

Each member reads only its own row's channel. A reader that leaves closes its channel: a row
stream is then stopped inside the engine at once; a multi-row request runs on (the engine
cannot stop one row of it) until every reader has left. The runner reports each row's end to
the loop (`RowReport.done`) when the engine lets go of it: for a static batch that is when the
whole request ends, since its rows' KV blocks and its engine slot are freed together.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog

from scheduler_svc.core.admission import PROGRESS_EVERY_TOKENS
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.core.types import BatchInfo
from scheduler_svc.errors import (
    BackendFailedError,
    BackendStalledError,
    MaxDurationError,
    RequestError,
    ShuttingDownError,
)
from scheduler_svc.serving.backends.base import Backend, GenerationInput, Tokens

log = structlog.get_logger("scheduler_svc.runner")

DEFAULT_STALL_S = 30.0
_END = None
_T = TypeVar("_T")


class RowChannel:
    """One member's row: the runner puts new ids (with their log probabilities, where asked),
    then one end (or an error); the member reads.

    It holds at most the row's max_tokens ids plus its end, since the runner stops a row there.
    """

    def __init__(self) -> None:
        self._items: asyncio.Queue[Tokens | BaseException | None] = asyncio.Queue()
        self.ended = False  # the runner said its last word
        self.closed = False  # the reader left
        self._on_close: list[Callable[[], None]] = []

    # -- the runner's side -------------------------------------------------------------------

    def put(self, tokens: Tokens) -> None:
        if not self.ended and not self.closed:
            self._items.put_nowait(tokens)

    def end(self, error: BaseException | None = None) -> None:
        if not self.ended:
            self.ended = True
            self._items.put_nowait(_END if error is None else error)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the reader leaves (at once if it has)."""
        if self.closed:
            callback()
        else:
            self._on_close.append(callback)

    # -- the reader's side -------------------------------------------------------------------

    async def tokens(self, deadline: float | None = None) -> AsyncGenerator[Tokens, None]:
        """Yield the row's new ids until its end; raise the runner's error if it failed, and
        MaxDurationError if the end has not come by `deadline` (the event loop's clock)."""
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await self._items.get()
            except TimeoutError:
                raise MaxDurationError(
                    "the request ran past the server's maximum duration (server.max_request_s)"
                ) from None
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """The reader leaves (done, stopped at a stop string, or gone)."""
        if self.closed:
            return
        self.closed = True
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()


@dataclass
class Row:
    request_id: str
    input: GenerationInput
    channel: RowChannel


@dataclass
class BatchJob:
    batch: BatchInfo
    rows: list[Row] = field(default_factory=list)


class RowReport(Protocol):
    """Where a runner reports its rows (the core loop)."""

    def progress(self, request_id: str, output_tokens: int) -> None: ...

    def done(self, request_id: str, output_tokens: int | None) -> None:
        """The engine let go of the row; `output_tokens` where it ran to its natural end."""
        ...


class _Runner:
    """What both runners share: their tasks, and how a failure reaches a row."""

    def __init__(
        self, backend: Backend, report: RowReport, stall_s: float = DEFAULT_STALL_S
    ) -> None:
        self.backend = backend
        self.report = report
        self.stall_s = stall_s
        self._tasks: set[asyncio.Task[None]] = set()

    async def _watched(self, answers: AsyncIterator[_T]) -> AsyncGenerator[_T, None]:
        """`answers`, ended with BackendStalledError when the backend sends nothing (no token,
        no end) for `stall_s`: a frozen Triton holds nobody forever."""
        while True:
            try:
                async with asyncio.timeout(self.stall_s):
                    item = await anext(answers)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise BackendStalledError(
                    f"Triton sent nothing for {self.stall_s:g} s (triton.stall_timeout_s); "
                    "the request was ended"
                ) from None
            yield item

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop every request still running (shutdown); each row's reader gets an error."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _failure(exc: BaseException) -> BaseException:
    if isinstance(exc, asyncio.CancelledError):
        return ShuttingDownError("the sidecar stopped this request while shutting down")
    if isinstance(exc, RequestError):
        return exc
    log.exception("batch runner failed", exc_info=exc)
    return BackendFailedError(f"the sidecar failed to run the request: {type(exc).__name__}")


class RowRunner(_Runner):
    """One backend stream per row."""

    def start(self, job: BatchJob) -> None:
        for row in job.rows:
            self._spawn(self._row(row), f"row-{row.request_id}")

    async def _row(self, row: Row) -> None:
        me = asyncio.current_task()
        assert me is not None
        produced, natural, error = 0, False, None

        def reader_left() -> None:
            if not row.channel.ended:
                me.cancel()  # the row's stream is then stopped inside the engine

        row.channel.on_close(reader_left)
        try:
            if not row.channel.closed:  # a reader that left before dispatch costs nothing
                async with contextlib.aclosing(self.backend.stream(row.input)) as answers:
                    async for tokens in self._watched(answers):
                        produced = self._deliver(row, produced, tokens)
                natural = True
        except BaseException as exc:
            error = exc
        finally:
            row.channel.end(None if error is None else _failure(error))
            self.report.done(row.request_id, produced if natural else None)

    def _deliver(self, row: Row, produced: int, tokens: Tokens) -> int:
        row.channel.put(tokens)
        now = produced + len(tokens.ids)
        # The first tokens say the prompt is prefilled (the policy's prefill shares); then
        # every PROGRESS_EVERY_TOKENS (its KV growth).
        first = produced == 0 < now
        if first or now // PROGRESS_EVERY_TOKENS > produced // PROGRESS_EVERY_TOKENS:
            self.report.progress(row.request_id, now)
        return now


class StaticRunner(_Runner):
    """One multi-row request per batch; each row's answers go to its own channel."""

    def __init__(
        self, backend: Backend, report: RowReport, stall_s: float = DEFAULT_STALL_S
    ) -> None:
        super().__init__(backend, report, stall_s)
        # Engine request ids must not collide with another sidecar's on the same Triton.
        self._prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)

    def start(self, job: BatchJob) -> None:
        self._spawn(self._batch(job), f"batch-{job.batch.batch_id}")

    async def _batch(self, job: BatchJob) -> None:
        me = asyncio.current_task()
        assert me is not None
        rows = job.rows
        produced = [0] * len(rows)
        finished = [False] * len(rows)

        def reader_left() -> None:
            # Nobody reads any more while a row still runs: end the request inside the engine.
            # (Once every row has ended, the request is finishing by itself.)
            open_rows = [r for r in rows if not r.channel.ended]
            if open_rows and all(r.channel.closed for r in open_rows):
                me.cancel()

        for row in rows:
            row.channel.on_close(reader_left)
        error: BaseException | None = None
        try:
            if not all(r.channel.closed for r in rows):
                await self._run(job, produced, finished)
        except BaseException as exc:
            error = exc
        finally:
            for i, row in enumerate(rows):
                # The request is over: a row still open ended with it (or with its error).
                row.channel.end(None if error is None else _failure(error))
                if error is None:
                    finished[i] = True
                self.report.done(row.request_id, produced[i] if finished[i] else None)

    async def _run(self, job: BatchJob, produced: list[int], finished: list[bool]) -> None:
        rows = job.rows
        inputs = [r.input for r in rows]
        timeouts = [i.timeout_s for i in inputs]
        timeout = None if None in timeouts else max(t for t in timeouts if t is not None)
        request_id = f"{self._prefix}-b{next(self._ids)}"
        answers = self.backend.stream_batch(request_id, inputs, timeout)
        async with contextlib.aclosing(answers) as stream:
            async for index, tokens in self._watched(stream):
                if not 0 <= index < len(rows) or finished[index]:
                    continue  # a row past its end keeps computing pads inside the engine
                row, inp = rows[index], inputs[index]
                before = produced[index]
                produced[index] += len(tokens.ids)
                row.channel.put(tokens)
                if produced[index] >= inp.max_tokens or inp.end_id in tokens.ids:
                    finished[index] = True
                    row.channel.end()
                elif produced[index] // PROGRESS_EVERY_TOKENS > before // PROGRESS_EVERY_TOKENS:
                    self.report.progress(row.request_id, produced[index])


Runner = RowRunner | StaticRunner


def runner_for(
    profile: EngineProfile, backend: Backend, report: RowReport, stall_s: float = DEFAULT_STALL_S
) -> Runner:
    """The runner an engine profile calls for."""
    if profile.batching is Batching.STATIC:
        return StaticRunner(backend, report, stall_s)
    return RowRunner(backend, report, stall_s)
