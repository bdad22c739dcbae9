"""The policy core: lanes, timeouts and their actions, KV admission, shares, aging, invariants.

Over 500 lines: the state machine that checks every invariant at once needs the whole policy
in one place, and the scenario tests beside it share its helpers (the policy's parts have
their own files: test_policy_parts.py, test_fairness.py, test_routing.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_svc.core.admission import RECENT_MIN
from scheduler_svc.core.bucketing import Entry
from scheduler_svc.core.config import (
    AdmissionConfig,
    BreakerConfig,
    FairnessConfig,
    KvConfig,
    KvMode,
    LaneConfig,
    OnTimeout,
    PolicyConfig,
    default_lanes,
)
from scheduler_svc.core.engine import prefill_budget_tokens
from scheduler_svc.core.policy import (
    KV_PASS_SHARE,
    MIN_START_SHARE,
    URGENT_SHARE,
    PolicyEvent,
    PolicyScheduler,
)
from scheduler_svc.core.types import (
    Admitted,
    Dispatch,
    Expired,
    ExpireReason,
    Rejected,
    RejectReason,
    Request,
    Target,
)


def req(rid: str, prompt: int, max_tokens: int = 64, **kw: object) -> Request:
    return Request(rid, prompt_tokens=prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def dispatched(decisions: list[Dispatch | Expired]) -> list[str]:
    return [d.request_id for d in decisions if isinstance(d, Dispatch)]


def test_lanes_by_prompt_length_and_a_pinned_lane_wins() -> None:
    policy = PolicyScheduler()
    assert [policy.classify(req("x", n)) for n in (1, 255, 256, 1023, 1024, 9000)] == [
        "hot",
        "hot",
        "warm",
        "warm",
        "cold",
        "cold",
    ]
    assert isinstance(policy.submit(req("pinned", 3000, lane="hot"), 0.0), Admitted)
    assert policy.queued_ids() == {"pinned": "hot"}
    verdict = policy.submit(req("bad", 10, lane="lukewarm"), 0.0)
    assert isinstance(verdict, Rejected) and verdict.reason is RejectReason.UNKNOWN_LANE


def test_a_full_bucket_goes_at_once_and_a_partial_one_after_its_timeout() -> None:
    policy = PolicyScheduler()
    for i in range(16):
        policy.submit(req(f"h{i}", 100), 0.0)
    policy.submit(req("late", 100), 0.0)
    first = policy.schedule(0.0)
    assert len(first) == 16 and {
        d.batch.size for d in first if isinstance(d, Dispatch) and d.batch
    } == {16}
    assert policy.next_wakeup(0.0) == 0.05
    assert policy.schedule(0.049) == []
    assert dispatched(policy.schedule(0.05)) == ["late"]


def test_continuous_batching_sends_at_once_and_in_part_while_others_run() -> None:
    config = PolicyConfig(kv=KvConfig(total_blocks=100_000, max_in_flight=4))
    held = PolicyScheduler(config)
    flowing = PolicyScheduler(replace(config, continuous_batching=True))
    for policy in (held, flowing):
        policy.submit(req("first", 100), 0.0)
    assert dispatched(held.schedule(0.0)) == []  # a static engine's bucket waits to fill
    assert dispatched(flowing.schedule(0.0)) == ["first"]  # an in-flight engine takes it now
    for i in range(6):  # one bucket of six while one row runs and three are free
        flowing.submit(req(f"h{i}", 100), 0.01)
    assert len(dispatched(flowing.schedule(0.01))) == 3  # in part: as many as fit
    flowing.on_done("first", 0.02, 10)
    assert len(dispatched(flowing.schedule(0.02))) == 1


def test_batches_keep_the_length_ratio_and_join_where_padding_is_least() -> None:
    policy = PolicyScheduler()
    for rid, n in [("a", 100), ("b", 140), ("c", 160), ("d", 240), ("e", 150)]:
        policy.submit(req(rid, n), 0.0)
    batches: dict[int, list[int]] = {}
    for d in policy.schedule(0.05):
        assert isinstance(d, Dispatch) and d.batch is not None
        batches.setdefault(d.batch.batch_id, list(d.batch.prompt_tokens))
    groups = sorted(sorted(v) for v in batches.values())
    # 150 fits both [100, 140] and [160, 240]; it pads [100, 140] less (10+... vs 90)
    assert groups == [[100, 140, 150], [160, 240]]
    for lengths in groups:
        assert max(lengths) <= 1.5 * min(lengths)


def test_hot_timeout_without_a_fallback_joins_the_warm_lane_keeping_its_age() -> None:
    config = PolicyConfig(kv=KvConfig(total_blocks=16, max_in_flight=1))
    policy = PolicyScheduler(config)
    policy.submit(req("running", 100), 0.0)
    assert dispatched(policy.schedule(0.05)) == ["running"]
    policy.submit(req("waiting", 100), 0.06)
    assert policy.schedule(0.159) == [] and policy.queued_ids() == {"waiting": "hot"}
    assert policy.schedule(0.16) == [] and policy.queued_ids() == {"waiting": "warm"}
    assert dict(policy.stats().counters)["degraded_lane"] == 1
    entry = policy.lanes["warm"].entries["waiting"]
    assert entry.arrived_at == 0.06 and not entry.promoted
    # The warm lane's own waits: 0.5 s, twice more, then a refusal; its aging bound (1 s)
    # counts from the request's arrival in the hot lane.
    assert policy.schedule(0.66) == [] and entry.requeues == 1
    policy.schedule(1.059)
    assert not entry.promoted
    policy.schedule(1.06)
    assert entry.promoted
    assert policy.schedule(1.17) == [] and entry.requeues == 2
    assert policy.schedule(1.68) == [Expired("waiting", ExpireReason.REQUEUE_LIMIT, "warm")]


def test_a_hot_timeout_joins_a_full_lower_lane_only_by_pushing_out_over_share_work() -> None:
    """The lower lane's cap holds for requests moved down too: over-share work of another
    tenant is pushed out for it, as at arrival; with none, it is answered now."""
    lanes = default_lanes()
    lanes = (lanes[0], replace(lanes[1], max_queued=1), lanes[2])
    for tenant, ends in (("a", ["b0"]), ("b", ["waiting"])):
        policy = PolicyScheduler(
            PolicyConfig(lanes=lanes, kv=KvConfig(total_blocks=64, max_in_flight=1))
        )
        policy.submit(req("running", 100), 0.0)
        assert dispatched(policy.schedule(0.05)) == ["running"]
        policy.submit(req("b0", 300, tenant="b"), 0.06)  # the warm lane's one place
        policy.submit(req("waiting", 100, tenant=tenant), 0.06)
        decisions = policy.schedule(0.16)  # past hot's 100 ms: it would join warm
        assert [d.request_id for d in decisions] == ends
        if tenant == "a":  # b is over its share there: b0 makes room, "waiting" moves down
            assert decisions[0] == Expired(
                "b0", ExpireReason.PUSHED_OUT, "warm", decisions[0].retry_after_s
            )
            assert policy.queued_ids() == {"waiting": "warm"}
        else:  # its own tenant fills the lane: nothing to push out
            assert decisions == [
                Expired("waiting", ExpireReason.NO_FALLBACK, "hot", decisions[0].retry_after_s)
            ]
            assert policy.queued_ids() == {"b0": "warm"}


def test_with_no_lower_lane_a_hot_timeout_rejects_with_a_reason() -> None:
    hot = replace(default_lanes()[0], max_wait_s=None)
    config = PolicyConfig(
        lanes=(hot,),
        kv=KvConfig(total_blocks=16, max_in_flight=1),
        breaker=BreakerConfig(watch_lane="hot", demote_lane="hot", to_lane="hot"),
    )
    policy = PolicyScheduler(config)
    policy.submit(req("running", 100), 0.0)
    assert dispatched(policy.schedule(0.05)) == ["running"]
    policy.submit(req("waiting", 100), 0.06)
    assert policy.schedule(0.159) == []
    assert policy.schedule(0.16) == [Expired("waiting", ExpireReason.NO_FALLBACK, "hot")]


def _one_at_a_time() -> PolicyConfig:
    # A static engine running one request at a time; buckets go at once (no batch timer).
    lanes = tuple(replace(lane, batch_timeout_s=0.0) for lane in default_lanes())
    return PolicyConfig(lanes=lanes, kv=KvConfig(total_blocks=4096, max_in_flight=1))


def _keep_busy(
    policy: PolicyScheduler, name: str, prompt: int, max_tokens: int, period_s: float, now: float
) -> float:
    """Keep one lane busy: a request using all its max_tokens completes every `period_s` while
    the next one waits (12 times). Leaves the last one running; returns the time."""
    policy.submit(req(name, prompt, max_tokens=max_tokens), now)
    policy.schedule(now)
    for i in range(12):
        policy.submit(req(f"{name}{i}", prompt, max_tokens=max_tokens), now)
        now += period_s
        [running] = list(policy.in_flight_ids())
        policy.on_done(running, now, max_tokens)
        policy.schedule(now)
    return now


def _learn_hot_rate(policy: PolicyScheduler, now: float) -> float:
    """The hot lane drains 1280 tokens per busy second: 64 tokens (prompt 36 + 28 used) every
    50 ms; then nothing is left queued or running."""
    now = _keep_busy(policy, "learn", 36, 28, 0.05, now)
    for rid in list(policy.queued_ids()) + list(policy.in_flight_ids()):
        policy.cancel(rid, now)
    return now


def test_predictive_admission_refuses_at_once_what_cannot_start_in_time() -> None:
    policy = PolicyScheduler(_one_at_a_time())
    assert policy.predicted_wait("hot") == 0.0  # nothing queued: nothing to wait for
    assert policy.drain["hot"].rate() is None  # nothing learned yet
    now = _learn_hot_rate(policy, 0.0)
    rate = policy.drain["hot"].rate()
    assert rate is not None and abs(rate - 1280) < 1
    assert policy.drain["warm"].rate() is None
    assert policy.drain_rate("warm") == policy.pooled_drain.rate()  # borrowed from the engine
    # Hot may wait its 100 ms (then it would join warm); warm may wait 3 x 500 ms.
    assert policy.allowed_wait("hot") == 0.1
    assert policy.allowed_wait("warm") == 1.5 and policy.allowed_wait("cold") is None
    policy.submit(req("running", 72, max_tokens=28), now)
    policy.schedule(now)
    verdicts = [policy.submit(req(f"q{i}", 72, max_tokens=28), now) for i in range(25)]
    # 100 tokens each at 1280 tokens/s: 78 ms per request ahead. Hot takes two (0 and 78 ms
    # ahead); the next ones would start past hot's 100 ms and are refused at once (sent to
    # warm they would be served past their SLO, taking room from those that can make it).
    assert policy.queued_ids() == {"q0": "hot", "q1": "hot"}
    refused = [v for v in verdicts if isinstance(v, Rejected)]
    assert len(refused) == 23 and "degraded_lane" not in dict(policy.stats().counters)
    first = refused[0]
    assert first.reason is RejectReason.PREDICTED_LATE
    assert first.retry_after_s == pytest.approx(2 * 100 / 1280, rel=1e-3)
    assert "156 ms" in first.message and "100 ms" in first.message
    # A request's own deadline bounds its wait too.
    verdict = policy.submit(req("soon", 72, max_tokens=28, queue_deadline=now + 0.05), now)
    assert isinstance(verdict, Rejected) and verdict.reason is RejectReason.PREDICTED_LATE
    later = policy.submit(req("cold", 2000, queue_deadline=now + 0.05), now)
    assert isinstance(later, Admitted)  # nothing queued ahead of it in the cold lane


def test_predicted_lateness_opens_the_breaker_before_the_backlog_count() -> None:
    policy = PolicyScheduler(_one_at_a_time())
    now = _learn_hot_rate(policy, 0.0)
    policy.submit(req("running", 100, max_tokens=28), now)
    policy.schedule(now)
    for i in range(2):
        policy.submit(req(f"q{i}", 100, max_tokens=28), now)
    # 0.2 s queued ahead in hot, past its 100 ms: open at the next arrival, with 2 waiting
    # where the count alone would wait for 51 (that arrival itself is refused).
    assert not policy.stats().breaker_open
    policy.submit(req("q2", 100, max_tokens=28), now)
    assert policy.stats().breaker_open and len(policy.lanes["hot"]) == 2


def test_a_degraded_request_is_refused_when_the_lower_lane_cannot_start_it_in_time() -> None:
    policy = PolicyScheduler(_one_at_a_time())
    now = _learn_hot_rate(policy, 0.0)
    # Teach the warm lane 800 tokens per busy second: 360 tokens every 0.45 s.
    now = _keep_busy(policy, "w", 300, 60, 0.45, now)
    assert abs((policy.drain["warm"].rate() or 0) - 800) < 1
    # Four warm requests queued behind the running one: 4 x 0.45 s = 1.8 s ahead, past the
    # 1.5 s the warm lane allows.
    for i in range(4):
        assert isinstance(policy.submit(req(f"x{i}", 300, max_tokens=60), now), Admitted)
    assert policy.predicted_wait("warm") == pytest.approx(4 * 360 / 800)
    verdict = policy.submit(req("x4", 300, max_tokens=60), now)
    assert isinstance(verdict, Rejected) and verdict.reason is RejectReason.PREDICTED_LATE
    # A hot request that times out would join warm there: refused, with the honest wait.
    policy.submit(req("h", 100, max_tokens=28), now)
    decisions = policy.schedule(now + 0.1)
    [expired] = decisions
    assert isinstance(expired, Expired) and expired.request_id == "h"
    assert (expired.reason, expired.lane) == (ExpireReason.PREDICTED_LATE, "hot")
    assert expired.retry_after_s == pytest.approx(1.8)
    assert dict(policy.stats().counters)["expired_predicted_late"] == 1


def _in_flight(rows: int, budget: int | None = None) -> PolicyScheduler:
    """An in-flight engine running `rows` sequences (deadline order), lanes' targets 250 ms /
    350 ms / 1.5 s."""
    config = PolicyConfig(
        kv=KvConfig(total_blocks=100_000, max_in_flight=rows),
        continuous_batching=True,
        prefill_budget_tokens=budget,
    )
    return PolicyScheduler(config)


def _learned(rows: int, seconds_per_token: float | None = None) -> PolicyScheduler:
    """`_in_flight(rows)` whose cold requests are known to use all 64 of their tokens, and
    with `seconds_per_token` its rows' learned pace."""
    policy = _in_flight(rows)
    for _ in range(16):
        policy.predictor.observe(req("x", 1).tenant, "cold", 64, 64)
    for _ in range(RECENT_MIN if seconds_per_token is not None else 0):
        policy.token_time.observe(seconds_per_token or 0.0)
    return policy


