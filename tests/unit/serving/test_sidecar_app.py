"""The composed process (`Sidecar`) over a scripted engine, in process: it binds its listeners,
says SERVING once its backend is ready, serves a request, and on drain refuses new calls
while it finishes the one it holds. tests/integration/ runs the same process against the real
Triton."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.config import SidecarConfig
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.serving.app import Sidecar
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.waiting import until


def test_the_sidecar_serves_once_its_backend_is_ready_and_drains() -> None:
    cfg = SidecarConfig.model_validate(
        {
            "server": {"port": 0, "admin_port": None, "http_port": None, "drain_grace_s": 30},
            "triton": {"health_interval_s": 0.05},
        }
    )
    backend = ScriptedBackend(EngineProfile(Batching.INFLIGHT, 64), is_ready=False)

    async def main() -> None:
        sidecar = Sidecar(cfg, backend)
        port = await sidecar.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]

            async def status() -> int:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
                return int(reply.status)

            assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
            backend.is_ready = True
            serving: list[int] = []

            async def poll() -> None:
                serving.append(await status())

            for _ in range(200):
                await poll()
                if serving[-1] == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.01)
            assert serving[-1] == health_pb2.HealthCheckResponse.SERVING
            answer = await stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=2))
            assert len(answer.token_ids) == 2
            # One request is in the engine when the drain starts: the drain waits for it and
            # refuses what comes after.
            backend.hold()
            held = asyncio.ensure_future(
                stub.Generate(pb.GenerateRequest(prompt="Hello", max_tokens=2))
            )
            await until(lambda: len(backend.calls) == 2, "the second request reaches the engine")
            drained = asyncio.create_task(sidecar.drain())
            await until(lambda: sidecar.service.draining, "the sidecar drains")
            try:
                await stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=2))
                refused = None
            except grpc.aio.AioRpcError as exc:
                refused = exc.code()
            assert refused is grpc.StatusCode.UNAVAILABLE
            backend.release()
            assert len((await held).token_ids) == 2  # accepted before the drain: answered
            await drained

    asyncio.run(main())
