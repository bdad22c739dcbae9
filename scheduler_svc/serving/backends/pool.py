"""The primary backend: one or more Tritons serving the same engine model.

Each request (or released batch) goes to a ready endpoint: with several and
`triton.prefix_routing` on, by core/prefix.py's rule (its session's previous endpoint, else the
one it sent the longest run of the prompt's leading blocks to lately, each only within `slack`
requests in flight of the least loaded; between endpoints holding its prefix, one whose KV pool
has room for it beside the blocks the pool's requests there hold, the pool's size being the
endpoint's last reading); otherwise, and where nothing is cached, the one with the fewest
requests the sidecar has in flight there, then the most free KV blocks at the last reading,
then round robin. Endpoints that failed their last readiness check are skipped while any other
is ready. The policy's KV mirror sees the pool's blocks summed over endpoints.

The slack, unless configured, follows the engine (`slack_for`): a replica may run one more
request than the least loaded per SLACK_ROWS sequences it runs, at least MIN_SLACK. An engine
whose step costs little more for another row (a GPU's decode) loses far less to an uneven
spread than to a prompt prefilled again: on four emulated H200 replicas (256 sequences each) a
slack of 2 sent a session's turns away from its cached history (hit rate 50-58 %, P99 TTFT
181-386 ms at 100-120 requests/s), 8 kept them (84-88 %, 103-115 ms; docs/benchmarks.md
"Shared prefixes"); the CPU engine's 16 sequences, whose steps grow with every row, keep 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from scheduler_svc.config import TritonConfig
from scheduler_svc.core.engine import EngineProfile
from scheduler_svc.core.prefix import PrefixRouter, ReplicaLoad, Routed
from scheduler_svc.serving.backends.base import GenerationInput, Tokens
from scheduler_svc.serving.backends.kvpoll import read_kv_blocks
from scheduler_svc.serving.backends.triton import TritonBackend

SLACK_ROWS = 32  # sequences a replica runs per request of slack (unconfigured)
MIN_SLACK = 2


def slack_for(sequences: int) -> int:
    """The prefix affinity's slack for replicas that each run `sequences` at once."""
    return max(MIN_SLACK, sequences // SLACK_ROWS)


@dataclass
class Endpoint:
    backend: TritonBackend
    metrics_url: str | None
    ready: bool = True
    in_flight: int = 0
    free_blocks: int = 0
    total_blocks: int = 0

    @property
    def url(self) -> str:
        return self.backend.cfg.url


class TritonPool:
    """A `Backend` over several Triton endpoints (one, unless `triton.replicas` lists more)."""

    def __init__(self, cfg: TritonConfig) -> None:
        self.cfg = cfg
        pairs = [(cfg.url, cfg.metrics_url)] + [(r.url, r.metrics_url) for r in cfg.replicas]
        self.endpoints = [
            Endpoint(TritonBackend(cfg.model_copy(update={"url": url})), metrics)
            for url, metrics in pairs
        ]
        self._turn = 0
        self.reuses_kv = False  # the engine's enable_kv_cache_reuse, once its profile is read
        routing = cfg.prefix_routing
        self.router = (
            PrefixRouter(
                tokens_per_block=routing.tokens_per_block,
                max_blocks=routing.max_blocks,
                ttl_s=routing.ttl_s,
                slack=MIN_SLACK if routing.slack is None else routing.slack,
                max_sessions=routing.max_sessions,
            )
            if routing.enabled and len(self.endpoints) > 1
            else None
        )

    @property
    def engine_model(self) -> str:
        """The first endpoint's engine model (every endpoint serves the same contract)."""
        return self.endpoints[0].backend.engine_model

    async def start(self) -> None:
        for endpoint in self.endpoints:
            await endpoint.backend.start()

    async def close(self) -> None:
        for endpoint in self.endpoints:
            await endpoint.backend.close()

    async def ready(self) -> bool:
        """Check every endpoint (remembering each answer); ready if any one is."""
        answers = await asyncio.gather(*(e.backend.ready() for e in self.endpoints))
        for index, (endpoint, answer) in enumerate(zip(self.endpoints, answers, strict=True)):
            if endpoint.ready and not answer and self.router is not None:
                self.router.index.forget(index)  # back later, likely restarted: cache gone
            endpoint.ready = answer
        return any(answers)

    async def health(self) -> list[tuple[str, bool]]:
        """Each endpoint's answer to the last readiness check."""
        return [(e.url, e.ready) for e in self.endpoints]

    async def profile(self) -> EngineProfile:
        """The first endpoint's engine; every endpoint runs its own batches, so the pool runs
        as many at once as they do together. KV counts are the pool's, where readable. An
        unconfigured prefix slack is set from one endpoint's sequences (`slack_for`)."""
        first = await self.first.profile()
        self.reuses_kv = first.kv_cache_reuse
        if self.router is not None and self.cfg.prefix_routing.slack is None:
            self.router.slack = slack_for(first.sequences())
        counts = await self.read_kv()
        return replace(
            first,
            batches_at_once=first.batches_at_once * len(self.endpoints),
            kv_free_blocks=counts[0] if counts else None,
            kv_total_blocks=counts[1]
            if counts
            else first.kv_total_blocks and first.kv_total_blocks * len(self.endpoints),
        )

    def pick(self, request: GenerationInput | None = None) -> tuple[Endpoint, Routed | None]:
        """The endpoint for `request` by prefix and session affinity and KV room (see the
        module), or without a router or a request the ready endpoint with the fewest requests
        in flight, then the most free KV blocks; ties go round robin. A routed request holds
        its blocks in the router's count until `release`d."""
        if self.router is not None and request is not None:
            routed = self.router.route(
                request.prompt_ids,
                request.route.session,
                self._loads(),
                time.monotonic(),
                max_tokens=request.max_tokens,
            )
            return self.endpoints[routed.replica], routed
        candidates = [e for e in self.endpoints if e.ready] or self.endpoints
        n = len(self.endpoints)
        turn = self._turn
        self._turn += 1

        def key(e: Endpoint) -> tuple[int, int, int]:
            return (e.in_flight, -e.free_blocks, (self.endpoints.index(e) - turn) % n)

        return min(candidates, key=key), None

    def _release(self, routed: Routed | None) -> None:
        if routed is not None and self.router is not None:
            self.router.release(routed)

    def _loads(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(e.ready, e.in_flight, e.free_blocks, e.total_blocks) for e in self.endpoints
        ]

    def cached_tokens(self, request: GenerationInput) -> int:
        """The prompt's leading tokens the endpoint `pick` would choose now was sent lately, so
        likely holds cached (the policy's KV reservation leaves them out); 0 without prefix
        routing or where the engine does not reuse KV blocks."""
        if self.router is None or not self.reuses_kv:
            return 0
        return self.router.cached_tokens(
            request.prompt_ids,
            request.route.session,
            self._loads(),
            time.monotonic(),
            max_tokens=request.max_tokens,
        )

    async def stream(self, request: GenerationInput) -> AsyncGenerator[Tokens, None]:
        endpoint, routed = self.pick(request)
        endpoint.in_flight += 1
        try:
            async with contextlib.aclosing(endpoint.backend.stream(request)) as answers:
                async for tokens in answers:
                    yield tokens
        finally:
            endpoint.in_flight -= 1
            self._release(routed)

    async def stream_batch(
        self, request_id: str, rows: list[GenerationInput], timeout_s: float | None
    ) -> AsyncGenerator[tuple[int, Tokens], None]:
        endpoint, routed = self.pick(rows[0] if rows else None)
        endpoint.in_flight += len(rows)
        try:
            answers = endpoint.backend.stream_batch(request_id, rows, timeout_s)
            async with contextlib.aclosing(answers) as stream:
                async for row, tokens in stream:
                    yield row, tokens
        finally:
            endpoint.in_flight -= len(rows)
            self._release(routed)

    async def read_kv(self) -> tuple[int, int] | None:
        """Free and total KV blocks summed over the endpoints whose counts could be read (each
        endpoint's reading is kept for `pick`); None if none could."""
        readable = [e for e in self.endpoints if e.metrics_url is not None]
        counts = await asyncio.gather(
            *(
                read_kv_blocks(
                    e.metrics_url or "", e.backend.engine_model, self.cfg.connect_timeout_s
                )
                for e in readable
            )
        )
        free = total = 0
        seen = False
        for endpoint, reading in zip(readable, counts, strict=True):
            if reading is not None:
                endpoint.free_blocks, endpoint.total_blocks = reading
                free, total, seen = free + reading[0], total + reading[1], True
        return (free, total) if seen else None

    @property
    def first(self) -> TritonBackend:
        return self.endpoints[0].backend