def test_an_in_flight_engine_starts_a_request_at_once_when_it_can() -> None:
    policy = _in_flight(4)
    assert isinstance(policy.submit(req("c0", 3000), 0.0), Admitted)
    assert dispatched(policy.schedule(0.0)) == ["c0"]  # no batch timer, no bucket to fill
    policy.submit(req("h0", 100), 0.001)
    assert dispatched(policy.schedule(0.001)) == ["h0"]
    assert policy.next_wakeup(0.001) is None  # nothing queued: no timer was needed


def test_requests_start_earliest_deadline_first_across_lanes() -> None:
    policy = _in_flight(1)
    policy.submit(req("run", 100), 0.0)
    policy.schedule(0.0)
    policy.submit(req("cold", 2000), 0.0)  # due at 1.5 s
    policy.submit(req("warm", 500), 0.05)  # due at 0.4 s
    policy.submit(req("hot", 100), 0.1)  # due at 0.35 s
    order = []
    for i, done in enumerate(("run", "hot", "warm")):
        policy.on_done(done, 0.2 + i * 0.01, 10)
        order += dispatched(policy.schedule(0.2 + i * 0.01))
    assert order == ["hot", "warm", "cold"]
    # Long work absorbs delay up to its own target: a hot request arriving after the cold one's
    # deadline less hot's target (1.25 s after it) no longer passes it.
    policy.submit(req("cold2", 2000), 1.0)  # due at 2.5 s
    policy.submit(req("hot2", 100), 2.3)  # due at 2.55 s
    policy.on_done("cold", 2.4, 10)
    assert dispatched(policy.schedule(2.4)) == ["cold2"]


