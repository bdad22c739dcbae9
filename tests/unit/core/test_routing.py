"""Backend groups: precision routes, the speculative-decoding gate, the rollout's state machine,
the grouped backend's split of a batch, and the gate's n-gram overlap."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from scheduler_svc.config import SpecGateSection, load_config
from scheduler_svc.contracts.gate_result import check_age, read_result, write_result
from scheduler_svc.core.routing import (
    Phase,
    RolloutConfig,
    RouteClass,
    Router,
    RouteRule,
    SpecGateConfig,
    share_of,
)
from scheduler_svc.errors import ConfigError
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.groups import GroupedBackend, RolloutWatch
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.tools.specgate import judge, overlap

GROUPS = ("main", "candidate", "fp16", "spec")


def rollout(**changes: object) -> RolloutConfig:
    base = {"current": "main", "candidate": "candidate", "min_requests": 20, "window_s": 60.0}
    return RolloutConfig(**{**base, **changes})  # type: ignore[arg-type]


def feed(router: Router, group: str, n: int, now: float, ok: bool = True, ttft: float = 0.1):
    for _ in range(n):
        router.observe(group, ok, ttft if ok else None, now)


def test_routes_first_match_then_the_default() -> None:
    router = Router(
        GROUPS,
        routes=(
            RouteRule("fp16", lane="hot"),
            RouteRule("fp16", precision="fp16"),
            RouteRule("spec", tenant="batch-team"),
        ),
    )
    assert router.choose(RouteClass(lane="hot")) == "fp16"
    assert router.choose(RouteClass(lane="cold", precision="fp16")) == "fp16"
    assert router.choose(RouteClass(lane="cold", tenant="batch-team")) == "spec"
    assert router.choose(RouteClass(lane="warm")) == "main"
    assert router.precisions == frozenset({"fp16"})


def test_unknown_group_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown backend group 'nope'"):
        Router(GROUPS, routes=(RouteRule("nope"),))


def test_spec_gate_sends_the_gated_lane_only_while_passed() -> None:
    router = Router(GROUPS, spec_gate=SpecGateConfig("spec", "cold"))
    cold, warm = RouteClass(lane="cold"), RouteClass(lane="warm")
    assert router.choose(cold) == "main"
    router.set_gate(True)
    assert router.choose(cold) == "spec"
    assert router.choose(warm) == "main"
    router.set_gate(False)
    assert router.choose(cold) == "main"


def test_shares_are_sticky_and_close_to_the_weight() -> None:
    router = Router(GROUPS, rollout(weight=10))
    assert router.phase is Phase.CANARY
    sessions = [RouteClass(request_id=f"r{i}", session=f"s{i}") for i in range(5000)]
    chosen = [router.choose(c) for c in sessions]
    share = chosen.count("candidate") / len(chosen)
    assert 0.08 < share < 0.12
    # One conversation, many requests: always one side.
    again = [router.choose(RouteClass(request_id=f"x{i}", session="s7")) for i in range(50)]
    assert len(set(again)) == 1 and again[0] == chosen[7]
    # Raising the share keeps everyone already on the candidate there.
    router.set_weight(50, 0.0, "test")
    assert all(
        router.choose(c) == "candidate"
        for c, g in zip(sessions, chosen, strict=True)
        if g == "candidate"
    )
    # Without a session the tenant keeps requests together.
    tenant = {router.choose(RouteClass(request_id=f"y{i}", tenant="acme")) for i in range(50)}
    assert len(tenant) == 1
    assert share_of("t:acme") == share_of("t:acme")


def test_rollback_when_the_candidate_falls_behind_on_the_slo() -> None:
    router = Router(GROUPS, rollout(weight=10, attainment_margin=0.05))
    feed(router, "main", 100, 1.0)
    feed(router, "candidate", 19, 1.0, ttft=5.0)  # slow, but too few to judge
    assert router.tick(2.0) == []
    feed(router, "candidate", 10, 2.0, ttft=5.0)
    events = router.tick(3.0)
    assert [e.kind for e in events] == ["rollback"]
    assert "SLO attainment" in events[0].reason
    assert router.phase is Phase.ROLLED_BACK and router.weight == 0
    assert all(router.choose(RouteClass(session=f"s{i}")) == "main" for i in range(200))
    assert router.counts["rollback"] == 1


def test_rollback_on_errors_and_none_within_the_margin() -> None:
    # Errors also miss the SLO; a wide attainment margin leaves the error rate to decide.
    router = Router(GROUPS, rollout(weight=50, error_margin=0.02, attainment_margin=1.0))
    feed(router, "main", 100, 1.0)
    feed(router, "candidate", 99, 1.0)
    feed(router, "candidate", 1, 1.0, ok=False)  # 1 % errors: within 2 %
    assert router.tick(1.5) == []
    feed(router, "candidate", 5, 1.5, ok=False)
    events = router.tick(2.0)
    assert [e.kind for e in events] == ["rollback"] and "error rate" in events[0].reason


def test_old_samples_leave_the_window() -> None:
    router = Router(GROUPS, rollout(weight=10, window_s=60.0))
    feed(router, "main", 100, 0.0)
    feed(router, "candidate", 50, 0.0, ok=False)
    assert router.window("candidate", 30.0).errors == 50
    assert router.window("candidate", 100.0).requests == 0
    assert router.tick(100.0) == []  # nothing left to judge by


def test_hold_compares_with_the_baseline_then_drains() -> None:
    router = Router(GROUPS, rollout(weight=50, hold_s=3600.0))
    feed(router, "main", 100, 10.0)
    router.set_weight(100, 10.0, "test")
    assert router.phase is Phase.HOLD and router.baseline is not None
    assert router.taking_traffic("main")  # warm: ready to take traffic back
    assert router.choose(RouteClass(session="any")) == "candidate"
    feed(router, "candidate", 50, 20.0)
    assert router.tick(20.0) == []  # as good as the baseline
    events = router.tick(3610.0)
    assert [e.kind for e in events] == ["drained"]
    assert router.phase is Phase.DONE and not router.taking_traffic("main")
    assert router.shares() == {"main": 0, "candidate": 100, "fp16": 0, "spec": 0}
    with pytest.raises(ValueError, match="done"):
        router.set_weight(0, 3700.0, "test")


def test_rollback_during_the_hold_gives_traffic_back_at_once() -> None:
    router = Router(GROUPS, rollout(weight=50))
    feed(router, "main", 100, 10.0)
    router.set_weight(100, 10.0, "test")
    feed(router, "candidate", 40, 20.0, ok=False)
    assert [e.kind for e in router.tick(21.0)] == ["rollback"]
    assert router.choose(RouteClass(session="a")) == "main"


def test_advance_walks_the_steps() -> None:
    router = Router(GROUPS, rollout())
    assert [router.advance(0.0)[0].weight for _ in range(3)] == [10, 50, 100]
    with pytest.raises(ValueError, match="no step above 100"):
        router.advance(0.0)


def test_config_names_the_groups() -> None:
    cfg = load_config(
        None,
        {
            "groups": {"candidate": {"url": "127.0.0.1:9001"}},
            "rollout": {"candidate": "candidate", "weight": 10},
            "routes": [{"lane": "hot", "group": "candidate"}],
        },
    )
    assert cfg.router(0.0).shares() == {"main": 90, "candidate": 10}
    with pytest.raises(ConfigError, match="unknown backend group 'other'"):
        load_config(None, {"rollout": {"candidate": "other"}})
    with pytest.raises(ConfigError, match="not a group name"):
        load_config(None, {"groups": {"main": {"url": "127.0.0.1:9001"}}})
    with pytest.raises(ConfigError, match="steps"):
        load_config(
            None,
            {
                "groups": {"candidate": {"url": "127.0.0.1:9001"}},
                "rollout": {"candidate": "candidate", "steps": [50, 10]},
            },
        )


def row(rid: str, **route: str) -> GenerationInput:
    return GenerationInput(rid, (5, 6, 7), 3, 1, 2, route=RouteClass(request_id=rid, **route))


def test_a_batch_of_two_groups_goes_as_one_request_per_group() -> None:
    main, fp16 = ScriptedBackend(first_id=100), ScriptedBackend(first_id=500)
    router = Router(("main", "fp16"), routes=(RouteRule("fp16", precision="fp16"),))
    backend = GroupedBackend({"main": main, "fp16": fp16}, router)
    rows = [row("a"), row("b", precision="fp16"), row("c"), row("d", precision="fp16")]

    async def run() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        async with contextlib.aclosing(backend.stream_batch("batch", rows, None)) as answers:
            async for index, tokens in answers:
                out.setdefault(index, []).extend(tokens.ids)
        return out

    out = asyncio.run(run())
    assert [len(c.rows) for c in main.calls] == [2] and [len(c.rows) for c in fp16.calls] == [2]
    assert [r.request_id for r in fp16.calls[0].rows] == ["b", "d"]
    assert out == {0: [100, 101, 102], 1: [500, 501, 502], 2: [100, 101, 102], 3: [500, 501, 502]}
    assert backend.ended == {"main": {"ok": 2, "error": 0}, "fp16": {"ok": 2, "error": 0}}
    assert router.window("fp16", backend.clock()).attained == 2


def test_a_failing_group_is_counted_and_the_error_reaches_the_reader() -> None:
    main = ScriptedBackend()
    candidate = ScriptedBackend(fail_with=RuntimeError("engine gone"))
    router = Router(("main", "candidate"), RolloutConfig("main", "candidate", weight=100))
    backend = GroupedBackend({"main": main, "candidate": candidate}, router)

    async def run() -> None:
        async with contextlib.aclosing(backend.stream(row("a", session="s"))) as answers:
            async for _ in answers:
                pass

    with pytest.raises(RuntimeError, match="engine gone"):
        asyncio.run(run())
    assert backend.ended["candidate"] == {"ok": 0, "error": 1}
    assert router.window("candidate", backend.clock()).errors == 1
    assert backend.in_flight == {"main": 0, "candidate": 0}


def test_a_reader_who_leaves_is_neither_ok_nor_an_error() -> None:
    main = ScriptedBackend()
    router = Router(("main",))
    backend = GroupedBackend({"main": main}, router)

    async def run() -> None:
        async with contextlib.aclosing(backend.stream(row("a"))) as answers:
            async for _ in answers:
                break

    asyncio.run(run())
    assert backend.ended["main"] == {"ok": 0, "error": 0}
    assert backend.in_flight["main"] == 0


def test_overlap_of_identical_and_of_unrelated_outputs() -> None:
    same = [([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])]
    assert overlap(same) == {"1": 1.0, "2": 1.0, "3": 1.0, "4": 1.0}
    unrelated = [([7, 8, 9, 10, 11], [1, 2, 3, 4, 5])]
    assert overlap(unrelated) == {"1": 0.0, "2": 0.0, "3": 0.0, "4": 0.0}
    # The same tokens in another order share unigrams, not 4-grams: the gate fails it.
    shuffled = [([4, 3, 2, 1, 6, 5], [1, 2, 3, 4, 5, 6])]
    shares = overlap(shuffled)
    assert shares["1"] == 1.0 and shares["4"] == 0.0
    assert not judge(shuffled, 0.92, "d", "t").passed
    # Clipped counts: a draft repeating one right token gets it counted once.
    assert overlap([([1, 1, 1, 1], [1, 2, 3, 4])])["1"] == 0.25


def test_gate_result_round_trip_and_the_watch(tmp_path: Path) -> None:
    path = tmp_path / "gate.json"
    result = judge([([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])], 0.92, "a:1/draft", "a:1/target")
    assert result.passed and result.deciding == 1.0
    write_result(result, path)
    assert read_result(path) == result
    router = Router(("main", "spec"), spec_gate=SpecGateConfig("spec"))
    backend = GroupedBackend({"main": ScriptedBackend(), "spec": ScriptedBackend()}, router)
    views = []
    gate = SpecGateSection(group="spec", result_file=str(path))
    watch = RolloutWatch(backend, gate, views.append)
    watch.step()
    assert router.gate_passed and views[-1].gate_passed and views[-1].gate_overlap["4"] == 1.0
    # Measured too long ago: the gate closes (before, any age was trusted).
    stale = dataclasses.replace(result, at="2020-01-01T00:00:00+00:00")
    write_result(stale, path)
    watch.read_gate()
    assert not router.gate_passed
    with pytest.raises(ValueError, match=r"spec_gate\.max_age_s"):
        check_age(stale, gate.max_age_s, datetime.now(UTC))
    check_age(stale, None, datetime.now(UTC))  # null: any age
    write_result(result, path)
    watch.read_gate()
    assert router.gate_passed
    path.write_text(json.dumps({"passed": "yes"}))
    watch.read_gate()
    assert not router.gate_passed  # unreadable: the gate closes
    path.unlink()
    watch.read_gate()
    assert not router.gate_passed
