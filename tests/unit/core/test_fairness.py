"""Work-weighted fair sharing between tenants (core/bucketing.py tags, core/policy.py order,
admission and push-out): a noisy tenant does not starve a quiet one."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core import config as core_config
from scheduler_svc.core.bucketing import Entry, LaneQueue
from scheduler_svc.core.config import (
    AdmissionConfig,
    FairnessConfig,
    KvConfig,
    PolicyConfig,
    default_lanes,
)
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.types import (
    Admitted,
    Dispatch,
    Expired,
    ExpireReason,
    Rejected,
    RejectReason,
    Request,
)
from scheduler_svc.sim.simulate import simulate_requests
from scheduler_svc.tools.bench import fairness as fb


def req(rid: str, prompt: int, tenant: str, max_tokens: int = 16) -> Request:
    return Request(rid, prompt_tokens=prompt, max_tokens=max_tokens, tenant=tenant)


def _engine(rows: int, fairness: FairnessConfig | None = None, **kw: object) -> PolicyScheduler:
    """An in-flight engine running `rows` sequences (deadline order)."""
    config = PolicyConfig(
        kv=KvConfig(total_blocks=100_000, max_in_flight=rows),
        continuous_batching=True,
        fairness=fairness or FairnessConfig(),
        **kw,  # type: ignore[arg-type]
    )
    return PolicyScheduler(config)


def _serve(policy: PolicyScheduler, now: float, rounds: int, step: float = 0.01) -> list[str]:
    """Run `rounds` decision rounds, each request done (16 tokens) in the round after it
    started; the start order."""
    order: list[str] = []
    running: list[str] = []
    for _ in range(rounds):
        for rid in running:
            policy.on_done(rid, now, 16)
        decisions = policy.schedule(now)
        running = [d.request_id for d in decisions if isinstance(d, Dispatch)]
        order += running
        now += step
    return order


def test_a_quiet_tenant_passes_a_noisy_tenants_backlog_in_the_same_lane() -> None:
    policy = _engine(1)
    for i in range(40):
        policy.submit(req(f"n{i}", 100, "noisy"), 0.0)
    policy.submit(req("q0", 100, "quiet"), 0.001)
    order = _serve(policy, 0.01, 4)
    # n0 was queued first; the quiet tenant's request goes next, not after 39 more.
    assert order[:2] == ["n0", "q0"]
    # Without fairness the lane is first come, first served.
    fifo = _engine(1, FairnessConfig(enabled=False))
    for i in range(40):
        fifo.submit(req(f"n{i}", 100, "noisy"), 0.0)
    fifo.submit(req("q0", 100, "quiet"), 0.001)
    assert "q0" not in _serve(fifo, 0.01, 4)


def test_a_tenants_work_counts_only_the_prompt_tokens_the_engine_must_prefill() -> None:
    # Two tenants backlogged with 2,100-token prompts; the engine holds 2,000 of one tenant's
    # cached (its shared history): that tenant's requests cost the engine 100 prompt tokens
    # each, so three of them go in the time one of the other's does.
    policy = _engine(1)
    for i in range(3):
        policy.submit(req(f"w{i}", 2100, "whole"), 0.0)
        policy.submit(replace(req(f"c{i}", 2100, "cached"), cached_tokens=2000), 0.0)
    assert _serve(policy, 0.01, 6)[:5] == ["w0", "c0", "c1", "c2", "w1"]


def test_a_request_nearly_out_of_slack_goes_first_unless_its_tenant_is_ahead() -> None:
    """Deadline feasibility first: within a lane the request due first passes the fair head
    where its tenant is at most one of its requests ahead in fair order, at once where it is
    its tenant's only one queued there (the tenant is not backlogged), else once under a
    quarter of its target is left (not before); a tenant further ahead (served more) waits its
    turn."""
    for now, backlog, first in ((0.15, True, "b1"), (0.2, True, "a1"), (0.15, False, "a1")):
        policy = _engine(1)
        policy.submit(req("run", 100, "a"), 0.0)
        policy.schedule(0.0)  # a's tag 0; the lane's virtual time 0
        policy.submit(req("a1", 100, "a"), 0.0)  # a's second: tag 116, due at 0.25 s
        if backlog:
            policy.submit(req("a9", 100, "a"), 0.06)  # a's third: tag 232, due at 0.31 s
        policy.submit(req("b1", 100, "b"), 0.1)  # b's first: tag 0 (the fair head), due at 0.35
        policy.on_done("run", now, 16)
        assert [d.request_id for d in policy.schedule(now) if isinstance(d, Dispatch)] == [first]
    policy = _engine(1)
    policy.submit(req("run", 100, "a"), 0.0)
    policy.schedule(0.0)
    policy.submit(req("a1", 100, "a"), 0.0)  # tag 116, due at 0.25 s
    late = replace(req("a2", 100, "a"), queue_deadline=0.2)  # tag 232: the client's deadline
    policy.submit(late, 0.0)
    policy.submit(req("b1", 100, "b"), 0.1)  # tag 0, due at 0.35 s
    policy.on_done("run", 0.17, 16)
    decisions = policy.schedule(0.17)  # a2 has 30 ms left, but a is two requests ahead of b1
    assert [d.request_id for d in decisions if isinstance(d, Dispatch)] == ["b1"]


def test_an_expired_request_gives_its_turn_to_its_tenants_later_ones() -> None:
    """A request that leaves unserved gives its work back as if it had not come: its tenant's
    later queued requests take the tags they would have had without it, so a tenant whose
    requests expire one by one does not lose each one's turn again in the next."""
    policy = _engine(1)
    policy.submit(req("run", 100, "a"), 0.0)
    policy.schedule(0.0)
    policy.submit(req("a1", 100, "a"), 0.0)  # tag 116, due at 0.25 s: it will expire
    policy.submit(req("a2", 100, "a"), 0.05)  # tag 232, due at 0.30 s
    policy.submit(req("b1", 100, "b"), 0.1)  # tag 0, due at 0.35 s
    queue = policy.lanes["hot"]
    assert [queue.entries[r].tag for r in ("a1", "a2")] == [116, 232]
    policy.on_done("run", 0.26, 16)
    decisions = policy.schedule(0.26)
    # a1 expired; a2 now stands where a1 stood (tag 116: one request ahead of b1), and with
    # 40 ms left it goes first. Before, it kept tag 232 and waited behind b1 to expire too.
    assert [(d.request_id, type(d).__name__) for d in decisions] == [
        ("a1", "Expired"),
        ("a2", "Dispatch"),
    ]
    # A moved tag never drops below the lane's virtual time now: a tenant's requests left
    # behind it would pass every other tenant's arrival since.
    lane = LaneQueue(default_lanes()[0])
    entries = [
        Entry(req(f"e{i}", 100, "t"), i, 0.0, 0.0, predicted_output=16, max_tokens=16)
        for i in range(3)
    ]
    lane.add(entries[0])
    lane.take([entries[0]])
    lane.virtual_time = 500.0
    lane.add(entries[1])  # tag 500 (the virtual time), not 116
    lane.add(entries[2])  # tag 616
    lane.virtual_time = 550.0
    assert lane.drop(entries[1]) == [entries[2]]
    assert entries[2].tag == 550.0  # not 500, where e1 stood
    assert lane.start_tag("t") == 666.0