def test_a_request_the_kv_pool_cannot_take_yet_is_passed_for_a_while_then_kept_for() -> None:
    kv = KvConfig(total_blocks=300, max_in_flight=8, forecast_peak=False)
    # No aging bound on cold: c1 never yields for being past its deadline (tested below).
    lanes = tuple(
        replace(lane, max_wait_s=None) if lane.name == "cold" else lane for lane in default_lanes()
    )
    policy = PolicyScheduler(PolicyConfig(lanes=lanes, kv=kv, continuous_batching=True))
    policy.submit(req("c0", 3000), 0.0)
    assert dispatched(policy.schedule(0.0)) == ["c0"]
    policy.submit(req("c1", 3000), 0.0)  # due at 1.5 s; the blocks it needs are c0's
    policy.submit(req("h0", 100), 1.3)  # due at 1.55 s, after c1
    # Rows are free and the pool cannot take c1: h0 passes it rather than wait with them.
    assert dispatched(policy.schedule(1.3)) == ["h0"]
    policy.submit(req("h1", 100), 2.7)
    assert dispatched(policy.schedule(2.7)) == ["h1"]
    # c1 was first held at 1.3 s; a cold target (1.5 s) later nothing due after it passes it:
    # the blocks that free are kept for it.
    policy.submit(req("h2", 100), 2.85)
    assert dispatched(policy.schedule(2.85)) == []
    policy.on_done("c0", 2.9, 10)
    assert dispatched(policy.schedule(2.9)) == ["c1", "h2"]


def test_a_request_past_its_deadline_yields_to_those_that_can_meet_theirs_for_a_while() -> None:
    policy = _in_flight(1)
    policy.submit(req("run", 100), 0.0)
    assert dispatched(policy.schedule(0.0)) == ["run"]
    policy.submit(req("c0", 2000), 0.0)  # due at 1.5 s; cold's aging bound is 5 s
    policy.submit(req("h0", 100), 2.0)  # due at 2.25 s: c0 is late, h0 can still make it
    policy.on_done("run", 2.1, 10)
    assert dispatched(policy.schedule(2.1)) == ["h0"]
    policy.submit(req("h1", 100), 5.0)  # c0 has waited its aging bound by 5 s: it goes first
    policy.on_done("h0", 5.1, 10)
    assert dispatched(policy.schedule(5.1)) == ["c0"]


def test_once_a_hot_request_misses_for_want_of_a_row_the_cold_lane_leaves_rows_to_hot() -> None:
    policy = _in_flight(16)
    assert policy.rows_kept == 0  # work-conserving until a miss
    for i in range(17):
        policy.submit(req(f"c{i}", 2000), 0.0)
    assert len(dispatched(policy.schedule(0.0))) == 16  # every row
    policy.submit(req("h0", 100), 0.01)
    [missed] = policy.schedule(0.26)  # no row freed within hot's 250 ms
    assert isinstance(missed, Expired) and missed.reason is ExpireReason.MISSED_TARGET
    assert policy.rows_kept == 6  # hot's share, 0.40 of 16
    assert dict(policy.stats().counters)["row_guard"] == 1  # exported: when it trips
    for i in range(6):
        policy.on_done(f"c{i}", 0.3, 10)
    assert dispatched(policy.schedule(0.3)) == []  # c16 leaves the six rows to hot
    policy.submit(req("h1", 100), 0.31)
    assert dispatched(policy.schedule(0.31)) == ["h1"]  # and h1 finds one at once
    policy.on_done(f"c{6}", 0.4, 10)
    assert dispatched(policy.schedule(0.4)) == []
    policy.submit(req("w0", 500), 0.45)  # the middle lane's requests are not held by it
    assert dispatched(policy.schedule(0.45)) == ["w0"]
    # One drain half-life (10 s) after the miss the rows are the later lanes' again.
    policy.on_done(f"c{7}", 10.3, 10)
    assert policy.rows_kept == 0 and dispatched(policy.schedule(10.3)) == ["c16"]


def test_a_hot_arrival_waits_for_a_row_and_is_refused_at_once_when_none_frees_in_time() -> None:
    fresh = _in_flight(1)
    fresh.submit(req("c0", 2000, max_tokens=400), 0.0)
    fresh.schedule(0.0)
    fresh.on_progress("c0", 1, 0.1)
    for i in range(1, 10):
        fresh.on_progress("c0", 1 + 16 * i, 0.1 + 0.32 * i)
    assert fresh.token_time.median() == pytest.approx(0.02)
    assert fresh.row_wait(0) == 0.0  # no output seen yet: the row is taken to end now (not 5 s)
    policy = _learned(4)
    for i in range(4):
        policy.submit(req(f"c{i}", 2000), 0.0)
    assert len(dispatched(policy.schedule(0.0))) == 4  # every row
    assert policy.row_wait(0) == 0.0  # the engine's time per token is not known yet: admit
    for i in range(4):  # rows report their first token, then (here) every 16 tokens, 20 ms a token
        policy.on_progress(f"c{i}", 1, 0.1)
        policy.on_progress(f"c{i}", 17, 0.42)
        policy.on_progress(f"c{i}", 33, 0.74)
    assert policy.token_time.median() == pytest.approx(0.02)
    # 31 tokens left on every row: the first frees in ~620 ms, past hot's start budget.
    late = policy.submit(req("h1", 100), 0.74)
    assert isinstance(late, Rejected) and late.reason is RejectReason.PREDICTED_LATE
    assert late.retry_after_s == pytest.approx(0.62)
    assert "rows frees" in late.message
    # A row about to end (one token left) frees in time: admitted, and goes when it does.
    policy.on_progress("c0", 63, 0.8)
    assert isinstance(policy.submit(req("h2", 100), 0.8), Admitted)
    # A second hot arrival waits for the next row behind h2: ~600 ms again.
    assert policy.row_wait(1) == pytest.approx(0.62 - 0.06)
    assert isinstance(policy.submit(req("h3", 100), 0.8), Rejected)
    policy.on_done("c0", 0.82, 64)
    assert dispatched(policy.schedule(0.82)) == ["h2"]
    # A free row, or the rule configured off: no wait for a row.
    policy.on_done("c1", 0.83, 64)
    assert policy.row_wait(0) == 0.0
    on, off = _learned(4, 0.02), _learned(4, 0.02)
    off.config = replace(off.config, admission=AdmissionConfig(row_wait=False))
    for engine in (on, off):
        for i in range(4):
            engine.submit(req(f"c{i}", 2000), 0.0)
        engine.schedule(0.0)
    assert isinstance(on.submit(req("h0", 100), 0.1), Rejected)  # four rows still prefilling
    assert isinstance(off.submit(req("h0", 100), 0.1), Admitted)
    # A warm request due before it takes the first row that frees: a hot arrival waits for
    # the next one.
    pair = _learned(2, 0.02)
    pair.submit(req("c0", 2000), 0.0)
    pair.submit(req("c1", 2000), 0.0)
    pair.schedule(0.0)
    pair.submit(req("w0", 500), 0.05)  # due at 0.40 s (warm's 350 ms target)
    for rid in ("c0", "c1"):
        pair.on_progress(rid, 1, 0.1)
    pair.on_progress("c0", 63, 0.2)  # one token left: frees in ~20 ms, for w0
    refused = pair.submit(req("h0", 100), 0.2)  # due at 0.45 s; c1 frees in ~1.16 s
    assert isinstance(refused, Rejected) and refused.retry_after_s == pytest.approx(1.16)
    pair.cancel("w0", 0.2)
    assert isinstance(pair.submit(req("h1", 100), 0.2), Admitted)
    # A row in its context phase has its whole output ahead, however long it has prefilled.
    slow = _learned(1, 0.02)
    slow.submit(req("c0", 2000), 0.0)
    slow.schedule(0.0)
    slow.schedule(5.0)
    assert slow.row_wait(0) == pytest.approx(64 * 0.02)


def test_once_a_hot_first_token_is_late_beside_cold_prompts_they_prefill_one_at_a_time() -> None:
    policy = _in_flight(16)
    assert policy.prefill_slots is None  # any number prefill at once until a miss
    for i in range(3):
        policy.submit(req(f"c{i}", 2000), 0.0)
    policy.submit(req("h0", 250), 0.0)
    assert sorted(dispatched(policy.schedule(0.0))) == ["c0", "c1", "c2", "h0"]
    policy.on_progress("h0", 1, 0.2)  # within hot's 250 ms: nothing changes
    assert policy.prefill_slots is None
    policy.submit(req("h1", 250), 0.3)
    assert dispatched(policy.schedule(0.3)) == ["h1"]
    policy.on_progress("h1", 1, 0.7)  # 400 ms, three cold prompts prefilling beside it
    assert policy.prefill_slots == 1
    assert dict(policy.stats().counters)["prefill_guard"] == 1  # exported: when it trips
    policy.submit(req("c3", 2000), 0.8)
    policy.submit(req("w0", 500), 0.8)
    policy.submit(req("h2", 100), 0.8)
    # The cold prompt waits for a slot; the warm and hot ones are not held by the guard.
    assert sorted(dispatched(policy.schedule(0.8))) == ["h2", "w0"]
    policy.on_progress("c0", 1, 0.9)
    policy.on_progress("c1", 1, 0.9)
    assert dispatched(policy.schedule(0.9)) == []  # c2 still prefills: one is the guard's
    policy.on_progress("c2", 1, 1.0)
    assert dispatched(policy.schedule(1.0)) == ["c3"]
    # One drain half-life (10 s) after the miss, any number prefill at once again.
    policy.on_progress("c3", 1, 10.6)
    policy.submit(req("c4", 2000), 10.8)
    policy.submit(req("c5", 2000), 10.8)
    assert policy.prefill_slots is None
    assert dispatched(policy.schedule(10.8)) == ["c4", "c5"]


