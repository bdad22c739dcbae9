"""The Triton adapter's streams on the real Triton: a call carries one request at a time and is
reused once that request has ended cleanly (a final answer, or a stop the engine answered)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from scheduler_svc.config import TritonConfig
from scheduler_svc.errors import DeadlineError
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.triton import TritonBackend
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.prompts import MIXED, STORY, tokens
from tests.integration.sidecar import eventually
from tests.integration.tritonio import engine_metric, engine_request, infer, scrape

ENGINE = "tensorrt_llm"


def _row(
    request_id: str, text: str, max_tokens: int, timeout_s: float | None = None
) -> GenerationInput:
    return GenerationInput(
        request_id, tuple(tokens(text)), max_tokens, end_id=-1, pad_id=2, timeout_s=timeout_s
    )


async def _ids(backend: TritonBackend, row: GenerationInput) -> list[int]:
    out: list[int] = []
    async with contextlib.aclosing(backend.stream(row)) as answers:
        async for got in answers:
            out += got.ids
    return out


def _stopped(triton: TritonServer) -> float:
    samples = scrape(triton.metrics_url)
    return engine_metric(
        samples, "scheduler_svc_engine_requests_ended_early_total", ENGINE, how="stopped"
    )


def test_one_call_serves_requests_in_turn_stopped_and_timed_out_ones_included(
    triton: TritonServer,
) -> None:
    direct = infer(triton.grpc_url, ENGINE, engine_request(tokens(MIXED), 6)).tokens()
    stopped_before = _stopped(triton)

    async def run() -> None:
        backend = TritonBackend(TritonConfig(url=triton.grpc_url, engine_model=ENGINE))
        await backend.start()
        try:
            # Served in turn: one call, and each answer is the engine's own.
            assert await _ids(backend, _row("a", MIXED, 6)) == direct
            assert await _ids(backend, _row("b", MIXED, 6)) == direct
            assert backend.streams_opened == 1
            # A reader that leaves after two answers: the request is stopped inside the engine
            # and its call serves the next request.
            async with contextlib.aclosing(backend.stream(_row("c", STORY, 800))) as answers:
                for _ in range(2):
                    await anext(answers)
            assert await _ids(backend, _row("d", MIXED, 6)) == direct
            assert backend.streams_opened == 1
            # Past its deadline: DeadlineError, the engine stops it, the call lives on.
            with pytest.raises(DeadlineError, match="deadline passed"):
                await _ids(backend, _row("e", STORY, 800, timeout_s=0.3))
            assert await _ids(backend, _row("f", MIXED, 6)) == direct
            assert backend.streams_opened == 1
            # Two at once: two calls (a call never carries two requests).
            both = await asyncio.gather(
                _ids(backend, _row("g", MIXED, 6)), _ids(backend, _row("h", MIXED, 6))
            )
            assert both == [direct, direct]
            assert backend.streams_opened == 2
        finally:
            await backend.close()

    asyncio.run(run())
    eventually(
        lambda: _stopped(triton) == stopped_before + 2,
        "the engine counts the left and the timed-out request as stopped",
    )
