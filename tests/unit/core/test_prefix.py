"""Prefix affinity across replicas: the bounded, expiring index; the rule (balance first, then
KV room, then the session, then the longest cached prefix, then load); and its bounds under
random traffic."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core.prefix import (
    HeldBlocks,
    PrefixIndex,
    PrefixRouter,
    ReplicaLoad,
    Routed,
    block_keys,
    choose,
)

HEADER = list(range(1000, 1064))  # four blocks of 16
KV_BLOCKS = 20  # each replica's pool in the property test: room for two or three requests
MAX_TOKENS = 48


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
    first = router.route(HEADER, "s1", pool, now=0.0).replica
    # The next turn resends the conversation: same replica (by session, and by prefix).
    assert router.route([*HEADER, 5, 6, 7], "s1", pool, now=1.0).replica == first
    # Another session sharing the header (a system prompt) goes where the header is cached.
    assert router.route([*HEADER, 9], "s2", pool, now=2.0).replica == first
    assert router.reasons == {"session": 1, "prefix": 1, "load": 1}
    # A prompt with nothing in common goes by load.
    busy = [ReplicaLoad(True, 2 if i == first else 0) for i in range(4)]
    assert router.route(list(range(64)), "", busy, now=3.0).replica != first


def test_the_cached_estimate_follows_the_replica_the_rule_would_choose() -> None:
    """What the KV mirror is told a prompt finds cached: the run of blocks held by the replica
    `route` would choose now (its session's, within the slack), remembering nothing."""
    router = PrefixRouter(tokens_per_block=16, max_blocks=1000, ttl_s=60.0, slack=1)
    pool = loads(0, 0, 0, 0)
    first = router.route([*HEADER, 1], "s1", pool, now=0.0).replica
    turn = [*HEADER, 1, *range(20)]  # 85 tokens: five full blocks, of which four were sent
    assert router.cached_tokens(turn, "s1", pool, now=1.0) == 64
    assert router.cached_tokens(list(range(64)), "", pool, now=1.0) == 0
    assert router.reasons == {"session": 0, "prefix": 0, "load": 1}  # nothing was routed
    busy = [ReplicaLoad(True, 2 if i == first else 0) for i in range(4)]
    assert router.cached_tokens(turn, "s1", busy, now=1.0) == 0  # it would go elsewhere
    assert router.cached_tokens(turn, "s1", pool, now=61.0) == 0  # past the ttl


def test_held_blocks_count_a_shared_prefix_once_and_return_to_zero() -> None:
    held = HeldBlocks()
    keys = block_keys(HEADER, 16)
    assert held.need(keys, 3) == 7
    held.hold(keys, 3)
    assert held.used == 7 and held.need(keys, 2) == 2  # the header is held already
    held.hold(keys, 2)
    held.release(keys, 3)
    assert held.used == 6  # the header stays while the second request holds it
    held.release(keys, 2)
    assert held.used == 0


def test_kv_room_decides_between_the_replicas_holding_a_prefix() -> None:
    """A session's replica is full of the blocks routed there: its next turn goes to another
    replica holding the same prefix that has room (the engine starts it there at once); where
    no holder has room, it stays (elsewhere it would prefill its prefix again)."""
    router = PrefixRouter(tokens_per_block=16, max_blocks=1000, ttl_s=60.0, slack=4)
    room = 12  # blocks per replica

    def pool(busy: int | None = None) -> list[ReplicaLoad]:
        return [ReplicaLoad(True, 5 if i == busy else 0, total_blocks=room) for i in range(2)]

    # 4 header blocks + the partial block of 5 tokens and 64 output tokens (5 blocks): 9.
    a = router.route([*HEADER, 1, 2, 3, 4, 5], "s1", pool(), now=0.0, max_tokens=64)
    assert router.held(a.replica).used == 9
    other = 1 - a.replica
    # Another session, sent past the slack to the other replica: both hold the header now.
    b = router.route([*HEADER, 9], "s2", pool(busy=a.replica), now=0.5, max_tokens=64)
    assert b.replica == other
    router.release(b)
    # s1's next turn needs 6 more blocks on its replica (9 + 6 > 12); 10 fit on the other.
    turn = [*HEADER, *range(20)]
    moved = router.route(turn, "s1", pool(), now=1.0, max_tokens=64)
    assert moved.replica == other and router.held(other).used == 10
    # The turn after needs 6 more there (16 > 12) and 7 where it began (16 > 12): it stays.
    stays = router.route([*turn, *range(100, 120)], "s1", pool(), now=2.0, max_tokens=64)
    assert stays.replica == other
    assert router.reasons == {"session": 1, "prefix": 1, "load": 2}
    for routed in (a, moved, stays):
        router.release(routed)
    assert router.held(0).used == router.held(1).used == 0


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
    running: list[list[Routed]] = [[] for _ in range(n)]
    now = 0.0
    for prompt_kind, session, finish in steps:
        now += 0.5
        if finish and any(running):
            busiest = max(running, key=len)
            router.release(busiest.pop(0))
        in_flight = [len(r) for r in running]
        prompt = HEADER if prompt_kind < 4 else [prompt_kind * 100 + i for i in range(48)]
        replicas = [ReplicaLoad(True, k, total_blocks=KV_BLOCKS) for k in in_flight]
        name = f"s{session}" if session else ""
        keys = block_keys(prompt, 16)
        eligible = [i for i in range(n) if in_flight[i] <= min(in_flight) + slack]
        # Where the rule looks for room: the prefix's holders and the session's replica among
        # the eligible, or, holding none, all of them.
        previous = router.previous(name, now)
        holders = [i for i in router.index.matched(keys, now) if i in eligible]
        looked = [*holders, *([previous] if previous in eligible else [])] or eligible
        routed = router.route(prompt, name, replicas, now, max_tokens=MAX_TOKENS)
        chosen = routed.replica
        assert chosen in eligible
        if router.held(chosen).used > KV_BLOCKS:  # overfilled: nowhere it looked had room
            assert all(
                router.held(i).used + router.held(i).need(keys, routed.extra_blocks) > KV_BLOCKS
                for i in looked
                if i != chosen
            )
        running[chosen].append(routed)
        assert len(router.index) <= 24 and router.sessions <= 3
    for requests in running:
        for routed in requests:
            router.release(routed)
    assert all(router.held(i).used == 0 for i in range(n))