def test_a_late_hot_first_token_beside_one_cold_prompt_or_warm_ones_leaves_the_guard_off() -> None:
    policy = _in_flight(16)
    policy.submit(req("c0", 2000), 0.0)
    policy.submit(req("h0", 250), 0.0)
    policy.schedule(0.0)
    policy.on_progress("h0", 1, 0.4)  # late, but one long prompt is what the guard allows
    assert policy.prefill_slots is None
    warm = _in_flight(16)
    for i in range(3):
        warm.submit(req(f"w{i}", 800), 0.0)
    warm.submit(req("h0", 250), 0.0)
    warm.schedule(0.0)
    warm.on_progress("h0", 1, 0.4)  # late beside warm prompts: the guard holds only cold ones
    assert warm.prefill_slots is None
    off = _in_flight(16)
    off.config = replace(off.config, prefill_guard_slots=None)
    for i in range(3):
        off.submit(req(f"c{i}", 2000), 0.0)
    off.submit(req("h0", 250), 0.0)
    off.schedule(0.0)
    off.on_progress("h0", 1, 0.4)
    assert off.prefill_slots is None  # configured off


def test_the_prefill_budget_holds_later_lanes_and_lets_the_first_pass() -> None:
    policy = _in_flight(64, budget=1000)
    policy.submit(req("c0", 1100), 0.0)
    assert dispatched(policy.schedule(0.0)) == ["c0"]  # longer than the budget: it goes alone
    policy.submit(req("w0", 500), 0.01)
    policy.submit(req("h0", 100), 0.02)
    # c0 is not prefilled yet: w0 (due first) waits for the budget; h0 passes it.
    assert dispatched(policy.schedule(0.02)) == ["h0"]
    policy.on_progress("c0", 1, 0.03)  # c0's first token: its prompt is prefilled
    policy.submit(req("w1", 400), 0.03)
    assert dispatched(policy.schedule(0.03)) == ["w0", "w1"]  # 900 tokens: within 1000
    policy.submit(req("w2", 300), 0.04)
    assert dispatched(policy.schedule(0.04)) == []  # 1200 would be over it
    policy.cancel("w0", 0.05)
    assert dispatched(policy.schedule(0.05)) == ["w2"]


def test_the_prefill_budget_counts_only_the_prompt_tokens_the_engine_must_prefill() -> None:
    policy = _in_flight(64, budget=1000)
    # Three turns of chat sessions, 2,100-token prompts of which the engine holds 2,000 cached
    # (their shared system prompt): 100 tokens each to prefill, 300 in all, within the budget.
    for i in range(3):
        policy.submit(req(f"turn{i}", 2100, cached_tokens=2000), 0.01 * i)
    assert dispatched(policy.schedule(0.03)) == ["turn0", "turn1", "turn2"]
    assert policy._prefill_tokens["cold"] == 300
    # The same prompts with nothing cached: the first goes alone, the others wait for its prefill.
    policy.submit(req("miss0", 2100), 0.04)
    policy.submit(req("miss1", 2100), 0.04)
    assert dispatched(policy.schedule(0.04)) == []  # 300 + 2,100 would be over it
    for i in range(3):
        policy.on_progress(f"turn{i}", 1, 0.05)
    assert dispatched(policy.schedule(0.05)) == ["miss0"]
    policy.on_progress("miss0", 1, 0.06)
    assert dispatched(policy.schedule(0.06)) == ["miss1"]


def test_a_hot_request_past_its_target_is_answered_at_once_not_sent_down() -> None:
    policy = _in_flight(1)
    policy.submit(req("run", 100), 0.0)
    policy.schedule(0.0)
    policy.submit(req("h0", 100), 0.0)
    policy.submit(req("w0", 500), 0.0)
    assert policy.schedule(0.2) == []
    [expired] = policy.schedule(0.25)  # hot's 250 ms target, no fallback: refused now
    assert isinstance(expired, Expired) and expired.request_id == "h0"
    assert expired.reason is ExpireReason.MISSED_TARGET
    assert "degraded_lane" not in dict(policy.stats().counters)
    # A requeue lane waits again, twice, keeping its place; then it is refused.
    assert policy.schedule(0.35) == [] and policy.schedule(0.7) == []
    assert dict(policy.stats().counters)["requeued"] == 2
    [late] = policy.schedule(1.05)
    assert isinstance(late, Expired) and late.reason is ExpireReason.REQUEUE_LIMIT


def test_a_long_prompt_pinned_to_hot_keeps_hot_order_but_its_own_lengths_target() -> None:
    policy = _in_flight(1)
    policy.submit(req("run", 100), 0.0)
    policy.schedule(0.0)
    # 3,000 tokens pinned hot (an interactive chat with a long history): timed by the cold
    # lane its length picks (1.5 s), not hot's 250 ms that its own prefill could not meet.
    policy.submit(req("long", 3000, lane="hot"), 0.0)
    policy.submit(req("short", 100, lane="cold"), 0.0)  # pinned to a looser lane: keeps it
    assert policy.timed_by("hot", req("x", 3000, lane="hot")) == "cold"
    assert policy.timed_by("cold", req("x", 100, lane="cold")) == "cold"
    assert policy.timed_by("hot", req("x", 100)) == "hot"
    assert policy.schedule(0.3) == []  # past hot's target: still waiting
    policy.on_progress("run", 1, 0.35)
    policy.on_done("run", 0.4, 1)
    # Both due at 1.5 s: the earlier arrival goes first.
    assert dispatched(policy.schedule(0.4)) == ["long"]
    policy.on_progress("long", 1, 0.5)
    # What it taught is the cold lane's start-to-first-token time, not the hot lane's.
    assert len(policy.first_token["cold"].samples) == 1
    assert len(policy.first_token["hot"].samples) == 1  # "run"'s only
    # Still timed out at its own length's target.
    policy.submit(req("late", 3000, lane="hot"), 0.5)
    assert policy.schedule(1.99) == []
    [expired] = policy.schedule(2.0)
    assert isinstance(expired, Expired) and expired.request_id == "late"
    assert expired.reason is ExpireReason.MISSED_TARGET


def test_a_lane_starts_its_requests_early_enough_for_the_engines_first_token() -> None:
    policy = _in_flight(1)
    assert policy.start_budget("hot") == 0.25  # nothing learned: the whole target
    # Eight hot starts, each 100 ms from start to first token.
    for i in range(8):
        t = i * 0.2
        policy.submit(req(f"r{i}", 100), t)
        assert dispatched(policy.schedule(t)) == [f"r{i}"]
        policy.on_progress(f"r{i}", 1, t + 0.1)
        policy.on_done(f"r{i}", t + 0.15, 1)
    assert policy.start_budget("hot") == pytest.approx(0.15)  # 250 ms less the engine's 100
    assert policy.start_budget("warm") == 0.35  # its own lane learned nothing
    policy.submit(req("run", 100), 2.0)
    policy.schedule(2.0)
    policy.submit(req("h0", 100), 2.0)
    assert policy.schedule(2.14) == []
    [expired] = policy.schedule(2.15)  # started later, it could not meet 250 ms: refused now
    assert isinstance(expired, Expired) and expired.request_id == "h0"
    # However slow the engine lately was, a lane keeps a quarter of its target to start in.
    for _ in range(64):
        policy.first_token["hot"].observe(5.0)
    assert policy.start_budget("hot") == pytest.approx(MIN_START_SHARE * 0.25)


