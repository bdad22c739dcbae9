"""`GenerationService` over the core loop and a scripted backend: the request path, one way.

Unit tests of the shell only; tests/integration/ prove the same path against the real Triton.
"""

from __future__ import annotations

import asyncio

import pytest
import structlog.testing

from scheduler_svc.contracts.generation import Delta, Final, Finish, GenerationParams
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.errors import (
    BackendFailedError,
    BadRequestError,
    OverloadedError,
    QueueTimeoutError,
)
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.service import GenerationService
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.stack import TOKENIZER, collect, serve
from scheduler_svc.testing.waiting import until

WORD = TOKENIZER.encode(" hello", add_special_tokens=False).ids[0]


def test_text_in_text_out_through_a_static_batch() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.STATIC, 64), first_id=WORD)

    async def body(service: GenerationService, _: CoreLoop) -> None:
        params = [
            GenerationParams(f"r{i}", prompt="Tell me a story", max_tokens=1) for i in range(3)
        ]
        answers = await asyncio.gather(*(collect(service, p) for p in params))
        for events in answers:
            final = events[-1]
            assert isinstance(final, Final)
            assert final.text == " hello" and final.completion_tokens == 1
            assert final.finish is Finish.LENGTH and final.lane == "hot"
            assert "".join(e.text for e in events if isinstance(e, Delta)) == " hello"
        assert sum(len(call.rows) for call in backend.calls) == 3

    serve(backend, body)


def test_a_stop_string_ends_the_answer_and_stops_the_row_in_the_engine() -> None:
    backend = ScriptedBackend(first_id=WORD)

    async def body(service: GenerationService, _: CoreLoop) -> None:
        events = await collect(
            service, GenerationParams("r", prompt="Say hello", max_tokens=50, stop=("hello",))
        )
        final = events[-1]
        assert isinstance(final, Final) and final.finish is Finish.STOP
        assert final.completion_tokens < 50
        call = backend.calls[0]
        await until(lambda: call.stopped or call.finished, "the engine request ends")
        assert backend.calls[0].stopped  # the engine request ended early, not at max_tokens
        assert service.outcomes["ok"] == 1

    serve(backend, body)


def test_a_queue_timeout_and_a_backend_failure_reach_the_caller_as_their_errors() -> None:
    backend = ScriptedBackend(
        EngineProfile(Batching.STATIC, 64), fail_with=BackendFailedError("boom")
    )

    async def body(service: GenerationService, _: CoreLoop) -> None:
        backend.hold()
        first = asyncio.ensure_future(collect(service, GenerationParams("a", prompt="x y z")))
        await until(lambda: bool(backend.calls), "the engine is busy with a")
        try:  # the engine is busy with "a": "b" waits past its own timeout
            await collect(service, GenerationParams("b", prompt="x y z", queue_timeout_s=0.05))
        except QueueTimeoutError as exc:
            assert "queue" in str(exc)
        else:
            raise AssertionError("expected a queue timeout")
        backend.release()
        try:
            await first
        except BackendFailedError as exc:
            assert "boom" in str(exc)
        else:
            raise AssertionError("expected the backend's failure")
        assert service.outcomes["queue_timeout"] == 1 and service.outcomes["backend_failed"] == 1

    lane = {"name": "hot", "queue_timeout_s": None, "max_wait_s": None}
    serve(backend, body, {"policy": {"lanes": [lane], "max_batches_in_flight": 1}})


def test_a_request_id_is_a_label_clients_may_reuse_at_once() -> None:
    backend = ScriptedBackend(first_id=WORD)

    async def body(service: GenerationService, _: CoreLoop) -> None:
        backend.hold()
        same = [GenerationParams("client-1", prompt="Tell me a story", max_tokens=2)] * 4
        tasks = [asyncio.create_task(collect(service, p)) for p in same]
        await asyncio.sleep(0)
        backend.release()
        for events in await asyncio.gather(*tasks):
            final = events[-1]
            assert isinstance(final, Final) and final.request_id == "client-1"
            assert final.completion_tokens == 2
        engine_ids = {row.request_id for call in backend.calls for row in call.rows}
        assert len(engine_ids) == 4 and "client-1" not in engine_ids  # its own id inside

    serve(backend, body)


def test_a_request_may_set_its_end_and_pad_ids_within_the_vocabulary() -> None:
    backend = ScriptedBackend(first_id=WORD)

    async def body(service: GenerationService, _: CoreLoop) -> None:
        await collect(service, GenerationParams("e", prompt="hi", max_tokens=2, end_id=9, pad_id=0))
        [row] = backend.calls[-1].rows
        assert (row.end_id, row.pad_id) == (9, 0)
        for bad in ({"end_id": -2}, {"pad_id": 10**9}):
            with pytest.raises(BadRequestError, match=next(iter(bad))):
                await collect(service, GenerationParams("b", prompt="hi", **bad))  # type: ignore[arg-type]

    serve(backend, body)


def test_log_probs_come_with_their_tokens_for_the_rows_that_ask() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.STATIC, 64), first_id=WORD)

    async def body(service: GenerationService, _: CoreLoop) -> None:
        asked, plain = await asyncio.gather(
            collect(
                service, GenerationParams("a", prompt="Hi", max_tokens=3, return_log_probs=True)
            ),
            collect(service, GenerationParams("b", prompt="Hi", max_tokens=3)),
        )
        deltas = [e for e in asked if isinstance(e, Delta) and e.token_ids]
        assert all(e.log_probs is not None and len(e.log_probs) == len(e.token_ids) for e in deltas)
        final = asked[-1]
        assert isinstance(final, Final) and len(final.token_ids) == 3
        # The scripted backend's log probabilities, in order: -1 / (position + 1).
        assert final.log_probs == pytest.approx((-1.0, -0.5, -1 / 3))
        last = plain[-1]
        assert isinstance(last, Final) and last.log_probs is None
        assert all(e.log_probs is None for e in plain if isinstance(e, Delta))
        # Both rows went out in one engine request; only one asked.
        assert [[r.return_log_probs for r in c.rows] for c in backend.calls] == [[True, False]]

    serve(backend, body)


def test_a_request_refused_at_arrival_says_why_in_the_log() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.STATIC, 64), first_id=WORD)

    async def body(service: GenerationService, _: CoreLoop) -> None:
        backend.hold()
        running = asyncio.ensure_future(collect(service, GenerationParams("a", prompt="x")))
        await until(lambda: bool(backend.calls), "the engine is busy with a")
        queued = asyncio.ensure_future(collect(service, GenerationParams("b", prompt="x")))
        await until(lambda: service.loop.scheduler.stats().queued == 1, "b waits in its lane")
        with structlog.testing.capture_logs() as logs, pytest.raises(OverloadedError):
            # The same tenant as b's: a full lane pushes out only a tenant over its share.
            await collect(service, GenerationParams("c", prompt="x"))
        refused = [e for e in logs if e["event"] == "request refused"]
        assert len(refused) == 1 and refused[0]["request_id"] == "c"
        assert refused[0]["outcome"] == "overloaded" and "is full" in refused[0]["reason"]
        backend.release()
        await asyncio.gather(running, queued)

    lane = {"name": "hot", "max_queued": 1, "queue_timeout_s": None, "max_wait_s": None}
    serve(backend, body, {"policy": {"lanes": [lane], "max_batches_in_flight": 1}})
