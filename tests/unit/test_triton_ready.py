"""Triton's readiness as the sidecar reads it: one missed check is not an outage."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from scheduler_svc.backends.triton import TritonBackend
from scheduler_svc.config import TritonConfig


@dataclass
class Answers:
    """A stand-in for Triton's gRPC stub: each check takes the next scripted answer (True,
    False, or a status code the call fails with)."""

    script: list[bool | grpc.StatusCode]
    asked: list[str] = field(default_factory=list)

    def _next(self) -> bool:
        # One scripted answer per check: a failure or "not ready" ends the check here; "ready"
        # is taken by the model's readiness call that follows.
        answer = self.script[0]
        if answer is not True:
            self.script.pop(0)
        if isinstance(answer, grpc.StatusCode):
            raise grpc.aio.AioRpcError(answer, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")
        return answer

    async def ServerReady(self, request: Any, timeout: float) -> Any:
        self.asked.append("server")
        return service_pb2.ServerReadyResponse(ready=self._next())

    async def ModelReady(self, request: Any, timeout: float) -> Any:
        self.asked.append(request.name)
        return service_pb2.ModelReadyResponse(ready=self.script.pop(0))


def checks(script: list[bool | grpc.StatusCode], misses: int = 3) -> list[bool]:
    backend = TritonBackend(TritonConfig(unready_after_misses=misses))
    stub = Answers(list(script))
    backend._stub = stub  # type: ignore[assignment]

    async def run() -> list[bool]:
        out = []
        while stub.script:
            out.append(await backend.ready())
        return out

    return asyncio.run(run())


def test_a_ready_triton_stays_ready_through_fewer_missed_checks_than_the_limit() -> None:
    late = grpc.StatusCode.DEADLINE_EXCEEDED
    gone = grpc.StatusCode.UNAVAILABLE
    assert checks([True, late, gone, True]) == [True, True, True, True]
    # The third miss in a row is an outage; the next answer counts again.
    assert checks([True, late, late, gone, True]) == [True, True, True, False, True]
    assert checks([True, late, late, gone], misses=1) == [True, False, False, False]


def test_not_ready_is_believed_at_once_and_a_miss_before_any_answer_is_not_ready() -> None:
    assert checks([True, False]) == [True, False]
    assert checks([grpc.StatusCode.UNAVAILABLE, True]) == [False, True]
    # A triton that said it is not ready stays so through misses.
    assert checks([False, grpc.StatusCode.DEADLINE_EXCEEDED]) == [False, False]