def test_the_prefill_budget_follows_the_engines_cost_per_prompt_token() -> None:
    # H200 8B: 24.4 us a prompt token; a quarter of hot's 250 ms is 2,561 tokens.
    assert prefill_budget_tokens(0.25, 24.4e-6, 8192) == 2561
    assert prefill_budget_tokens(0.25, 24.4e-6, 1024) == 2048  # at most two steps
    assert prefill_budget_tokens(0.25, None, 256) == 512  # unknown cost: two steps
    assert prefill_budget_tokens(0.25, None, None) is None
    # equal_progress chunking gives a short prompt its share of every step: a budget only
    # where one step's prompt work costs more than the share of the target.
    assert prefill_budget_tokens(0.25, 24.4e-6, 8192, "equal_progress") == 2561
    assert prefill_budget_tokens(0.25, 24.4e-6, 2048, "equal_progress") is None
    assert prefill_budget_tokens(0.25, None, 256, "equal_progress") is None  # unknown cost
    assert prefill_budget_tokens(0.25, None, 256, "first_come_first_served") == 512


def test_hot_timeout_degrades_to_the_fallback_backend_or_a_shorter_answer() -> None:
    base = PolicyConfig(kv=KvConfig(total_blocks=16, max_in_flight=1))
    policy = PolicyScheduler(replace(base, degrade_backend=True))
    policy.submit(req("running", 100), 0.0)
    policy.schedule(0.05)
    policy.submit(req("w", 100), 0.06)
    [decision] = policy.schedule(0.17)
    assert isinstance(decision, Dispatch) and decision.target is Target.DEGRADE

    base = PolicyConfig(kv=KvConfig(total_blocks=64, max_in_flight=1))
    policy = PolicyScheduler(replace(base, degrade_max_tokens=16))
    policy.submit(req("running", 100), 0.0)
    policy.schedule(0.05)
    policy.submit(req("w", 100, max_tokens=500), 0.06)
    assert policy.schedule(0.17) == []  # promoted and shortened, waiting for the running one
    policy.on_done("running", 0.2, 10)
    [decision] = policy.schedule(0.2)
    assert isinstance(decision, Dispatch) and decision.max_tokens == 16
    assert dict(policy.stats().counters)["degraded_max_tokens"] == 1


def test_warm_waits_again_twice_then_is_rejected() -> None:
    policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=64, max_in_flight=1)))
    policy.submit(req("running", 300), 0.0)
    policy.schedule(0.05)
    policy.submit(req("w", 300), 0.1)
    assert policy.schedule(0.6) == [] and policy.schedule(1.1) == []
    counters = dict(policy.stats().counters)
    assert counters["requeued"] == 2
    assert policy.schedule(1.6) == [Expired("w", ExpireReason.REQUEUE_LIMIT, "warm")]


def test_cold_goes_to_the_elastic_pool_or_keeps_waiting() -> None:
    lanes = tuple(
        replace(lane, queue_timeout_s=2.0) if lane.name == "cold" else lane
        for lane in default_lanes()
    )
    base = PolicyConfig(lanes=lanes, kv=KvConfig(total_blocks=1024, max_in_flight=1))
    for elastic, expected in ((True, Target.ELASTIC), (False, None)):
        policy = PolicyScheduler(replace(base, elastic_backend=elastic))
        policy.submit(req("running", 2000), 0.0)
        policy.schedule(0.05)
        policy.submit(req("c", 2000), 0.1)
        decisions = policy.schedule(2.1)
        if expected is None:
            assert decisions == [] and policy.queued_ids() == {"c": "cold"}
        else:
            assert [(d.request_id, d.target) for d in decisions if isinstance(d, Dispatch)] == [
                ("c", expected)
            ]


def test_kv_admission_holds_a_batch_until_blocks_are_free_and_frees_them_after() -> None:
    policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=20, tokens_per_block=16)))
    policy.submit(req("a", 200, max_tokens=56), 0.0)  # 256 tokens: 16 blocks
    policy.submit(req("b", 1000, max_tokens=24, lane="hot"), 0.0)  # 64 blocks: too large
    assert dispatched(policy.schedule(0.05)) == ["a"]
    kv = policy.stats().kv
    assert kv is not None and kv.reserved_blocks == 16 and kv.free_blocks == 4
    policy.submit(req("c", 100, max_tokens=60), 0.1)  # 10 blocks: waits
    assert policy.schedule(0.15) == []
    policy.on_done("a", 0.18, 56)
    assert dispatched(policy.schedule(0.18)) == ["c"]
    verdict = policy.submit(req("huge", 400, max_tokens=24), 0.3)
    assert isinstance(verdict, Rejected) and verdict.reason is RejectReason.TOO_LARGE
    assert "KV blocks" in verdict.message


def test_a_request_whose_prefix_is_cached_reserves_blocks_for_the_rest_only() -> None:
    """Sessions sharing a 2,000-token system prompt: the engine holds its blocks once, so the
    mirror reserves each request's own tokens; without the hint the same pool takes fewer."""

    def admitted(cached: int) -> tuple[int, dict[str, int]]:
        policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=400, tokens_per_block=16)))
        for i in range(6):  # 2,048 prompt tokens (128 blocks) + 48 of output (3 blocks) each
            policy.submit(req(f"s{i}", 2048, max_tokens=48, cached_tokens=cached), 0.0)
        return len(dispatched(policy.schedule(0.05))), policy.mirror.held()

    alone, held = admitted(0)
    assert alone == 2 and set(held.values()) == {131}
    shared, held = admitted(2000)
    assert shared == 6 and set(held.values()) == {6}  # 48 prompt + 48 output tokens
    # A hint past the prompt still leaves the last token to the request itself.
    _, held = admitted(10_000)
    assert set(held.values()) == {4}  # 1 + 48 tokens


def test_contiguous_mode_reserves_the_maximum_sequence_length() -> None:
    kv = KvConfig(KvMode.CONTIGUOUS, tokens_per_block=16, total_blocks=1024, max_seq_len=4096)
    policy = PolicyScheduler(PolicyConfig(kv=kv))
    for i in range(5):
        policy.submit(req(f"r{i}", 100), 0.0)
    assert len(dispatched(policy.schedule(0.05))) == 4  # 256 blocks each
    assert policy.stats().kv.fragmentation > 0.9  # type: ignore[union-attr]


@pytest.mark.parametrize("spread", [False, True])
def test_a_flooding_tenant_does_not_starve_another(spread: bool) -> None:
    """`spread`: the flood narrows itself to a fresh sub-tenant per request (`flood/1`, ...),
    which used to get a fresh fair-share tag each time, ahead of `quiet`."""
    policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=100_000, max_in_flight=16)))
    for i in range(200):
        policy.submit(req(f"a{i}", 300, tenant=f"flood/{i}" if spread else "flood"), 0.0)
    for i in range(4):
        policy.submit(req(f"b{i}", 300, tenant="quiet"), 0.01)
    order: list[str] = []
    now = 0.05
    for _ in range(8):
        batch = dispatched(policy.schedule(now))
        order += batch
        for rid in batch:
            policy.on_done(rid, now, 10)
        now += 0.05
    assert len(order) >= 64
    assert {f"b{i}" for i in range(4)} <= set(order[:48])


def test_idle_lanes_lend_their_share_and_busy_lanes_split_by_share() -> None:
    policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=100_000, max_in_flight=32)))
    for i in range(64):
        policy.submit(req(f"w{i}", 300), 0.0)
    assert len(dispatched(policy.schedule(0.0))) == 32  # warm alone takes every row
    policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=100_000, max_in_flight=10_000)))
    tokens = {"hot": 0, "cold": 0}
    for i in range(400):
        policy.submit(req(f"h{i}", 200, max_tokens=100), 0.0)
    for i in range(100):
        policy.submit(req(f"c{i}", 1500, max_tokens=100), 0.0)
    decisions = [d for d in policy.schedule(0.0) if isinstance(d, Dispatch)][:300]
    for d in decisions:
        tokens[d.lane] += max(d.batch.prompt_tokens) if d.batch else 0
    share = tokens["hot"] / (tokens["hot"] + tokens["cold"])
    assert 0.6 < share < 0.85  # 40 : 15 by configured share -> 0.73


def test_the_breaker_demotes_warm_arrivals_while_hot_is_backed_up_and_closes_after() -> None:
    policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=1000, max_in_flight=1)))
    for i in range(51):
        policy.submit(req(f"h{i}", 10), 0.0)
    for i in range(4):
        policy.submit(req(f"w{i}", 300), 0.0)
    lanes = policy.queued_ids()
    assert sum(lanes[f"w{i}"] == "cold" for i in range(4)) == 2
    assert policy.stats().breaker_open
    policy.schedule(0.2)  # hot requests time out (no fallback): the backlog drains
    policy.schedule(1.0)
    assert not policy.stats().breaker_open