def test_a_narrowed_tenant_shares_its_roots_place() -> None:
    policy = _engine(1)
    for i in range(20):
        policy.submit(req(f"n{i}", 100, f"noisy/{i}"), 0.0)  # a fresh sub-tenant each time
    policy.submit(req("q0", 100, "quiet"), 0.001)
    assert _serve(policy, 0.01, 3)[:2] == ["n0", "q0"]


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_backlogged_tenants_share_by_work_and_weight(weights: tuple[float, float]) -> None:
    """Different request sizes, equal or 2:1 weights: served work follows the weights (a
    patient lane: nothing expires or runs short of slack in the 2 s served)."""
    fairness = FairnessConfig(weights=(("big", weights[0]), ("small", weights[1])))
    patient = tuple(replace(lane, ttft_target_s=3600.0) for lane in default_lanes())
    policy = _engine(1, fairness, lanes=patient)
    sizes = {"big": 200, "small": 60}
    for i in range(300):
        for tenant, prompt in sizes.items():
            policy.submit(req(f"{tenant}{i}", prompt, tenant), 0.0)
    order = _serve(policy, 0.01, 200)
    work = Counter({t: 0 for t in sizes})
    for rid in order:
        tenant = rid.rstrip("0123456789")
        work[tenant] += sizes[tenant] + 16
    ratio = work["big"] / work["small"]
    assert ratio == pytest.approx(weights[0] / weights[1], rel=0.1)


