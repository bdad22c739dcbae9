"""Prefix affinity across replicas: the bounded, expiring index; the rule (balance first, then
the session, then the longest cached prefix, then load); and its bounds under random traffic."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core.prefix import PrefixIndex, PrefixRouter, ReplicaLoad, block_keys, choose

HEADER = list(range(1000, 1064))  # four blocks of 16


def test_the_index_credits_only_an_unbroken_leading_run_and_forgets_old_entries() -> None:
    index = PrefixIndex(max_blocks=100, ttl_s=10.0)
    keys = block_keys(HEADER, 16)
    index.record(0, keys, now=0.0)
    index.record(1, keys[:2], now=1.0)
    assert index.matched(keys, now=2.0) == {0: 4, 1: 2}
    # A replica sent only a later block is not credited with it: the run breaks first.
    other = block_keys([7, *HEADER[1:]], 16)
    assert index.matched(other, now=2.0) == {}
    assert index.matched(keys, now=10.5) == {1: 2}  # replica 0's entries are past 10 s
    index.record(2, block_keys(list(range(64)), 16), now=30.0)  # expired keys are dropped
    assert len(index) == 4 and index.matched(keys, now=30.0) == {}
    index.forget(2)
    assert len(index) == 0


def test_the_index_is_bounded_least_recently_routed_first() -> None:
    index = PrefixIndex(max_blocks=6, ttl_s=100.0)
    a, b = block_keys(HEADER, 16), block_keys(list(range(64)), 16)
    index.record(0, a, now=0.0)
    index.record(1, b, now=1.0)  # 8 keys: a's first two go
    assert len(index) == 6
    assert index.matched(a, now=2.0) == {}  # its leading blocks are gone
    assert index.matched(b, now=2.0) == {1: 4}


def loads(*in_flight: int, ready: tuple[bool, ...] | None = None) -> list[ReplicaLoad]:
    flags = ready or (True,) * len(in_flight)
    return [ReplicaLoad(r, n) for n, r in zip(in_flight, flags, strict=True)]


def test_the_rule_balance_then_session_then_prefix_then_load() -> None:
    # The longest cached prefix wins among replicas within the slack.
    assert choose(loads(3, 2, 2), {0: 4, 1: 2}, slack=1) == (0, "prefix")
    # Past the slack, the prefix's replica is skipped: one hot prefix does not pile up.
    assert choose(loads(4, 2, 2), {0: 4, 1: 2}, slack=1) == (1, "prefix")
    # The session's previous replica first, within the slack.
    assert choose(loads(3, 2, 2), {0: 4}, slack=1, previous=2) == (2, "session")
    assert choose(loads(5, 2, 2), {}, slack=1, previous=0) == (1, "load")
    # Nothing cached: the fewest in flight, then the most free blocks, then round robin.
    assert choose(loads(1, 0, 0), {}, slack=2) == (1, "load")
    replicas = [ReplicaLoad(True, 0, 5), ReplicaLoad(True, 0, 9)]
    assert choose(replicas, {}, slack=0) == (1, "load")
    assert [choose(loads(0, 0), {}, slack=0, turn=t)[0] for t in range(3)] == [0, 1, 0]
    # Unready replicas are skipped while any is ready, and shorter runs than min_blocks ignored.
    assert choose(loads(0, 0, ready=(False, True)), {0: 4}, slack=3) == (1, "load")
    assert choose(loads(0, 0), {1: 1}, slack=3, min_blocks=2) == (0, "load")


def test_a_session_stays_on_its_replica_and_a_shared_prefix_follows_its_cache() -> None:
    router = PrefixRouter(tokens_per_block=16, max_blocks=1000, ttl_s=60.0, slack=2)
    pool = loads(0, 0, 0, 0)
    first = router.route(HEADER, "s1", pool, now=0.0)
    # The next turn resends the conversation: same replica (by session, and by prefix).
    assert router.route([*HEADER, 5, 6, 7], "s1", pool, now=1.0) == first
    # Another session sharing the header (a system prompt) goes where the header is cached.
    assert router.route([*HEADER, 9], "s2", pool, now=2.0) == first
    assert router.reasons == {"session": 1, "prefix": 1, "load": 1}
    # A prompt with nothing in common goes by load.
    busy = [ReplicaLoad(True, 2 if i == first else 0) for i in range(4)]
    assert router.route(list(range(64)), "", busy, now=3.0) != first


def test_the_cached_estimate_follows_the_replica_the_rule_would_choose() -> None:
    """What the KV mirror is told a prompt finds cached: the run of blocks held by the replica
    `route` would choose now (its session's, within the slack), remembering nothing."""
    router = PrefixRouter(tokens_per_block=16, max_blocks=1000, ttl_s=60.0, slack=1)
    pool = loads(0, 0, 0, 0)
    first = router.route([*HEADER, 1], "s1", pool, now=0.0)
    turn = [*HEADER, 1, *range(20)]  # 85 tokens: five full blocks, of which four were sent
    assert router.cached_tokens(turn, "s1", pool, now=1.0) == 64
    assert router.cached_tokens(list(range(64)), "", pool, now=1.0) == 0
    assert router.reasons == {"session": 0, "prefix": 0, "load": 1}  # nothing was routed
    busy = [ReplicaLoad(True, 2 if i == first else 0) for i in range(4)]
    assert router.cached_tokens(turn, "s1", busy, now=1.0) == 0  # it would go elsewhere
    assert router.cached_tokens(turn, "s1", pool, now=61.0) == 0  # past the ttl


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 4),
    slack=st.integers(0, 3),
    steps=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()), min_size=1, max_size=120
    ),
)
def test_no_replica_takes_a_request_beyond_the_slack_and_the_index_stays_bounded(
    n: int, slack: int, steps: list[tuple[int, int, bool]]
) -> None:
    """Random traffic, most of it one hot prefix: each choice is within `slack` of the least
    loaded replica, the index and the session map stay within their bounds."""
    router = PrefixRouter(
        tokens_per_block=16, max_blocks=24, ttl_s=5.0, slack=slack, max_sessions=3
    )
    in_flight = [0] * n
    now = 0.0
    for prompt_kind, session, finish in steps:
        now += 0.5
        if finish and any(in_flight):
            in_flight[in_flight.index(max(in_flight))] -= 1
        prompt = HEADER if prompt_kind < 4 else [prompt_kind * 100 + i for i in range(48)]
        replicas = [ReplicaLoad(True, k) for k in in_flight]
        chosen = router.route(prompt, f"s{session}" if session else "", replicas, now)
        assert in_flight[chosen] <= min(in_flight) + slack
        in_flight[chosen] += 1
        assert len(router.index) <= 24 and router.sessions <= 3
