"""The pool's choice of endpoint: prefix and session affinity within the slack, else load
(the rule itself: tests/unit/core/test_prefix.py; two real Tritons: the integration test)."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler_svc.config import PrefixRouting, Replica, TritonConfig
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.core.prefix import block_keys
from scheduler_svc.core.routing import RouteClass
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.pool import TritonPool, slack_for

HEADER = list(range(500, 564))


def row(prompt: list[int], session: str = "") -> GenerationInput:
    return GenerationInput("r", prompt, 8, 1, 0, route=RouteClass(session=session))


def pool(**routing: object) -> TritonPool:
    return TritonPool(
        TritonConfig(
            url="127.0.0.1:1",
            replicas=[Replica(url="127.0.0.1:2"), Replica(url="127.0.0.1:3")],
            prefix_routing=PrefixRouting(**routing),  # type: ignore[arg-type]
        )
    )


def test_a_shared_prefix_goes_back_to_its_endpoint_until_it_is_slack_ahead() -> None:
    backends = pool(slack=1)
    first = backends.pick(row([*HEADER, 1]))[0]
    first.in_flight += 1
    assert backends.pick(row([*HEADER, 2]))[0] is first  # one ahead: within the slack
    first.in_flight += 1
    other = backends.pick(row([*HEADER, 3]))[0]  # two ahead: the prefix spreads
    assert other is not first
    assert backends.router is not None
    assert backends.router.reasons == {"session": 0, "prefix": 1, "load": 2}
    # Now both hold the header: the next one goes to the less loaded of the two.
    assert backends.pick(row([*HEADER, 4]))[0] is other


@pytest.mark.parametrize(
    ("sequences", "configured", "slack"), [(256, None, 8), (16, None, 2), (256, 3, 3)]
)
def test_the_slack_follows_the_engines_rows_unless_configured(
    sequences: int, configured: int | None, slack: int
) -> None:
    backends = pool(slack=configured)
    engine = EngineProfile(Batching.INFLIGHT, 64, max_num_sequences=sequences)

    async def first_profile() -> EngineProfile:
        return engine

    backends.first.profile = first_profile  # type: ignore[method-assign]
    assert backends.router is not None and backends.router.slack == (configured or 2)
    asyncio.run(backends.profile())  # no metrics URLs: the KV counts are left unread
    assert backends.router.slack == slack
    assert slack_for(64) == 2 and slack_for(1024) == 32


def test_the_cached_prefix_estimate_is_what_the_chosen_endpoint_was_sent() -> None:
    """For the KV mirror: the leading tokens the endpoint `pick` would choose holds, counted
    only where the engine reuses KV blocks; estimating routes nothing."""
    backends = pool(slack=1)
    reuse = EngineProfile(Batching.INFLIGHT, 64, max_num_sequences=16, kv_cache_reuse=True)

    async def first_profile() -> EngineProfile:
        return reuse

    backends.first.profile = first_profile  # type: ignore[method-assign]
    first = backends.pick(row([*HEADER, 1]))[0]  # 64 header tokens: 4 blocks sent to `first`
    assert backends.cached_tokens(row([*HEADER, 2])) == 0  # the engine's reuse not known yet
    asyncio.run(backends.profile())
    assert backends.cached_tokens(row([*HEADER, 2])) == 64
    assert backends.cached_tokens(row(list(range(64)))) == 0  # nothing of it was sent
    assert backends.router is not None
    assert backends.router.reasons == {"session": 0, "prefix": 0, "load": 1}
    first.in_flight += 2  # beyond the slack: the next one would go elsewhere, uncached
    assert backends.cached_tokens(row([*HEADER, 3])) == 0


def test_without_prefix_routing_or_a_request_the_least_loaded_goes() -> None:
    backends = pool(enabled=False)
    assert backends.router is None
    picked = [backends.pick(row(HEADER))[0] for _ in range(3)]
    assert len({id(e) for e in picked}) == 3  # round robin among equals
    single = TritonPool(TritonConfig(url="127.0.0.1:1"))
    assert single.router is None  # one endpoint: nothing to route


def test_an_endpoint_that_goes_unready_is_forgotten_by_the_prefix_index() -> None:
    """Back from a readiness miss it has likely restarted with an empty cache."""
    backends = pool()
    first = backends.pick(row(HEADER))[0]
    index = backends.endpoints.index(first)
    answers = {e.url: e is not first for e in backends.endpoints}
    for endpoint in backends.endpoints:

        async def ready(url: str = endpoint.url) -> bool:
            return answers[url]

        endpoint.backend.ready = ready  # type: ignore[method-assign]
    assert backends.router is not None
    keys = block_keys(HEADER, 16)
    assert backends.router.index.matched(keys, time.monotonic()) == {index: 4}
    assert asyncio.run(backends.ready())
    assert backends.router.index.matched(keys, time.monotonic()) == {}
