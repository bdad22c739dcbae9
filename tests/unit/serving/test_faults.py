"""Faults that must not stall or silence a request: an atomic scheduling step, a silent or
malformed backend, the maximum duration, expel, the KV poller, and streams cut off at their
bounds.

tests/integration/test_hardening_live.py proves the same against the real Triton."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from scheduler_svc.contracts.generation import GenerationParams
from scheduler_svc.core.config import PolicyConfig
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.types import Admitted, Request, StepFailedError
from scheduler_svc.errors import (
    BackendStalledError,
    BadRequestError,
    InternalError,
    MaxDurationError,
    ShuttingDownError,
)
from scheduler_svc.serving import auth
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.kvpoll import parse_kv_blocks, poll_kv
from scheduler_svc.serving.fronts.guard import Identity
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.service import GenerationService
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.stack import collect, serve
from scheduler_svc.testing.waiting import until

# -- an atomic scheduling step --------------------------------------------------------------


def test_a_step_that_fails_hands_over_what_it_decided_and_leaks_nothing() -> None:
    policy = PolicyScheduler(PolicyConfig())
    for i, prompt in enumerate((10, 10, 600)):  # hot, hot, warm: two buckets
        verdict = policy.submit(Request(f"r{i}", prompt, 8), 0.0)
        assert isinstance(verdict, Admitted)
    calls = {"n": 0}
    need = policy.mirror.need

    def failing_need(prompt_tokens: int, output_tokens: int) -> int:
        if prompt_tokens == 600:  # the second batch cannot be worked out
            raise OverflowError("boom")
        calls["n"] += 1
        return need(prompt_tokens, output_tokens)

    policy.mirror.need = failing_need  # type: ignore[method-assign]
    with pytest.raises(StepFailedError) as caught:
        policy.schedule(0.06)  # both buckets ready (50 ms), no queue timeout yet (100 ms)
    released = {d.request_id for d in caught.value.decisions}
    assert released == {"r0", "r1"}  # the first batch went out whole
    assert set(policy.mirror.held()) == released  # reservations only for what went out
    assert set(policy.queued_ids()) == {"r2"}  # the other is still queued, not lost
    policy.mirror.need = need  # type: ignore[method-assign]
    assert {d.request_id for d in policy.schedule(0.07)} == {"r2"}
    assert dict(policy.stats().counters)["step_failed"] == 1


def test_the_core_loop_answers_a_request_the_core_fails_on() -> None:
    async def main() -> None:
        scheduler = PolicyScheduler(PolicyConfig())

        def broken(request: Request, now: float) -> Any:
            raise RuntimeError("a bug")

        scheduler.submit = broken  # type: ignore[method-assign]
        loop = CoreLoop(scheduler)
        loop.start()
        try:
            row = GenerationInput("r", (1, 2), 4, 1, 2)
            with pytest.raises(InternalError):
                await asyncio.wait_for(loop.submit(Request("r", 2, 4), row, None), 5)
        finally:
            await loop.close()

    asyncio.run(main())


# -- faults ---------------------------------------------------------------------------------


def test_a_silent_backend_ends_the_request_unavailable() -> None:
    backend = ScriptedBackend()

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        backend.hold()  # Triton frozen: nothing comes back
        with pytest.raises(BackendStalledError, match=r"sent nothing for 0\.3 s"):
            await collect(service, GenerationParams("r", prompt="hi", max_tokens=4))
        await until(lambda: loop.stats().in_flight == 0)  # its place is free again
        backend.release()

    serve(backend, body, {"triton": {"stall_timeout_s": 0.3}})


def test_a_request_ends_at_the_servers_maximum_duration_even_while_queued() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.STATIC, 1))

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        backend.hold()
        running = asyncio.create_task(collect(service, GenerationParams("a", prompt="hi")))
        await until(lambda: loop.stats().in_flight == 1)
        with pytest.raises(MaxDurationError):  # queued behind it, no client deadline
            await collect(service, GenerationParams("b", prompt="hi"))
        with pytest.raises(MaxDurationError):
            await running
        assert loop.stats().queued == 0
        backend.release()

    serve(
        backend,
        body,
        {
            "server": {"max_request_s": 0.3},
            "triton": {"stall_timeout_s": 30.0},
            "policy": {
                "max_batches_in_flight": 1,
                "kv": {"max_in_flight": 1},
                "lanes": [{"name": "hot", "queue_timeout_s": None}],
            },
        },
    )


def test_expel_answers_queued_and_running_requests() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.STATIC, 1))

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        backend.hold()
        tasks = [
            asyncio.create_task(collect(service, GenerationParams(f"r{i}", prompt="hi")))
            for i in range(3)
        ]
        await until(lambda: loop.accepted == 3)
        assert await loop.expel(ShuttingDownError("bye", 1.0)) == 3
        for task in tasks:
            with pytest.raises(ShuttingDownError) as caught:
                await task
            assert caught.value.retry_after_s == 1.0
        backend.release()

    serve(backend, body, {"policy": {"max_batches_in_flight": 1, "kv": {"max_in_flight": 1}}})


@pytest.mark.parametrize(
    "page",
    [
        "<html><body>502 Bad Gateway</body></html>",
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"} NaN\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 10\n',
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"} 1\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} +Inf\n',
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"} 20\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 10\n',
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"} -1\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 10\n',
        "\x00\xff garbage {{{",
    ],
)
def test_an_unbelievable_metrics_page_gives_no_kv_counts(page: str) -> None:
    assert parse_kv_blocks(page, "tensorrt_llm") is None


def test_the_kv_poller_survives_any_failure_and_recovers() -> None:
    seen: list[tuple[int, int]] = []
    answers: list[Any] = [RuntimeError("boom"), None, (3, 10)]

    async def read() -> tuple[int, int] | None:
        answer = answers.pop(0) if answers else (4, 10)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    async def main() -> None:
        task = asyncio.create_task(poll_kv(lambda f, t: seen.append((f, t)), read, 0.001))
        await until(lambda: len(seen) >= 2)
        assert not task.done()
        task.cancel()

    asyncio.run(main())
    assert seen[:2] == [(3, 10), (4, 10)]


# -- ModelStreamInfer -----------------------------------------------------------------------


class _Context:
    """The little of a servicer context the KServe front reads."""

    def time_remaining(self) -> float | None:
        return None


def _infer(rid: str) -> Any:
    from tritonclient.grpc import service_pb2 as kserve_pb  # noqa: PLC0415

    request = kserve_pb.ModelInferRequest(model_name="ensemble", id=rid)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(len(b"hi").to_bytes(4, "little") + b"hi")
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append((2).to_bytes(4, "little"))
    return request


def test_model_stream_infer_caps_a_stream_and_answers_each_request_once() -> None:
    from scheduler_svc.serving.fronts.kserve import KServeFront  # noqa: PLC0415

    backend = ScriptedBackend()

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        front = KServeFront(service)
        backend.hold()

        async def requests() -> Any:
            for i in range(4):
                yield _infer(f"r{i}")
            await until(lambda: loop.accepted == 2)
            backend.release()  # the first two may now finish
            raise BadRequestError("the request is not a valid message (malformed)")

        answers = []
        with pytest.raises(BadRequestError, match="malformed"):
            async for answer in front.ModelStreamInfer(requests(), _Context()):
                answers.append(answer)
        by_id: dict[str, list[Any]] = {}
        for answer in answers:
            by_id.setdefault(answer.infer_response.id, []).append(answer)
        assert sorted(by_id) == ["r0", "r1", "r2", "r3"]
        for rid in ("r2", "r3"):  # over the cap of 2: refused in-band, carrying the id
            [refused] = by_id[rid]
            assert refused.error_message.startswith("[RESOURCE_EXHAUSTED]")
        for rid in ("r0", "r1"):  # accepted before the bad message: answered, once
            [final] = by_id[rid]
            assert not final.error_message
            assert final.infer_response.parameters["triton_final_response"].bool_param

    serve(backend, body, {"server": {"max_stream_requests": 2}})


def test_a_client_that_stops_reading_is_cut_off_after_the_write_timeout() -> None:
    from scheduler_svc.errors import DeadlineError  # noqa: PLC0415
    from scheduler_svc.serving.fronts.guard import Guard, Identity, _Call  # noqa: PLC0415
    from scheduler_svc.serving.metrics import SidecarMetrics  # noqa: PLC0415

    class Stuck:
        """A context whose client never reads: every write waits forever."""

        async def write(self, message: object) -> None:
            await asyncio.Event().wait()

    async def main() -> None:
        guard = Guard(lambda: Identity(None, auth.ANONYMOUS_CLIENT), SidecarMetrics(), 0.2)
        wrapped = _Call(guard, "/scheduler.v1.Scheduler/GenerateStream", auth.CLIENT, _Handler())
        with pytest.raises(DeadlineError, match=r"read nothing for 0\.2 s"):
            await wrapped._write(Stuck(), b"answer")  # type: ignore[arg-type]

    asyncio.run(main())


class _Handler:
    request_deserializer = None


def test_an_http_body_that_arrives_slowly_is_cut_off_after_the_read_timeout() -> None:
    from scheduler_svc.serving.chat import PLAIN, ChatTemplate  # noqa: PLC0415
    from scheduler_svc.serving.fronts.http import HttpFront  # noqa: PLC0415

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        front = HttpFront(
            service, lambda: Identity(None, auth.ANONYMOUS_CLIENT), ChatTemplate(PLAIN, "plain")
        )
        port = await front.start("127.0.0.1", 0, None)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"model": '  # and then nothing more
            )
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(4096), 10)
            writer.close()
        finally:
            await front.close()
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.endswith(b"408 Request Timeout"), answer
        assert b"did not arrive within 0.2 s (server.read_timeout_s)" in rest

    serve(ScriptedBackend(), body, {"server": {"read_timeout_s": 0.2}})


def test_an_unexpected_failure_in_a_streamed_request_still_answers_it_with_its_id() -> None:
    from scheduler_svc.serving.fronts.kserve import KServeFront  # noqa: PLC0415

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        front = KServeFront(service)

        async def broken(params: GenerationParams) -> Any:
            raise RuntimeError("a bug")
            yield  # an async generator, as generate is

        service.generate = broken  # type: ignore[method-assign,assignment]

        async def requests() -> Any:
            yield _infer("only")

        answers = [a async for a in front.ModelStreamInfer(requests(), _Context())]
        [answer] = answers
        assert answer.infer_response.id == "only"
        assert answer.error_message.startswith("[INTERNAL] internal error ")
        assert loop.metrics.internal_errors.labels("ModelStreamInfer")._value.get() == 1

    serve(ScriptedBackend(), body)


def test_both_wordings_of_a_full_engine_queue_are_resource_exhausted() -> None:
    from scheduler_svc.errors import BackendBusyError, from_backend_message  # noqa: PLC0415

    for text in (
        "Exceeds maximum queue size",  # Triton core
        "Maximum queue size of 64 has been reached, please try again later",  # the executor
    ):
        assert isinstance(from_backend_message(text), BackendBusyError)