@settings(max_examples=60, deadline=None)
@given(
    tenants=st.lists(
        st.tuples(st.floats(0.25, 4.0), st.lists(st.integers(1, 500), min_size=1, max_size=30)),
        min_size=2,
        max_size=4,
    )
)
def test_the_service_difference_between_backlogged_tenants_is_bounded(
    tenants: list[tuple[float, list[int]]],
) -> None:
    """Start-time fair queueing's bound: while tenants i and j are both backlogged,
    |W_i / w_i - W_j / w_j| <= c_i / w_i + c_j / w_j (W: work served, c: the largest request)."""
    names = [f"t{k}" for k in range(len(tenants))]
    fairness = FairnessConfig(
        weights=tuple((n, w) for n, (w, _) in zip(names, tenants, strict=True))
    )
    lane = LaneQueue(replace(default_lanes()[0], max_queued=1 << 20), fairness)
    seq = 0
    for name, (_, sizes) in zip(names, tenants, strict=True):
        for size in sizes:
            lane.add(Entry(req(f"{name}-{seq}", size, name, max_tokens=1), seq, 0.0, 0.0, 0, 1))
            seq += 1
    weight = dict(fairness.weights)
    largest = {n: max(s) + 0 for n, (_, s) in zip(names, tenants, strict=True)}
    served = dict.fromkeys(names, 0.0)
    while lane.entries:
        entry = min(lane.entries.values(), key=lambda e: (e.tag, e.seq))
        lane.take([entry])
        served[entry.tenant] += entry.cost_tokens
        backlogged = {e.tenant for e in lane.entries.values()}
        for i in backlogged:
            for j in backlogged:
                gap = served[i] / weight[i] - served[j] / weight[j]
                assert gap <= largest[i] / weight[i] + largest[j] / weight[j] + 1e-6


def _learnt(policy: PolicyScheduler, now: float) -> float:
    """Run enough work through that the engine's drain rate is known; the time after."""
    for i in range(6):
        policy.submit(req(f"warmup{i}", 100, "warmup"), now)
    running: list[str] = []
    for _ in range(8):
        for rid in running:
            policy.on_done(rid, now, 16)
        running = [d.request_id for d in policy.schedule(now) if isinstance(d, Dispatch)]
        now += 0.1
    for rid in running:
        policy.on_done(rid, now, 16)
    assert policy.pooled_drain.rate() is not None
    return now


def test_admission_refuses_by_the_tenants_own_place_in_fair_order() -> None:
    admission = AdmissionConfig(min_busy_s=0.05, min_completions=1)
    policy = _engine(1, admission=admission)
    now = _learnt(policy, 0.0)
    policy.submit(req("run", 100, "noisy"), now)
    policy.schedule(now)  # the engine's one sequence is busy from here
    verdicts = [policy.submit(req(f"n{i}", 100, "noisy"), now) for i in range(200)]
    refused = [v for v in verdicts if isinstance(v, Rejected)]
    assert refused and all(v.reason is RejectReason.PREDICTED_LATE for v in refused)
    assert "fair order" in refused[0].message and refused[0].retry_after_s > 0
    # The quiet tenant stands at the front of the fair order: admitted, predicted no wait.
    assert isinstance(policy.submit(req("q0", 100, "quiet"), now), Admitted)
    # Without fairness it is refused by the lane's whole queue, like the noisy tenant.
    fifo = _engine(1, FairnessConfig(enabled=False), admission=admission)
    now = _learnt(fifo, 0.0)
    fifo.submit(req("run", 100, "noisy"), now)
    fifo.schedule(now)
    for i in range(200):
        fifo.submit(req(f"n{i}", 100, "noisy"), now)
    assert isinstance(fifo.submit(req("q0", 100, "quiet"), now), Rejected)


