"""gRPC health for probes, with open `Watch` streams bounded.

`Check` answers at once. `Watch` keeps a stream (and a task and a condition) open per caller
until the caller leaves, and nothing else bounds how many are open across connections (each
connection may hold `grpc.max_concurrent_streams`), so at most `max_watchers` are open at once;
one more is refused RESOURCE_EXHAUSTED. Probes (Kubernetes, the image's HEALTHCHECK) use Check.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

MAX_WATCHERS = 64


class BoundedHealth(health.aio.HealthServicer):
    def __init__(self, max_watchers: int = MAX_WATCHERS) -> None:
        super().__init__()
        self.max_watchers = max_watchers
        self.watchers = 0

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        if self.watchers >= self.max_watchers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.watchers} health watches are open, the most this server keeps "
                f"({self.max_watchers}); use Check, or retry later",
            )
        self.watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watchers -= 1
