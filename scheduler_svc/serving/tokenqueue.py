"""Prompts waiting for the tokenizer threads: bounded, and taken in turn by tenant.

Long prompts are tokenized on a few threads (the tokenizer lets go of the GIL there). Before,
a shared pool with an unbounded queue let one client's burst of huge prompts sit in front of
everyone's: another tenant's 1,000-character prompt waited ~0.7 s behind 40 prompts of 120 KB.
Here:

- **Bounded before any work**: at most `max_waiting_bytes` of prompt text waits (a tenant at
  most half of it) and `max_waiting` prompts; past that a prompt is refused at once,
  RESOURCE_EXHAUSTED with a retry hint.
- **In turn by tenant**: a free thread takes the next prompt of the tenant after the one it
  served last (round robin over tenants with prompts waiting, FIFO within one), so a quiet
  tenant waits for at most one prompt per thread, whatever another has queued. The turn key is
  the tenant's root (`team-a/x` queues as `team-a`): naming sub-tenants buys no extra turns.
- A waiting prompt whose caller leaves is dropped; a running one finishes on its thread and its
  place is freed when it does, so never more than `threads` run.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from scheduler_svc.errors import OverloadedError, clip

T = TypeVar("T")


@dataclass
class _Waiting:
    turn: asyncio.Future[None]
    size: int
    tenant: str = field(repr=False)


class TokenizerQueue:
    def __init__(
        self,
        threads: int,
        max_waiting: int,
        max_waiting_bytes: int,
        retry_after_s: float,
    ) -> None:
        self.threads = threads
        self.max_waiting = max_waiting
        self.max_waiting_bytes = max_waiting_bytes
        self.retry_after_s = retry_after_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._running = 0
        # Tenants with prompts waiting, in turn order (the next to be served first).
        self._waiting: OrderedDict[str, deque[_Waiting]] = OrderedDict()
        self._count = 0
        self._bytes = 0
        self._tenant_bytes: dict[str, int] = {}

    @property
    def waiting(self) -> int:
        return self._count

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, tenant: str, size: int, work: Callable[[], T]) -> T:
        """`work()` on a tokenizer thread once it is this prompt's turn; `size`: its bytes."""
        if self._running >= self.threads or self._waiting:
            await self._wait_turn(tenant.split("/", 1)[0], size)
        else:
            self._running += 1
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(self._pool, work)
        done.add_done_callback(self._finished)
        # Shielded: a caller that leaves does not free the thread before its work ends.
        return await asyncio.shield(done)

    async def _wait_turn(self, key: str, size: int) -> None:
        mine = self._tenant_bytes.get(key, 0)
        if self._count >= self.max_waiting or self._bytes + size > self.max_waiting_bytes:
            raise OverloadedError(
                f"tokenizer queue full: {self._count} prompts ({self._bytes:,} bytes) wait "
                "to be tokenized",
                self.retry_after_s,
            )
        if mine + size > self.max_waiting_bytes // 2:
            raise OverloadedError(
                f"tokenizer queue: tenant {clip(key)} has {mine:,} bytes of prompts waiting, "
                f"at most half the queue's {self.max_waiting_bytes:,} per tenant",
                self.retry_after_s,
            )
        entry = _Waiting(asyncio.get_running_loop().create_future(), size, key)
        self._waiting.setdefault(key, deque()).append(entry)
        self._count += 1
        self._bytes += size
        self._tenant_bytes[key] = mine + size
        try:
            await entry.turn
        except asyncio.CancelledError:
            if entry.turn.done() and not entry.turn.cancelled():
                self._release()  # its turn had come: pass it on
            else:
                self._drop(entry)
            raise

    def _leave(self, entry: _Waiting) -> None:
        self._count -= 1
        self._bytes -= entry.size
        left = self._tenant_bytes[entry.tenant] - entry.size
        if left:
            self._tenant_bytes[entry.tenant] = left
        else:
            del self._tenant_bytes[entry.tenant]

    def _drop(self, entry: _Waiting) -> None:
        queue = self._waiting.get(entry.tenant)
        if queue is not None and entry in queue:
            queue.remove(entry)
            self._leave(entry)
            if not queue:
                del self._waiting[entry.tenant]

    def _finished(self, done: asyncio.Future[Any]) -> None:
        if not done.cancelled():
            done.exception()  # read here: a caller that left never will
        self._release()

    def _release(self) -> None:
        self._running -= 1
        while self._running < self.threads and self._waiting:
            key, queue = next(iter(self._waiting.items()))
            entry = queue.popleft()
            if queue:
                self._waiting.move_to_end(key)  # its next prompt waits for the others' turns
            else:
                del self._waiting[key]
            self._leave(entry)
            if entry.turn.done():  # its caller left; it is being dropped
                continue
            self._running += 1
            entry.turn.set_result(None)