def test_the_predicted_wait_counts_a_tenant_between_two_of_its_requests() -> None:
    """A tenant with nothing queued but served lately (its finish tag ahead of the virtual
    time) sends its next request at that tag: what it gets from there up to an arrival's tag
    is counted before the arrival. A tenant whose finish tag the lane has passed counts 0, and
    so does every tenant where nothing is queued (the arrival goes as soon as it can)."""
    lane = LaneQueue(default_lanes()[0])

    def entry(rid: str, tenant: str, seq: int) -> Entry:
        return Entry(req(rid, 84, tenant), seq, 0.0, 0.0, predicted_output=16, max_tokens=16)

    a0, b0, b1 = entry("a0", "a", 0), entry("b0", "b", 1), entry("b1", "b", 2)
    for e in (a0, b0, b1):
        lane.add(e)  # a: tag 0; b: tags 0 and 100
    lane.take([a0])  # a is between requests: nothing queued, its finish tag 100
    # c's first request starts at the virtual time 0: nothing of a's or b's is before it.
    assert lane.work_before("c", lane.start_tag("c")) == 0
    # An arrival of b at tag 200 waits for b's queued 200 and a's next (tags 100..200): 300.
    assert lane.work_before("b", 200.0) == 300
    lane.take([b0, b1])  # the virtual time reaches a's finish tag: a counts no more
    assert lane.virtual_time == 100.0
    # b is between requests now (finish 200); an arrival of c at tag 300 behind a queued
    # request of c's counts c's own 100 and b's next (tags 200..300); a's nothing.
    c0 = entry("c0", "c", 3)
    lane.add(c0)
    assert lane.work_before("c", 300.0) == 200
    # With nothing queued in the lane an arrival starts when the engine has room: 0.
    lane.take([c0])
    assert lane.work_before("c", 300.0) == 0


def test_a_full_lane_pushes_out_the_newest_request_of_the_tenant_over_its_share() -> None:
    lanes = tuple(replace(lane, max_queued=4) for lane in default_lanes())
    policy = _engine(1, admission=AdmissionConfig(enabled=False), lanes=lanes)
    policy.submit(req("run", 100, "noisy"), 0.0)
    policy.schedule(0.0)
    for i in range(4):
        assert isinstance(policy.submit(req(f"n{i}", 100, "noisy"), 0.0), Admitted)
    # The noisy tenant's own arrival finds its lane full: refused as before.
    full = policy.submit(req("n4", 100, "noisy"), 0.0)
    assert isinstance(full, Rejected) and full.reason is RejectReason.QUEUE_FULL
    # A quiet tenant's arrival takes the place of the noisy tenant's newest request.
    assert isinstance(policy.submit(req("q0", 100, "quiet"), 0.01), Admitted)
    [pushed] = [d for d in policy.schedule(0.01) if isinstance(d, Expired)]
    assert (pushed.request_id, pushed.reason) == ("n3", ExpireReason.PUSHED_OUT)
    assert pushed.retry_after_s is not None and pushed.retry_after_s > 0
    counters = dict(policy.stats().counters)
    assert counters["pushed_out"] == 1 and counters["rejected_queue_full"] == 1
    # Pushed out, the noisy tenant gave its place back: a second quiet arrival is not ahead
    # of a tenant that is not over its share any more than the quiet one.
    assert sorted(policy.queued_ids()) == ["n0", "n1", "n2", "q0"]
    # Without fairness the lane's cap refuses the quiet arrival.
    fifo = _engine(
        1, FairnessConfig(enabled=False), admission=AdmissionConfig(enabled=False), lanes=lanes
    )
    fifo.submit(req("run", 100, "noisy"), 0.0)
    fifo.schedule(0.0)
    for i in range(4):
        fifo.submit(req(f"n{i}", 100, "noisy"), 0.0)
    assert isinstance(fifo.submit(req("q0", 100, "quiet"), 0.01), Rejected)


def test_weights_are_read_from_a_mapping_and_checked() -> None:
    config = core_config.from_mapping({"fairness": {"weights": {"gold": 4, "bronze": 0.5}}})
    assert config.fairness.weights == (("bronze", 0.5), ("gold", 4.0))
    assert core_config.from_mapping(core_config.to_mapping(config)) == config
    for bad, field in (
        ({"weights": ["gold"]}, "fairness.weights"),
        ({"weights": {"gold": 0}}, "fairness.weights.gold"),
        ({"weights": {"gold": "x"}}, "fairness.weights.gold"),
        ({"default_weight": -1}, "fairness.default_weight"),
    ):
        with pytest.raises(ValueError, match=field):
            core_config.from_mapping({"fairness": bad})