def test_a_request_past_its_prediction_gets_more_blocks_and_is_counted() -> None:
    policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=1000)))
    for i in range(16):  # teach the predictor: this tenant uses 1/4 of max_tokens
        policy.submit(req(f"t{i}", 100, max_tokens=400), 0.0)
    for d in policy.schedule(0.0):
        policy.on_done(d.request_id, 0.1, 100)
    policy.submit(req("big", 100, max_tokens=400), 0.2)
    policy.schedule(0.25)
    before = policy.mirror.held()["big"]
    assert before == 13  # (100 + 100) / 16, rounded up
    policy.on_progress("big", 150, 0.3)
    assert policy.mirror.held()["big"] == 22  # used 250 + another prediction's 100 tokens
    policy.on_progress("big", 260, 0.35)
    assert policy.mirror.held()["big"] == 29  # 360 + 100
    policy.on_progress("big", 390, 0.4)
    assert policy.mirror.held()["big"] == 32  # at most prompt + max_tokens
    assert dict(policy.stats().counters)["mispredicted"] == 1


def test_an_engine_that_reserves_max_tokens_is_mirrored_so() -> None:
    kv = KvConfig(total_blocks=1000, reserve_max_tokens=True)
    policy = PolicyScheduler(PolicyConfig(kv=kv))
    for i in range(16):  # the predictor learns a quarter of max_tokens ...
        policy.submit(req(f"t{i}", 100, max_tokens=400), 0.0)
    for d in policy.schedule(0.0):
        policy.on_done(d.request_id, 0.1, 100)
    policy.submit(req("next", 100, max_tokens=400), 0.2)
    policy.schedule(0.25)
    assert policy.mirror.held()["next"] == 32  # ... but the engine holds prompt + max_tokens


def test_admission_keeps_the_reserve_free_and_waits_while_blocks_are_owed() -> None:
    # 200 blocks of 16 tokens, 5 % (10 blocks) kept back while anything is held.
    policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=200, tokens_per_block=16)))
    assert policy.mirror.reserve_blocks == 10
    # A lone request may take the whole pool: 200 blocks of prompt + max_tokens.
    policy.submit(req("alone", 3000, max_tokens=200), 0.0)
    assert dispatched(policy.schedule(1.0)) == ["alone"]
    policy.on_done("alone", 1.1, 200)
    # Teach the predictor: warm requests use a quarter of max_tokens.
    teach = [f"t{i}" for i in range(16)]
    for rid in teach:
        policy.submit(req(rid, 300, max_tokens=64), 2.0)
    now = 2.0
    while any(rid in policy.queued_ids() or rid in policy.in_flight_ids() for rid in teach):
        now += 0.1
        for rid in dispatched(policy.schedule(now)):
            policy.on_done(rid, now, 16)
    # Four warm requests of 50 blocks each (700 + a predicted 100 of 400): the fourth would
    # leave 0 < 10 blocks free, so it waits.
    for rid in "abcd":
        policy.submit(req(rid, 700, max_tokens=400), now)
    now += 1.0
    assert sorted(dispatched(policy.schedule(now))) == ["a", "b", "c"]
    assert policy.stats().kv.free_blocks == 50 and "d" in policy.queued_ids()
    # Each outruns its prediction and grows by another prediction's worth, to prompt +
    # max_tokens here (69 blocks): the third finds too few free, so blocks are owed, and even
    # a one-block request waits.
    for rid in "abc":
        policy.on_progress(rid, 300, now)
    assert policy.stats().kv.owed_blocks == 7
    policy.submit(req("small", 10, max_tokens=4), now)
    assert dispatched(policy.schedule(now + 0.1)) == []
    # One ends: what it frees repays the debt first, then admission resumes.
    policy.on_done("a", now + 0.2, 200)
    assert sorted(dispatched(policy.schedule(now + 0.3))) == ["d", "small"]
    assert policy.stats().kv.owed_blocks == 0


def test_aging_promotes_a_blocked_request_and_keeps_freed_room_for_it() -> None:
    lanes = tuple(
        replace(lane, max_wait_s=0.3) if lane.name == "cold" else lane for lane in default_lanes()
    )
    policy = PolicyScheduler(PolicyConfig(lanes=lanes, kv=KvConfig(total_blocks=180)))
    assert [lane.max_wait_s for lane in policy.stats().lanes] == [0.1, 1.0, 0.3]
    policy.submit(req("running", 1000), 0.0)  # warm: 67 blocks
    assert dispatched(policy.schedule(0.05)) == ["running"]
    policy.submit(req("big", 2000), 0.06)  # cold: 129 blocks, 113 free: blocked
    policy.submit(req("h", 10), 0.2)  # hot: 5 blocks, fits, goes while big waits
    assert dispatched(policy.schedule(0.25)) == ["h"]
    policy.submit(req("h2", 10), 0.37)  # after big was promoted (0.36)
    assert policy.schedule(0.43) == []  # h2 would fit, but the room is kept for big
    assert dict(policy.stats().counters)["promoted"] == 1
    policy.on_done("running", 0.45, 64)
    assert dispatched(policy.schedule(0.45)) == ["big", "h2"]


def test_a_promoted_request_goes_before_a_newer_bucket_mate_that_does_not_fit() -> None:
    # One requeue lane: a request that waits again takes a new, later fair tag, so a newer
    # request in its bucket comes first in fair order. Once promoted it must not wait behind
    # that one where only it fits (found by the state machine at 16 rows).
    lanes = (LaneConfig("only", 0, 1.0, 8, 16, 0.1, OnTimeout.REQUEUE, 10, 0.35, 4.0, 0.0),)
    kv = KvConfig(total_blocks=64, tokens_per_block=16, max_in_flight=16, reserve_fraction=0.05)
    breaker = BreakerConfig(watch_lane="only", demote_lane="only", to_lane="only")
    policy = PolicyScheduler(PolicyConfig(lanes=lanes, kv=kv, breaker=breaker))
    policy.submit(req("run1", 719, max_tokens=1), 0.0)  # 45 blocks
    policy.submit(req("run2", 159, max_tokens=1), 0.0)  # 10 blocks: 9 left, 4 kept
    assert sorted(dispatched(policy.schedule(0.0))) == ["run1", "run2"]
    policy.submit(req("old", 100, max_tokens=1), 0.0)  # 7 blocks: waits
    policy.submit(req("new", 250, max_tokens=1), 0.15)  # 16 blocks, same bucket
    for t in (0.1, 0.2, 0.3, 0.36):
        assert dispatched(policy.schedule(t)) == []
    assert dict(policy.stats().counters)["promoted"] == 1
    queued = policy.lanes["only"].entries
    assert queued["new"].tag < queued["old"].tag  # old waited again after new came
    policy.on_done("run2", 0.37, 1)  # 19 free: old fits (7 + 4 kept), new does not (16 + 4)
    assert dispatched(policy.schedule(0.37)) == ["old"]


def test_queue_caps_reject_with_a_retry_hint() -> None:
    lanes = (LaneConfig("only", 0, 1.0, 4, 2, None, OnTimeout.REQUEUE),)
    config = PolicyConfig(
        lanes=lanes,
        breaker=replace(
            PolicyConfig().breaker, watch_lane="only", demote_lane="only", to_lane="only"
        ),
        retry_after_s=0.25,
    )
    policy = PolicyScheduler(config)
    policy.submit(req("a", 10), 0.0)
    policy.submit(req("b", 10), 0.0)
    verdict = policy.submit(req("c", 10), 0.0)
    assert isinstance(verdict, Rejected) and verdict.reason is RejectReason.QUEUE_FULL
    assert verdict.retry_after_s == 0.25 and "'only' is full" in verdict.message


def static_policy() -> PolicyScheduler:
    """The policy as the sidecar sets it for a static engine with one instance; lanes that
    neither time out nor age within these tests."""
    lanes = tuple(replace(lane, queue_timeout_s=None, max_wait_s=None) for lane in default_lanes())
    return PolicyScheduler(
        PolicyConfig(lanes=lanes, continuous_batching=False, max_batches_in_flight=1)
    )


