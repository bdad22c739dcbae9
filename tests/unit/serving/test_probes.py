"""Health watches are bounded: one more than `max_watchers` open at once is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.serving.fronts.probes import BoundedHealth


def test_open_health_watches_are_bounded_and_freed_when_they_end() -> None:
    async def main() -> None:
        servicer = BoundedHealth(max_watchers=2)
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
                for watch in watches:
                    first = await watch.read()
                    assert first.status == health_pb2.HealthCheckResponse.SERVING
                extra = stub.Watch(health_pb2.HealthCheckRequest())
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await extra.read()
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "use Check" in (caught.value.details() or "")
                checked = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert checked.status == health_pb2.HealthCheckResponse.SERVING
                watches[0].cancel()
                for _ in range(100):  # the server sees the caller leave
                    if servicer.watchers < 2:
                        break
                    await asyncio.sleep(0.01)
                again = stub.Watch(health_pb2.HealthCheckRequest())
                assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
                again.cancel()
                watches[1].cancel()
        finally:
            await server.stop(0)

    asyncio.run(main())
