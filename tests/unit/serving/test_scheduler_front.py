"""The scheduler.v1 front as a gRPC server behind the guard, over a scripted engine (in
process, on a loopback port): whole and streamed answers, and refusals with their status
naming the problem. tests/integration/test_sidecar.py runs it against the real Triton."""

from __future__ import annotations

import grpc
import pytest

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.config import ServerConfig
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.serving.auth import ANONYMOUS_CLIENT
from scheduler_svc.serving.fronts.guard import Guard, Identity
from scheduler_svc.serving.fronts.scheduler_v1 import SchedulerFront
from scheduler_svc.serving.listeners import grpc_server
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.service import GenerationService
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.stack import TOKENIZER, serve

WORD = TOKENIZER.encode(" hello", add_special_tokens=False).ids[0]


def test_generate_and_stream_answer_and_bad_requests_are_invalid_argument() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.INFLIGHT, 64), first_id=WORD)
    codes: list[grpc.StatusCode] = []

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        guard = Guard(lambda: Identity(None, ANONYMOUS_CLIENT), loop.metrics, 5.0)
        server = grpc_server(ServerConfig(), guard)
        server.add_generic_rpc_handlers((SchedulerFront(service).handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
                whole = await stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=3))
                assert len(whole.token_ids) == 3 and whole.text
                assert whole.usage.completion_tokens == 3
                pieces = [
                    r
                    async for r in stub.GenerateStream(
                        pb.GenerateRequest(prompt="Hi", max_tokens=3)
                    )
                ]
                assert sum(len(p.token_ids) for p in pieces) == 3
                assert pieces[-1].finish_reason == whole.finish_reason != 0
                # One message a token, the last token in the final message (no empty one).
                assert [len(p.token_ids) for p in pieces] == [1, 1, 1]
                assert "".join(p.text for p in pieces) == whole.text
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=10**6))
                codes.append(refused.value.code())
                assert "max_tokens" in (refused.value.details() or "")
                raw = channel.unary_unary("/scheduler.v1.Scheduler/Generate")
                with pytest.raises(grpc.aio.AioRpcError) as malformed:
                    await raw(b"\xff\xff\xff")
                codes.append(malformed.value.code())
        finally:
            await server.stop(None)

    serve(backend, body, virtual_time=False)  # gRPC does its I/O on threads of its own
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2
