"""The tokenizer queue: bounded before any work, taken in turn by tenant, and a caller that
leaves neither runs its prompt nor frees a thread that is still busy."""

from __future__ import annotations

import asyncio
import threading

import pytest

from scheduler_svc.errors import OverloadedError
from scheduler_svc.serving.tokenqueue import TokenizerQueue


class Gate:
    """Work that blocks its thread until opened, recording the order things ran in."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.ran: list[str] = []

    def work(self, name: str, block: bool = False):  # type: ignore[no-untyped-def]
        def run() -> str:
            if block:
                self.open.wait(10)
            self.ran.append(name)
            return name

        return run


async def until_waiting(queue: TokenizerQueue, count: int) -> None:
    for _ in range(1000):
        if queue.waiting == count:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never {count} waiting")


def test_a_full_queue_refuses_at_once_and_one_tenant_may_fill_half() -> None:
    async def main() -> None:
        queue = TokenizerQueue(1, max_waiting=3, max_waiting_bytes=1000, retry_after_s=0.5)
        gate = Gate()
        busy = asyncio.create_task(queue.run("a", 10, gate.work("busy", block=True)))
        await asyncio.sleep(0.01)
        first = asyncio.create_task(queue.run("a", 400, gate.work("a1")))
        await until_waiting(queue, 1)
        with pytest.raises(OverloadedError, match="tenant 'a' has 400 bytes"):
            await queue.run("a/sub", 200, gate.work("a2"))  # a sub-tenant counts as its root
        with pytest.raises(OverloadedError, match="queue full") as caught:
            await queue.run("b", 700, gate.work("b-too-big"))
        assert caught.value.retry_after_s == 0.5
        others = [asyncio.create_task(queue.run(t, 10, gate.work(t))) for t in ("b", "c")]
        await until_waiting(queue, 3)
        with pytest.raises(OverloadedError, match="3 prompts"):
            await queue.run("d", 10, gate.work("d"))
        gate.open.set()
        assert await asyncio.gather(busy, first, *others) == ["busy", "a1", "b", "c"]
        assert "a2" not in gate.ran and "b-too-big" not in gate.ran and queue.waiting == 0
        queue.close()

    asyncio.run(main())


def test_tenants_take_turns_whatever_one_has_queued() -> None:
    async def main() -> None:
        queue = TokenizerQueue(1, max_waiting=100, max_waiting_bytes=10_000, retry_after_s=0.5)
        gate = Gate()
        busy = asyncio.create_task(queue.run("flood", 10, gate.work("busy", block=True)))
        await asyncio.sleep(0.01)
        flood = [
            asyncio.create_task(queue.run(f"flood/{i}", 10, gate.work(f"f{i}"))) for i in range(6)
        ]
        await until_waiting(queue, 6)
        quiet = asyncio.create_task(queue.run("quiet", 10, gate.work("q")))
        await until_waiting(queue, 7)
        gate.open.set()
        await asyncio.gather(busy, quiet, *flood)
        # The flood's first waiting prompt had its turn, then the quiet tenant's: it waited
        # for one prompt, not six.
        assert gate.ran[:3] == ["busy", "f0", "q"]
        queue.close()

    asyncio.run(main())


def test_a_caller_that_leaves_is_dropped_and_a_busy_thread_stays_counted() -> None:
    async def main() -> None:
        queue = TokenizerQueue(1, max_waiting=10, max_waiting_bytes=1000, retry_after_s=0.5)
        gate = Gate()
        busy = asyncio.create_task(queue.run("a", 10, gate.work("busy", block=True)))
        await asyncio.sleep(0.01)
        leaves = asyncio.create_task(queue.run("b", 10, gate.work("left")))
        await until_waiting(queue, 1)
        leaves.cancel()
        busy.cancel()  # its prompt keeps its thread until the work ends
        await asyncio.sleep(0.01)
        assert queue.waiting == 0
        after = asyncio.create_task(queue.run("c", 10, gate.work("after")))
        await until_waiting(queue, 1)  # waits: the only thread is still busy
        assert gate.ran == []
        gate.open.set()
        assert await after == "after"
        assert gate.ran == ["busy", "after"]  # the left caller's prompt never ran
        for task in (busy, leaves):
            with pytest.raises(asyncio.CancelledError):
                await task
        queue.close()

    asyncio.run(main())