def test_the_fairness_bench_offers_each_tenant_its_rate_and_reads_shares() -> None:
    scenario = next(s for s in fb.SCENARIOS if s.name == "weighted")
    requests = fb.arrivals(scenario, capacity_rps=20.0, seed=0, duration_s=30.0)
    assert requests == fb.arrivals(scenario, capacity_rps=20.0, seed=0, duration_s=30.0)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    counts = Counter(r.tenant for r in requests)
    for load in scenario.tenants:  # Poisson at load x capacity over 30 s: 600 expected
        assert counts[load.tenant] == pytest.approx(load.load * 20.0 * 30.0, rel=0.15)
    assert scenario.weights() == {"gold": 2.0}
    ended = [
        fb.Ended("gold", True, "ok", 0.1, 200),
        fb.Ended("gold", False, "pushed_out", None, 0),
        fb.Ended("bronze", True, "ok", 0.3, 100),
        fb.Ended("bronze", False, "predicted_late", None, 0),
    ]
    table = fb.tenant_table(scenario, ended, duration_s=10.0, slo_s=0.25)
    gold, bronze = table["gold"], table["bronze"]
    assert (gold.offered, gold.served, gold.refused) == (2, 1, {"pushed_out": 1})
    assert gold.share == pytest.approx(2 / 3) and gold.fair_share == pytest.approx(2 / 3)
    assert bronze.served_in_slo_frac == 0.0 and bronze.served_frac == 0.5
    assert fb.share_error(table) == pytest.approx(0.0)
    assert fb.goodput(table, 10.0) == pytest.approx(0.1)  # bronze's 300 ms is past the SLO
    assert fb.refusal_reason("lane 'hot' ... a tenant under its fair share arrived") == "pushed_out"
    assert fb.refusal_reason("lane 'hot' would start it in about 300 ms") == "predicted_late"


def test_the_simulator_runs_the_bench_arrivals_with_fairness_on_and_off() -> None:
    scenario = next(s for s in fb.SCENARIOS if s.name == "two_sizes")
    requests = fb.arrivals(scenario, capacity_rps=97.0, seed=0, duration_s=8.0)
    shares = {}
    for enabled in (False, True):
        result = simulate_requests("two", requests, 8.0, fairness=FairnessConfig(enabled=enabled))
        ended = [
            fb.Ended(
                o.request.tenant,
                o.state == "served",
                o.state,
                o.ttft_s,
                o.request.prompt_tokens + o.request.output_tokens,
            )
            for o in result.outcomes
        ]
        table = fb.tenant_table(scenario, ended, 8.0, result.slo_s["hot"])
        shares[enabled] = fb.share_error(table)
    # First come, first served gives the large prompts most of the work; fair order evens it.
    assert shares[False] is not None and shares[True] is not None
    assert shares[True] < 0.15 < shares[False]


def _dispatched(decisions: list[object]) -> list[str]:
    return [d.request_id for d in decisions if isinstance(d, Dispatch)]


def test_the_last_row_is_kept_for_a_light_tenant_while_another_holds_the_rest() -> None:
    policy = _engine(4)
    for i in range(20):
        policy.submit(req(f"n{i}", 60, "noisy"), 0.0)
    assert len(_dispatched(policy.schedule(0.0))) == 4  # no other tenant seen: every row
    for i in range(4):
        policy.on_done(f"n{i}", 0.05, 16)
    policy.submit(req("q0", 10, "quiet"), 0.05)
    # The quiet tenant heads fair order; the noisy one, offering far more than its half,
    # takes its share of the 4 rows but not the last: the quiet tenant offers under half of
    # its share of what the engine took lately. (With its request running, its share of two
    # rows leaves one to keep.)
    assert _dispatched(policy.schedule(0.05)) == ["q0", "n4", "n5"]
    assert policy.rows_kept_for_light("noisy") == 1 and policy.rows_kept_for_light("quiet") == 0
    policy.submit(req("q1", 10, "quiet"), 0.06)
    assert _dispatched(policy.schedule(0.06)) == ["q1"]  # its second, while its first runs
    policy.on_done("q0", 0.1, 16)
    policy.on_done("q1", 0.1, 16)
    # Nothing of the quiet tenant's running: one row kept, the noisy one takes the other.
    assert policy.rows_kept_for_light("noisy") == 1
    assert _dispatched(policy.schedule(0.1)) == ["n6"]
    policy.submit(req("q2", 10, "quiet"), 0.2)
    assert _dispatched(policy.schedule(0.2)) == ["q2"]  # no wait for a row to free
    # Once the quiet tenant has not been seen for a half-life, the row is the noisy one's.
    half_life = policy.config.admission.half_life_s
    policy.on_done("q2", 0.3, 16)
    policy.submit(req("n20", 60, "noisy"), 0.3 + half_life)
    # (n4-n6 still hold three rows; the rest of its backlog expired meanwhile.)
    assert _dispatched(policy.schedule(0.3 + half_life)) == ["n20"]  # the last row
    assert policy.rows_kept_for_light("noisy") == 0


