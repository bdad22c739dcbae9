"""Dispatch mode `batch`: the rows of one released batch go to Triton as one request.

Each member's handler joins its batch's call with its own input; the call starts when every
member has joined (or `join_window_s` after the first, if one went missing), sends one
multi-row request, and routes each streamed response to its row by `batch_index`. A member's
stream ends when its row has its max_tokens or its end token, or when the whole request ends.
A member that leaves early stops reading (its row runs on inside the engine until the request
ends; the engine cannot stop one row of a request); when every member has left, the request is
cancelled. A failure of the request ends every member with the same error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from scheduler_svc.backends.base import GenerationInput
from scheduler_svc.backends.pool import TritonPool
from scheduler_svc.core.types import BatchInfo

_End = None


class BatchCalls:
    """The open batch calls of one backend, by batch id."""

    def __init__(self, backend: TritonPool, join_window_s: float = 0.02) -> None:
        self.backend = backend
        self.join_window_s = join_window_s
        self._open: dict[int, _BatchCall] = {}
        self._started: dict[int, None] = {}  # recently started batch ids, oldest first
        self.calls = 0  # multi-row requests sent (for tests and stats)

    def rows(self, batch: BatchInfo, row: GenerationInput) -> AsyncGenerator[list[int], None]:
        """This member's tokens, from its batch's shared request."""
        if batch.batch_id in self._started:  # joined too late: run alone, do not hold it up
            return self.backend.stream(row)
        call = self._open.get(batch.batch_id)
        if call is None:
            call = _BatchCall(self, batch, self.join_window_s)
            self._open[batch.batch_id] = call
        return call.stream(call.join(row))

    def _closed(self, batch_id: int) -> None:
        self._open.pop(batch_id, None)
        self._started[batch_id] = None
        while len(self._started) > 4096:
            del self._started[next(iter(self._started))]


class _BatchCall:
    def __init__(self, owner: BatchCalls, batch: BatchInfo, window_s: float) -> None:
        self.owner = owner
        self.batch = batch
        self.rows: list[GenerationInput] = []
        self.queues: list[asyncio.Queue[list[int] | BaseException | None]] = []
        self.left: set[int] = set()
        self.started = False
        self.task: asyncio.Task[None] | None = None
        self.timer = asyncio.get_running_loop().call_later(window_s, self.start)

    def join(self, row: GenerationInput) -> int:
        self.rows.append(row)
        self.queues.append(asyncio.Queue())
        if len(self.rows) == self.batch.size:
            self.start()
        return len(self.rows) - 1

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self.timer.cancel()
        self.owner._closed(self.batch.batch_id)  # later arrivals run alone
        self.owner.calls += 1
        self.task = asyncio.create_task(self._run(), name=f"batch-{self.batch.batch_id}")

    async def _run(self) -> None:
        timeouts = [r.timeout_s for r in self.rows]
        timeout = None if None in timeouts else max(t for t in timeouts if t is not None)
        request_id = f"batch-{self.batch.batch_id}-" + self.rows[0].request_id
        stream = self.owner.backend.stream_batch(request_id, self.rows, timeout)
        try:
            async with contextlib.aclosing(stream) as answers:
                async for index, ids in answers:
                    if 0 <= index < len(self.queues) and index not in self.left:
                        self.queues[index].put_nowait(ids)
        except Exception as exc:  # every member gets the request's error
            for queue in self.queues:
                queue.put_nowait(exc)
            return
        for queue in self.queues:
            queue.put_nowait(_End)

    async def stream(self, slot: int) -> AsyncGenerator[list[int], None]:
        row = self.rows[slot]
        produced = 0
        try:
            while True:
                item = await self.queues[slot].get()
                if item is _End:
                    return
                if isinstance(item, BaseException):
                    raise item
                produced += len(item)
                yield item
                if produced >= row.max_tokens or row.end_id in item:
                    return  # this row is done, whatever its neighbours still do
        finally:
            self.left.add(slot)
            everyone_left = len(self.left) == len(self.rows)
            if everyone_left and self.task is not None and not self.task.done():
                self.task.cancel()