def test_a_static_engine_gets_one_batch_at_a_time_and_buckets_fill_meanwhile() -> None:
    policy = static_policy()
    for i in range(16):
        policy.submit(req(f"a{i}", 100), 0.0)  # a full hot bucket goes at once
    first = policy.schedule(0.0)
    assert len(dispatched(first)) == 16 and policy.stats().batches_in_flight == 1
    for i in range(5):
        policy.submit(req(f"b{i}", 120), 0.01)
    # Past its batch timeout the next bucket is ready, but the engine is busy: it keeps filling.
    assert dispatched(policy.schedule(0.2)) == []
    for i in range(5, 9):
        policy.submit(req(f"b{i}", 110), 0.21)
    assert dispatched(policy.schedule(0.22)) == []
    for i in range(15):
        policy.on_done(f"a{i}", 0.3, 10)
    assert dispatched(policy.schedule(0.3)) == []  # one row of the batch still runs
    policy.on_done("a15", 0.4, 10)
    second = policy.schedule(0.4)
    assert sorted(dispatched(second)) == sorted(f"b{i}" for i in range(9))
    assert len({d.batch.batch_id for d in second if isinstance(d, Dispatch) and d.batch}) == 1


def test_when_a_static_engine_frees_the_hot_lane_goes_first() -> None:
    policy = static_policy()
    for i in range(8):
        policy.submit(req(f"c{i}", 1500), 0.0)  # a full cold bucket takes the engine
    assert len(dispatched(policy.schedule(0.0))) == 8
    for i in range(10):
        policy.submit(req(f"w{i}", 400), 0.01)
    for i in range(4):
        policy.submit(req(f"h{i}", 100), 0.02)
    policy.schedule(0.2)  # both buckets are ready now, and wait for the engine
    for i in range(8):
        policy.on_done(f"c{i}", 0.5, 20)
    nxt = policy.schedule(0.5)
    assert sorted(dispatched(nxt)) == [f"h{i}" for i in range(4)]
    for i in range(4):
        policy.on_done(f"h{i}", 0.6, 20)
    assert len(dispatched(policy.schedule(0.6))) == 10  # then the warm bucket


