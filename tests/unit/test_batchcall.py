"""Dispatch mode `batch` in the shell, against a test double of the backend (the real Triton
path is tested in tests/integration/test_policy_live.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from scheduler_svc.backends.base import GenerationInput
from scheduler_svc.batchcall import BatchCalls
from scheduler_svc.core.types import BatchInfo, Target
from scheduler_svc.errors import BackendFailedError


class FakePool:
    """Streams scripted (row, ids) answers; can fail midway; records what it was asked."""

    def __init__(self, script: list[tuple[int, list[int]]], fail_after: int | None = None) -> None:
        self.script = script
        self.fail_after = fail_after
        self.requests: list[list[GenerationInput]] = []
        self.cancelled = False

    async def stream_batch(
        self, request_id: str, rows: list[GenerationInput], timeout_s: float | None
    ) -> AsyncGenerator[tuple[int, list[int]], None]:
        self.requests.append(rows)
        try:
            for n, answer in enumerate(self.script):
                if self.fail_after is not None and n == self.fail_after:
                    raise BackendFailedError("backend failed the request: engine crashed")
                await asyncio.sleep(0.01)
                yield answer
            await asyncio.sleep(10)  # the engine would hold the request open
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled = True
            raise


def row(rid: str, max_tokens: int) -> GenerationInput:
    return GenerationInput(rid, (5, 6, 7), max_tokens, end_id=1, pad_id=2)


BATCH = BatchInfo(7, "hot", Target.PRIMARY, 16, (3, 3, 3))


async def collect(stream: AsyncGenerator[list[int], None]) -> list[int] | BaseException:
    out: list[int] = []
    try:
        async with contextlib.aclosing(stream) as tokens:
            async for ids in tokens:
                out.extend(ids)
    except BackendFailedError as exc:
        return exc
    return out


def test_rows_are_routed_by_batch_index_and_end_with_their_own_row() -> None:
    async def scenario() -> list[Any]:
        pool = FakePool([(0, [10]), (1, [20]), (2, [30]), (0, [11]), (1, [1]), (2, [31])])
        calls = BatchCalls(pool)  # type: ignore[arg-type]
        streams = [calls.rows(BATCH, row(f"r{i}", 2)) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 5)
        assert len(pool.requests) == 1 and [r.request_id for r in pool.requests[0]] == [
            "r0",
            "r1",
            "r2",
        ]
        await asyncio.sleep(0.05)
        assert pool.cancelled  # every member got its answer and left: the request is cancelled
        return results

    # r1 ends at its end token (1), the others at their max_tokens (2)
    assert asyncio.run(scenario()) == [[10, 11], [20, 1], [30, 31]]


def test_a_failure_mid_stream_ends_every_member_with_the_same_error() -> None:
    async def scenario() -> list[Any]:
        pool = FakePool([(0, [10]), (1, [20]), (2, [30])], fail_after=2)
        calls = BatchCalls(pool)  # type: ignore[arg-type]
        streams = [calls.rows(BATCH, row(f"r{i}", 50)) for i in range(3)]
        return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 5)

    results = asyncio.run(scenario())
    assert all(isinstance(r, BackendFailedError) for r in results), results
    assert {str(r) for r in results} == {"backend failed the request: engine crashed"}


def test_a_missing_member_does_not_hold_the_batch_back() -> None:
    async def scenario() -> list[Any]:
        pool = FakePool([(0, [10]), (1, [20])])
        calls = BatchCalls(pool, join_window_s=0.05)  # type: ignore[arg-type]
        streams = [calls.rows(BATCH, row(f"r{i}", 1)) for i in range(2)]  # the third never comes
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 5)
        assert len(pool.requests[0]) == 2
        return results

    assert asyncio.run(scenario()) == [[10], [20]]


def test_a_member_joining_after_the_start_runs_alone() -> None:
    class Alone(FakePool):
        async def stream(self, request: GenerationInput) -> AsyncGenerator[list[int], None]:
            yield [99]

    async def scenario() -> list[Any]:
        pool = Alone([(0, [10]), (1, [20])])
        calls = BatchCalls(pool, join_window_s=0.01)  # type: ignore[arg-type]
        first = [calls.rows(BATCH, row(f"r{i}", 1)) for i in range(2)]
        await asyncio.sleep(0.05)  # the window closed and the call started without r2
        late_stream = calls.rows(BATCH, row("r2", 1))
        return await asyncio.wait_for(
            asyncio.gather(*(collect(s) for s in [*first, late_stream])), 5
        )

    assert asyncio.run(scenario()) == [[10], [20], [99]]