def test_the_rows_kept_grow_with_the_light_tenants_running_requests() -> None:
    """A burst of the quiet tenant's: one row kept per request it has running, plus one,
    short of its share of the rows (4 of 8 here)."""
    policy = _engine(8)
    for i in range(30):
        policy.submit(req(f"n{i}", 60, "noisy"), 0.0)
    assert len(_dispatched(policy.schedule(0.0))) == 8
    for i in range(8):
        policy.on_done(f"n{i}", 0.05, 16)
    policy.submit(req("q0", 10, "quiet"), 0.05)
    # q0 first; the noisy one takes rows until two are left: the quiet one has one running.
    assert _dispatched(policy.schedule(0.05)) == ["q0", "n8", "n9", "n10", "n11", "n12"]
    assert policy.rows_kept_for_light("noisy") == 2
    for k in (1, 2):
        policy.submit(req(f"q{k}", 10, "quiet"), 0.06)
    assert _dispatched(policy.schedule(0.06)) == ["q1", "q2"]  # the burst finds its rows
    assert policy.rows_kept_for_light("noisy") == 1  # three running: one row to its share
    policy.on_done("n8", 0.07, 16)
    assert _dispatched(policy.schedule(0.07)) == []  # the row that freed is kept


def test_a_backlogged_tenant_of_small_requests_is_not_light() -> None:
    """It offers little beside tenants of large requests, but more than its share of what the
    engine takes: no row is kept for it."""
    policy = _engine(4)
    for i in range(10):
        policy.submit(req(f"big{i}", 2000, "big", max_tokens=64), 0.0)
        policy.submit(req(f"small{i}", 60, "small"), 0.0)
    assert len(_dispatched(policy.schedule(0.0))) == 4
    for tenant in ("big", "small"):
        assert policy.rows_kept_for_light(tenant) == 0


def test_tenants_of_like_demand_take_every_row() -> None:
    """Whatever rows each holds at the moment, no tenant is light when both offer alike."""
    policy = _engine(4)
    for i in range(6):
        policy.submit(req(f"a{i}", 60, "a"), 0.0)
        policy.submit(req(f"b{i}", 60, "b"), 0.0)
    assert len(_dispatched(policy.schedule(0.0))) == 4


def test_with_fairness_off_no_row_is_kept() -> None:
    """A flood beside a quiet tenant with fairness off: the flood takes every row."""
    policy = _engine(4, FairnessConfig(enabled=False))
    policy.submit(req("q0", 10, "quiet"), 0.0)
    for i in range(20):
        policy.submit(req(f"n{i}", 60, "noisy"), 0.1)
    assert len(_dispatched(policy.schedule(0.1))) == 4
    assert policy.rows_kept_for_light("noisy") == 0


def test_a_light_tenants_request_takes_the_kept_row_when_an_urgent_one_passed_it() -> None:
    """The noisy tenant's request due first, nearly out of slack, passes the quiet tenant's at
    the head of fair order; the last row is kept from it, and the quiet one takes it."""
    policy = _engine(4)
    for i in range(20):
        policy.submit(req(f"n{i}", 60, "noisy"), 0.0)
    assert len(_dispatched(policy.schedule(0.0))) == 4
    for i in range(4):
        policy.on_done(f"n{i}", 0.05, 16)
    assert _dispatched(policy.schedule(0.05)) == ["n4", "n5", "n6", "n7"]  # quiet unseen yet
    policy.submit(req("q0", 10, "quiet"), 0.06)
    policy.on_done("n4", 0.1, 16)
    assert _dispatched(policy.schedule(0.1)) == ["q0"]
    policy.on_done("n5", 0.12, 16)
    assert _dispatched(policy.schedule(0.12)) == []  # the last row, kept
    policy.submit(req("q1", 10, "quiet"), 0.2)
    head = policy._earliest(set(policy.lanes))  # n8 is due first and passes q1
    assert head is not None and head[1].request_id == "n8"
    assert _dispatched(policy.schedule(0.2)) == ["q1"]