class PolicyMachine(RuleBasedStateMachine):
    """Random arrivals, time, completions, cancels and KV observations; invariants hold."""

    def __init__(self) -> None:
        super().__init__()
        lanes = tuple(replace(lane, max_queued=12) for lane in default_lanes())
        self.config = PolicyConfig(
            lanes=lanes,
            kv=KvConfig(total_blocks=300, tokens_per_block=16, max_in_flight=8),
            # Learn drain rates quickly, so predictive admission acts within a run.
            admission=AdmissionConfig(min_busy_s=0.05, min_completions=1),
            # Tenant a weighs twice b: fair order, fair admission and push-out all act.
            fairness=FairnessConfig(weights=(("a", 2.0),)),
        )
        self.policy = PolicyScheduler(self.config)
        self.now = 0.0
        self.n = 0
        self.ends: dict[str, str] = {}  # request id -> terminal state
        self.admitted: set[str] = set()
        self.in_flight: set[str] = set()
        self.batch_of: dict[str, int] = {}

    @rule(
        prompt=st.integers(1, 3000),
        max_tokens=st.integers(1, 400),
        tenant=st.sampled_from(["a", "b"]),
        deadline=st.none() | st.floats(0.0, 2.0),
        pin=st.none() | st.sampled_from(["hot", "cold"]),
        cached=st.sampled_from([0, 0, 16, 1000, 4000]),  # the engine's cache, as the shell guessed
    )
    def submit(
        self,
        prompt: int,
        max_tokens: int,
        tenant: str,
        deadline: float | None,
        pin: str | None,
        cached: int,
    ) -> None:
        rid = f"r{self.n}"
        self.n += 1
        when = None if deadline is None else self.now + deadline
        queued_before = self.policy.stats().queued
        rows_full = self.rows_left() <= 0
        request = Request(
            rid,
            prompt,
            max_tokens,
            tenant=tenant,
            queue_deadline=when,
            lane=pin,
            cached_tokens=cached,
        )
        verdict = self.policy.submit(request, self.now)
        if isinstance(verdict, Rejected):
            self.ends[rid] = "rejected"
            if verdict.reason is RejectReason.PREDICTED_LATE:
                # Refused for a predicted wait only with work queued ahead or every row taken
                # (waiting for one to free), and the hint is that wait: never at an idle
                # sidecar, never with a zero hint.
                assert (queued_before > 0 or rows_full) and verdict.retry_after_s > 0
        else:
            self.admitted.add(rid)
            queued = self.policy.queued_ids()
            if rid in queued:
                # Timed by its lane's target, or if pinned the looser of that and its length's.
                entry = self.policy.lanes[queued[rid]].entries[rid]
                lanes = {queued[rid], self.policy.classify(request)} if pin else {queued[rid]}
                target = self.config.lane(entry.timed_by).ttft_target_s
                assert target == max(self.config.lane(n).ttft_target_s for n in lanes)

    @rule(dt=st.floats(0.0, 0.7))
    def tick(self, dt: float) -> None:
        self.now += dt
        released = False
        dispatches = []
        mirror = self.policy.mirror
        held_before = mirror.reserved_blocks > 0
        for decision in self.policy.schedule(self.now):
            rid = decision.request_id
            assert rid in self.admitted and rid not in self.ends and rid not in self.in_flight
            if isinstance(decision, Expired):
                self.ends[rid] = "expired"
                if decision.reason is ExpireReason.PREDICTED_LATE:
                    assert decision.retry_after_s is not None and decision.retry_after_s > 0
                continue
            assert decision.batch is not None
            lane = self.config.lane(decision.lane)
            assert decision.batch.size <= lane.max_batch
            lengths = decision.batch.prompt_tokens
            assert max(lengths) <= lane.max_ratio * min(lengths)
            self.in_flight.add(rid)
            self.batch_of[rid] = decision.batch.batch_id
            dispatches.append(decision)
            released = True
        if any(d.target is Target.PRIMARY for d in dispatches):
            # Predicted-output admission: new work joins the engine only while no running
            # request is owed blocks it outgrew into, and leaves the reserve free for them
            # (unless the pool held nothing: a lone request may use it all).
            assert mirror.owed_blocks == 0
            assert not held_before or mirror.free_blocks >= mirror.reserve_blocks
        if self.config.continuous_batching:
            self.check_deadline_order()
        limit = self.config.max_batches_in_flight
        if released and limit is not None:
            running = {self.batch_of[r] for r in self.in_flight}
            assert len(running) <= limit, f"{len(running)} batches in flight, limit {limit}"
            assert self.policy.stats().batches_in_flight == len(running)
        self.check_waits()

    def lane_rows(self) -> dict[str, int]:
        rows = dict.fromkeys(self.policy.lanes, 0)
        for flight in self.policy._in_flight.values():
            if flight.target is Target.PRIMARY:
                rows[flight.lane] += 1
        return rows

    def rows_left(self) -> int:
        return self.config.kv.max_in_flight - sum(self.lane_rows().values())

    def check_deadline_order(self) -> None:
        """Work-conserving in deadline order: after a decision, the queued request due first
        could not have gone (no free sequence, or the KV pool refuses it, or, for a later
        lane, the prefill budget holds it, or, for the last, the row or prefill guard), and
        neither could the first lane's."""
        policy, mirror = self.policy, self.policy.mirror
        first = self.config.lanes[0].name
        budget = self.config.prefill_budget_tokens
        prefilling = sum(n for lane, n in policy._prefill_tokens.items() if lane != first)
        last = self.config.lanes[-1].name
        long_rows = sum(
            1
            for f in policy._in_flight.values()
            if f.target is Target.PRIMARY and f.prefilling and f.lane == last != first
        )
        slots = policy.prefill_slots
        queued = [(e.deadline, e.seq, lane, e) for lane, e in policy._queued.values()]
        limit = self.config.max_batches_in_flight
        full = self.rows_left() <= 0 or (
            limit is not None and policy.stats().batches_in_flight >= limit
        )
        candidates = queued
        while candidates:
            # The lane whose request is due first; of it, the request first in fair order,
            # unless the one due first has its tenant at most one of its requests ahead of the
            # fair head and is its tenant's only one queued there or nearly out of slack
            # (deadline feasibility first).
            # Each lane ranks by its request due first; one past its deadline within its lane's
            # aging bound yields (its lane goes after the others).
            heads = {}
            for q in sorted(candidates, key=lambda q: q[:2]):
                heads.setdefault(q[2], q)
            _, _, lane, due = min(heads.values(), key=lambda q: (self.yields(q[3], q[2]), *q[:2]))
            entry = due
            if self.config.fairness.enabled:
                fair = min((q[3] for q in candidates if q[2] == lane), key=lambda e: (e.tag, e.seq))
                queue = policy.lanes[lane]
                urgent = due.deadline - self.now <= URGENT_SHARE * queue.config.ttft_target_s
                close = due.tag <= fair.tag + queue.typical_span
                mine = sum(1 for q in candidates if q[2] == lane and q[3].tenant == due.tenant)
                entry = due if close and (mine <= 1 or urgent) else fair
            if full:
                return  # held by rows: the request due first keeps the row that frees
            if self.rows_left() <= policy.rows_kept_for_light(entry.tenant):
                # The last rows stay for a light tenant: the lane's fair head may take one
                # unless it is held too; else this lane's may not.
                fair = min((q[3] for q in candidates if q[2] == lane), key=lambda e: (e.tag, e.seq))
                if fair is entry or self.rows_left() <= policy.rows_kept_for_light(fair.tenant):
                    candidates = [q for q in candidates if q[2] != lane]
                    continue
                entry = fair
            guarded = slots is not None and long_rows >= slots
            if lane == last != first and (self.rows_left() <= policy.rows_kept or guarded):
                # The row or prefill guard holds the last lane alone: the others may still go.
                candidates = [q for q in candidates if q[2] != lane]
                continue
            held = (
                lane != first
                and budget is not None
                and prefilling > 0
                and prefilling + entry.prompt_tokens > budget
            )
            fits = mirror.admissible([policy.need(entry)], [entry.own_prompt_tokens]) == 1
            assert held or not fits, f"{entry.request_id} could go"
            if held:  # held by the budget: the first lane's may still pass it
                candidates = [q for q in candidates if q[2] == first] if lane != first else []
                continue
            # Held by KV: other lanes' requests may pass it within its window, counted from when
            # it was first held (so set); after that nothing overtakes it.
            assert entry.held_since is not None and entry.held_since <= self.now
            window = KV_PASS_SHARE * self.config.lane(entry.timed_by or lane).ttft_target_s
            passable = self.now - entry.held_since < window
            candidates = [q for q in candidates if q[2] != lane] if passable else []

    def yields(self, entry: Entry, lane: str) -> bool:
        max_wait = self.config.lane(lane).max_wait_s
        late = entry.deadline < self.now
        return late and max_wait is not None and self.now < entry.arrived_at + max_wait

    def check_waits(self) -> None:
        # Nobody waits past its lane's bound + batch timeout while what it needs is free, unless
        # an older overdue request is blocked: the core then keeps freed room for that one
        # (draining for it is what stops a large request from starving).
        if self.config.continuous_batching:
            return  # deadline order: check_deadline_order
        mirror = self.policy.mirror
        limit = self.config.max_batches_in_flight
        slot = limit is None or self.policy.stats().batches_in_flight < limit

        def fits(entry: Entry) -> bool:
            need = self.policy.need(entry)
            fits_kv = mirror.admissible([need], [entry.own_prompt_tokens]) == 1
            return fits_kv and self.rows_left() > 0 and slot

        overdue = []
        for rid, lane_name in self.policy.queued_ids().items():
            lane = self.config.lane(lane_name)
            entry = self.policy.lanes[lane_name].entries[rid]
            bound = None if lane.max_wait_s is None else lane.max_wait_s + lane.batch_timeout_s
            if bound is not None and self.now - entry.arrived_at > bound:
                overdue.append(entry)
        for entry in overdue:
            if fits(entry):
                blocked_older = [
                    o for o in overdue if o.arrived_at <= entry.arrived_at and not fits(o)
                ]
                assert blocked_older, f"{entry.request_id} overdue with room free"

    @rule(
        continuous=st.booleans(),
        batches=st.sampled_from([None, 1, 2]),
        prefill=st.sampled_from([None, 200, 2000]),
    )
    def engine_batching(self, continuous: bool, batches: int | None, prefill: int | None) -> None:
        self.config = replace(
            self.config,
            continuous_batching=continuous,
            max_batches_in_flight=batches,
            prefill_budget_tokens=prefill,
        )
        self.policy.reconfigure(self.config, self.now)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), used=st.integers(0, 500), cancel=st.booleans())
    def finish(self, data: st.DataObject, used: int, cancel: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.in_flight)))
        self.in_flight.discard(rid)
        if cancel:
            self.policy.cancel(rid, self.now)
            self.ends[rid] = "cancelled"
        else:
            self.policy.on_done(rid, self.now, used)
            self.ends[rid] = "done"

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), used=st.integers(1, 600))
    def progress(self, data: st.DataObject, used: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.in_flight)))
        self.policy.on_progress(rid, used, self.now)

    @rule(extra=st.integers(0, 50))
    def observe(self, extra: int) -> None:
        mirror = self.policy.mirror
        used = min(mirror.total_blocks, mirror.reserved_blocks + extra)
        self.policy.observe_kv(mirror.total_blocks - used, mirror.total_blocks, self.now)

    @rule(data=st.data())
    def cancel_queued(self, data: st.DataObject) -> None:
        queued = sorted(self.policy.queued_ids())
        if queued:
            rid = data.draw(st.sampled_from(queued))
            self.policy.cancel(rid, self.now)
            self.ends[rid] = "cancelled"

    @invariant()
    def one_state_each(self) -> None:
        queued = set(self.policy.queued_ids())
        flying = set(self.policy.in_flight_ids())
        # Pushed out by a tenant under its share: answered at the next decision round.
        answering = {d.request_id for d in self.policy._outbox if isinstance(d, Expired)}
        assert not queued & flying and not answering & (queued | flying)
        assert flying == self.in_flight
        assert not (queued | flying | answering) & set(self.ends)
        assert queued | flying | answering | set(self.ends) == self.admitted | {
            r for r, s in self.ends.items() if s == "rejected"
        }

    @invariant()
    def kv_is_conserved(self) -> None:
        mirror = self.policy.mirror
        held = mirror.held()
        primary = {r for r, t in self.policy.in_flight_ids().items() if t is Target.PRIMARY}
        assert set(held) == primary
        assert sum(held.values()) == mirror.reserved_blocks
        assert min([mirror.free_blocks, mirror.external_blocks, *held.values(), 0]) >= 0
        if mirror.forecast:
            # Reservations are sizes requests are predicted to reach; the pool's forecast peak
            # (never more than their sum) is what admission and the free count go by.
            peak = mirror.peak_blocks()
            room = max(0, mirror.total_blocks - mirror.external_blocks)
            assert peak <= mirror.reserved_blocks
            assert mirror.free_blocks == max(0, room - peak)
            assert mirror.owed_blocks == max(0, peak - room)
        else:
            assert (
                mirror.reserved_blocks + mirror.external_blocks + mirror.free_blocks
                == mirror.total_blocks + mirror.overcommit_blocks
            )

    @invariant()
    def running_sums_match_the_requests(self) -> None:
        # The queued work each lane's prediction divides, and the prompt tokens each lane has
        # in the engine unprefilled (its prefill share), are the requests' own sums.
        policy = self.policy
        for name, queue in policy.lanes.items():
            assert policy._queued_tokens[name] == sum(e.cost_tokens for e in queue.entries.values())
            # Fair shares: each tenant's queued work is its entries', in tag order.
            by_tenant: dict[str, list[Entry]] = {}
            for e in queue.entries.values():
                by_tenant.setdefault(e.tenant, []).append(e)
            assert queue._tenant_work == {
                t: sum(e.counted for e in v) for t, v in by_tenant.items()
            }
            for tenant, entries in queue._by_tenant.items():
                tags = [e.tag for e in entries.values()]
                assert tags == sorted(tags), f"{tenant}'s requests out of arrival order"
            assert policy._prefill_tokens[name] == sum(
                f.own_prompt_tokens
                for f in policy._in_flight.values()
                if f.lane == name and f.prefilling and f.target is Target.PRIMARY
            )
            rate = policy.drain[name].rate()
            assert rate is None or rate > 0

    @invariant()
    def every_counted_event_is_a_known_label(self) -> None:
        assert set(dict(self.policy.stats().counters)) <= {str(e) for e in PolicyEvent}

    @invariant()
    def queues_within_caps(self) -> None:
        for lane in self.policy.stats().lanes:
            assert lane.queued <= lane.max_queued


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
