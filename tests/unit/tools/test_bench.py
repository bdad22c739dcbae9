"""The benchmark harness's own arithmetic: schedules, SLO accounting, failure classes, rates,
and the report built from them (no server: these are the parts that must be right to trust a
measured table)."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from scheduler_svc.core.slo import SLO_FLOOR_S
from scheduler_svc.tools.bench import live, plans, report, run
from scheduler_svc.tools.bench import plan as bp
from scheduler_svc.tools.bench.plan import EngineDelta, Outcome


def test_a_schedule_is_fixed_in_advance_by_its_seed() -> None:
    first = bp.schedule("mixed", 20.0, 30.0, seed=3)
    assert first == bp.schedule("mixed", 20.0, 30.0, seed=3)
    assert first != bp.schedule("mixed", 20.0, 30.0, seed=4)
    times = [r.arrival_s for r in first]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 30.0


def test_poisson_arrivals_come_at_the_asked_rate() -> None:
    requests = bp.schedule("chat", 50.0, 200.0, seed=0)
    assert len(requests) / 200.0 == pytest.approx(50.0, rel=0.05)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(requests)]
    # exponential gaps: the standard deviation equals the mean
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.1)


def test_the_burst_is_burstier_than_poisson() -> None:
    requests = bp.schedule("burst", 50.0, 200.0, seed=0)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(requests)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) > 1.5


def test_mixes_hold_the_source_documents_shapes() -> None:
    mixed = bp.schedule("mixed", 50.0, 100.0, seed=1)
    long = sum(r.prompt_tokens >= 1024 for r in mixed)
    assert long / len(mixed) == pytest.approx(0.25, abs=0.04)  # long:short = 1:3
    chat = bp.schedule("chat", 50.0, 100.0, seed=1)
    assert statistics.fmean(r.prompt_tokens for r in chat) == pytest.approx(128, rel=0.1)
    docs = [r.prompt_tokens for r in bp.schedule("long_docs", 20.0, 100.0, seed=1)]
    # Drawn around the document's 3,856 but cut at 4,000, inside the engine's 4,096-token
    # input limit: the mean lands near 3,500 (docs/benchmarks.md says so).
    assert max(docs) <= 4000
    assert 3400 < statistics.fmean(docs) < 3700
    spread = [r.prompt_tokens for r in bp.schedule("spread_8to1", 50.0, 100.0, seed=1)]
    assert max(spread) / min(spread) == 8.0


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        bp.schedule("chat", 0.0, 10.0, seed=0)


@pytest.mark.parametrize(
    ("elapsed", "tokens", "refusal", "state"),
    [
        (0.004, False, True, "rejected_fast"),
        (0.3, False, True, "rejected_queued"),
        (0.004, False, False, "failed"),  # a broken stream is never a clean refusal
        (2.0, True, True, "failed"),  # refused after tokens were sent: the stream broke
    ],
)
def test_failures_are_classified(elapsed: float, tokens: bool, refusal: bool, state: str) -> None:
    assert bp.classify_error(elapsed, tokens, refusal) == state


def test_slo_is_a_multiple_of_the_unloaded_median_with_a_floor() -> None:
    slo = bp.slo_ttft({"hot": 0.02, "cold": 0.4})
    assert slo["hot"] == SLO_FLOOR_S  # 5 x 20 ms is below the floor
    assert slo["cold"] == pytest.approx(2.0)
    assert slo["warm"] == pytest.approx(2.0)  # unmeasured: borrows the largest


def test_goodput_counts_only_served_requests_within_their_lanes_slo() -> None:
    slo = {"hot": 0.1, "warm": 0.5, "cold": 1.0}
    outcomes = [
        Outcome("hot", 100, "ok", ttft_s=0.05, e2e_s=0.2, tokens=10),
        Outcome("hot", 100, "ok", ttft_s=0.15, e2e_s=0.3, tokens=10),  # served, too late
        Outcome("cold", 2000, "ok", ttft_s=0.9, e2e_s=3.0, tokens=20),
        Outcome("cold", 2000, "rejected_fast", error="queue full"),
        Outcome("warm", 500, "failed", error="deadline"),
    ]
    s = bp.summarize(outcomes, 2.0, slo, EngineDelta(100.0, 75.0, [0.5, 1.0], [0.1, 0.3]))
    assert s["goodput_rps"] == 1.0  # two within SLO over 2 s
    assert s["throughput_rps"] == 1.5
    assert s["tokens_per_s"] == 20.0
    assert (s["ok"], s["rejected_fast"], s["rejected_queued"], s["failed"]) == (3, 1, 0, 1)
    assert s["lanes"]["hot"] == {
        "requests": 2,
        "ok": 2,
        "within_slo": 1,
        "ttft_p50_ms": 50.0,
        "ttft_p99_ms": 150.0,
        "e2e_p50_ms": 200.0,
        "e2e_p99_ms": 300.0,
        "tpot_p50_ms": 16.7,  # (e2e - ttft) / 9 tokens after the first
        "tpot_p99_ms": 16.7,
    }
    assert s["lanes"]["warm"]["ttft_p99_ms"] is None  # nothing served: no latency to report
    assert s["failed_or_late"] == 0.6  # 2 of 5 within their SLO: the document's burst figure
    assert s["refused_fast_share"] == 1.0  # the one refusal came within 50 ms
    assert s["padding_ratio"] == 0.25
    assert s["slot_occupancy"] == 0.75
    assert s["kv_fragmentation"] == 0.2


def test_sustained_rate_skips_the_ramp_and_the_tail() -> None:
    finished = [0.5, 1.0, 2.5, 3.0, 4.0, 5.0, 9.0, 10.0, 10.5]  # 10 s window: warm-up is 2 s
    assert bp.sustained_rate(finished, 10.0) == pytest.approx(6 / 8)


def test_lanes_follow_the_documents_bounds() -> None:
    assert [bp.lane_of(n) for n in (1, 255, 256, 1023, 1024)] == [
        "hot",
        "hot",
        "warm",
        "warm",
        "cold",
    ]


def test_plans_fit_their_time_budgets() -> None:
    """The plans' own arithmetic: offered windows plus calibration stay inside the budget the
    issue sets (quick < 3 min, full < 30 min), leaving room for draining between runs."""
    for plan, budget_s in ((plans.QUICK, 180), (plans.FULL, 1800)):
        offered = sum(
            (plan.burst_s if s.mix == "burst" else plan.duration_s) * len(plan.targets(s))
            for s in plan.steps
        )
        mixes = sum(len(plan.mixes(e)) for e in plan.engines)
        calibration = mixes * len(run.CALIBRATION_CONCURRENCY) * plan.calibrate_s
        assert offered + calibration < budget_s / 2


def _results() -> dict[str, Any]:
    slo = {"hot": 0.1, "warm": 0.5, "cold": 1.0}
    runs = []
    for load in (0.5, 1.2):
        for target, ttft in (("triton", 0.5), ("fifo", 0.4), ("policy", 0.05)):
            outcomes = [Outcome("hot", 100, "ok", ttft_s=ttft, e2e_s=ttft + 1, tokens=5)]
            summary = bp.summarize(outcomes, 1.0, slo, EngineDelta(10.0, 10.0, [0.5], []))
            runs.append(
                {
                    "engine": "inflight",
                    "mix": "chat",
                    "load": load,
                    "target": target,
                    "offered_rps": 1.0,
                    "rate_rps": 1.0,
                    "window_s": 1.0,
                    "summary": summary,
                    "ttft_ms": {"hot": [ttft * 1000], "warm": [], "cold": []},
                    "errors": [],
                }
            )
    overhead = {
        t: {"n": 1, "e2e_p50_ms": 1.0, "e2e_p99_ms": 2.0, "added_p50_ms": 0.0} for t in bp.TARGETS
    }
    return {
        "runs": runs,
        "calibration": {
            "inflight": {
                "unloaded_ttft_ms": {"hot": 20.0},
                "slo_ttft_ms": {"hot": 250.0},
                "capacity_rps": {"chat": 10.0},
            }
        },
        "overhead": overhead,
        "parameters": {
            "plan": "test",
            "seed": 0,
            "command": "scheduler-svc bench",
            "started_utc": "now",
            "wall_s": 60.0,
            "machine": {"cpus": 2, "platform": "test"},
            "slo": {"rule": "r", "fast_reject_s": 0.05},
        },
    }


def test_the_headline_compares_the_policy_with_triton_alone_at_the_top_load() -> None:
    results = _results()
    text = report.markdown(results)
    assert "## chat, inflight engine, 1.2× capacity" in text
    hot_p99 = next(line for line in text.splitlines() if line.startswith("| hot P99 TTFT"))
    assert hot_p99 == "| hot P99 TTFT | 500 ms | 400 ms | 50 ms | 0.1× |"
    goodput = next(line for line in text.splitlines() if line.startswith("| goodput"))
    assert goodput.endswith("| 0 | 0 | 1 | – |")  # a ratio over zero is not a number
    # Against the unloaded median measured in calibration (20 ms).
    assert "| hot P99 TTFT ÷ unloaded | 25× | 20× | 2.5× |  |" in text


def test_make_runs_timers_run_beside_the_slo_scaled_policy_where_the_plan_says() -> None:
    burst = bp.Step("inflight", "burst", bp.BURST_LOAD)
    assert plans.FULL.targets(burst) == (*bp.TARGETS, bp.DEFAULTS_TARGET)
    assert plans.FULL.targets(bp.Step("static", "mixed", 1.2)) == bp.TARGETS
    slo = {"hot": 0.25, "warm": 0.3, "cold": 1.5}
    defaults = live.sidecar_config("inflight", bp.DEFAULTS_TARGET, "http://m", slo)
    scaled = live.sidecar_config("inflight", "policy", "http://m", slo)
    assert "policy" not in defaults and defaults["queue"]["scheduler"] == "policy"
    assert scaled["policy"]["lanes"][0]["queue_timeout_s"] == 0.25


def test_the_budget_plan_runs_make_runs_sidecar_with_its_prefill_budget_changed() -> None:
    from scheduler_svc.config import SidecarConfig  # noqa: PLC0415
    from scheduler_svc.core.engine import Batching, EngineProfile  # noqa: PLC0415

    assert plans.BUDGET.targets(plans.BUDGET.steps[0]) == (
        "triton",
        bp.DEFAULTS_TARGET,
        bp.BUDGET_TARGET,
    )
    slo = {"hot": 0.25, "warm": 0.3, "cold": 1.5}
    # The CPU engine: 256-token steps, prompts chunked by equal_progress.
    engine = EngineProfile(
        Batching.INFLIGHT,
        16,
        max_num_sequences=16,
        max_num_tokens=256,
        context_chunking="equal_progress",
    )
    budgets = {}
    assert all(t in bp.TARGET_NAMES for t in plans.BUDGET.targets(plans.BUDGET.steps[0]))
    for target in (bp.DEFAULTS_TARGET, bp.BUDGET_TARGET):
        cfg = SidecarConfig.model_validate(live.sidecar_config("inflight", target, "http://m", slo))
        budgets[target] = cfg.policy_for_engine(cfg.policy_config(), engine).prefill_budget_tokens
    assert budgets == {
        bp.DEFAULTS_TARGET: None,  # equal_progress: the engine shares each step itself
        "policy_budget_2steps": 512,  # two of the engine's steps, pinned
    }


def test_the_guard_plan_runs_make_runs_sidecar_beside_the_same_without_its_row_guard() -> None:
    from scheduler_svc.config import SidecarConfig  # noqa: PLC0415
    from scheduler_svc.core.policy import PolicyScheduler  # noqa: PLC0415

    assert plans.GUARD.targets(plans.GUARD.steps[0]) == (
        "triton",
        bp.DEFAULTS_TARGET,
        bp.NO_GUARD_TARGET,
    )
    slo = {"hot": 0.25, "warm": 0.3, "cold": 1.5}
    configs = {
        target: SidecarConfig.model_validate(
            live.sidecar_config("inflight", target, "http://m", slo)
        ).policy_config()
        for target in (bp.DEFAULTS_TARGET, bp.NO_GUARD_TARGET)
    }
    # The same policy but for the first lane's share, which the guard keeps rows by.
    guarded, plain = configs[bp.DEFAULTS_TARGET], configs[bp.NO_GUARD_TARGET]
    assert replace(plain, lanes=guarded.lanes) == guarded
    assert replace(plain.lanes[0], share=guarded.lanes[0].share) == guarded.lanes[0]
    assert plain.lanes[1:] == guarded.lanes[1:]
    kept = {}
    for target, config in configs.items():
        policy = PolicyScheduler(replace(config, kv=replace(config.kv, max_in_flight=16)))
        policy._row_guard_at = 0.0  # a hot request just missed for want of a row
        kept[target] = policy.rows_kept
    assert kept == {bp.DEFAULTS_TARGET: 6, bp.NO_GUARD_TARGET: 0}


def test_the_prefill_plan_runs_make_runs_sidecar_beside_the_same_without_its_prefill_guard() -> (
    None
):
    from scheduler_svc.config import SidecarConfig  # noqa: PLC0415

    plan = plans.PLANS["prefill"]
    assert {plan.targets(step) for step in plan.steps} == {
        ("triton", bp.DEFAULTS_TARGET, bp.NO_PREFILL_GUARD_TARGET)
    }
    assert {step.mix for step in plan.steps} == {"mixed", "spread_8to1"}
    slo = {"hot": 0.25, "warm": 0.3, "cold": 1.5}
    guarded, plain = (
        SidecarConfig.model_validate(
            live.sidecar_config("inflight", target, "http://m", slo)
        ).policy_config()
        for target in (bp.DEFAULTS_TARGET, bp.NO_PREFILL_GUARD_TARGET)
    )
    # The same policy but for the guard.
    assert guarded.prefill_guard_slots == 1 and plain.prefill_guard_slots is None
    assert replace(plain, prefill_guard_slots=1) == guarded


def test_the_rows_plan_runs_make_runs_sidecar_beside_the_same_without_its_row_wait() -> None:
    from scheduler_svc.config import SidecarConfig  # noqa: PLC0415

    plan = plans.PLANS["rows"]
    assert {plan.targets(step) for step in plan.steps} == {
        ("triton", bp.DEFAULTS_TARGET, bp.NO_ROW_WAIT_TARGET)
    }
    assert {step.mix for step in plan.steps} == {"mixed", "spread_8to1", "burst"}
    slo = {"hot": 0.25, "warm": 0.3, "cold": 1.5}
    waits, plain = (
        SidecarConfig.model_validate(
            live.sidecar_config("inflight", target, "http://m", slo)
        ).policy_config()
        for target in (bp.DEFAULTS_TARGET, bp.NO_ROW_WAIT_TARGET)
    )
    # The same policy but for the row wait.
    assert waits.admission.row_wait and not plain.admission.row_wait
    assert replace(plain, admission=replace(plain.admission, row_wait=True)) == waits


def test_the_below_plan_runs_triton_alone_twice_beside_make_runs_sidecar() -> None:
    plan = plans.PLANS["below"]
    assert {plan.targets(step) for step in plan.steps} == {
        ("triton", bp.DEFAULTS_TARGET, bp.TRITON_AGAIN)
    }
    cells = {(step.mix, step.load) for step in plan.steps}
    assert cells == {(m, x) for m in ("mixed", "spread_8to1") for x in (0.3, 0.6, 0.9)}
    assert len(plan.steps) == 2 * len(cells)  # each cell twice, with fresh arrivals


def test_the_noise_floor_pairs_each_steps_runs_against_its_first_triton_alone_run() -> None:
    slo = {"hot": 0.25, "warm": 0.3, "cold": 1.5}
    runs = []
    # Two steps of the same cell: each ratio is against its own step's Triton alone run.
    targets = ("triton", bp.DEFAULTS_TARGET, bp.TRITON_AGAIN)
    for step, ttfts in enumerate(((0.10, 0.12, 0.09), (0.20, 0.15, 0.30))):
        for target, ttft in zip(targets, ttfts, strict=True):
            outcomes = [Outcome("hot", 100, "ok", ttft_s=ttft, e2e_s=ttft + 1, tokens=5)]
            runs.append(
                {
                    "engine": "inflight",
                    "mix": "mixed",
                    "load": 0.6,
                    "step": step,
                    "target": target,
                    "summary": bp.summarize(outcomes, 1.0, slo, EngineDelta(1.0, 1.0, [], [])),
                }
            )
    lines = report.noise_floor({"runs": runs})
    assert len(lines) == 4  # header, rule, one row per step
    assert "hot 100 ms: 1.2× / 0.9×" in lines[2] and "| 1.2× | 0.9× |" in lines[2]
    assert "hot 200 ms: 0.75× / 1.5×" in lines[3] and "| 0.75× | 1.5× |" in lines[3]
    # A run without its pair is left out, not compared with another step's.
    assert len(report.noise_floor({"runs": runs[:4]})) == 3


def test_the_deadline_plan_reports_issue_28s_targets_against_triton_alone() -> None:
    results = _results()
    for r in results["runs"]:
        r["target"] = {"policy": bp.DEFAULTS_TARGET}.get(r["target"], r["target"])
    results["parameters"]["plan"] = "deadline"
    results["slo_search"] = [
        {
            "engine": "inflight",
            "mix": "chat",
            "target": t,
            "capacity_rps": 10.0,
            "qps_at_slo": q,
            "trials": [],
        }
        for t, q in (("triton", 4.0), (bp.DEFAULTS_TARGET, 5.0))
    ]
    lines = report.markdown(results).splitlines()
    # Below saturation: each lane's P99 through make run's sidecar over Triton alone's.
    assert "| chat | 0.5× | 1 | hot 500 → 50 ms (0.1×) | 0.1× | 0 (0) |" in lines
    # QPS at the SLO, over Triton alone and as a share of the closed-loop capacity.
    assert "| inflight | chat | 10/s | 2.5× | 4/s | 5/s | 1.25× | 0.5 |" in lines
    # Overload: the hot tail over the unloaded median (20 ms), goodput over Triton alone's.
    overload = [line for line in lines if line.startswith("| chat 1.2× |")]
    assert overload[0].startswith("| chat 1.2× | Triton alone | 500 ms | 25× |")
    assert overload[1].startswith(
        "| chat 1.2× | sidecar policy, make run's timers | 50 ms | 2.5× |"
    )


def test_write_leaves_json_markdown_and_plots(tmp_path: Path) -> None:
    results = _results()
    report.write(results, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["runs"][0]["mix"] == "chat"
    assert (tmp_path / "results.md").read_text().startswith("# scheduler-svc bench (test)")
    assert sorted(results["plots"]) == ["cdf_inflight_chat.png", "load_inflight_chat.png"]
    for name in results["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_meets_the_p99_slo_only_with_every_lane_in_time_and_almost_nothing_refused() -> None:
    slo = {"hot": 0.1, "warm": 0.5, "cold": 1.0}
    engine = EngineDelta(100.0, 100.0)

    def summary(hot_ttfts: list[float], refused: int = 0) -> dict[str, Any]:
        outcomes = [Outcome("hot", 100, "ok", ttft_s=t, e2e_s=t + 0.1) for t in hot_ttfts]
        outcomes += [Outcome("warm", 500, "rejected_fast", error="full")] * refused
        return bp.summarize(outcomes, 1.0, slo, engine)

    assert bp.meets_slo(summary([0.05] * 200), slo)
    assert not bp.meets_slo(summary([0.05] * 98 + [0.2] * 2), slo)  # P99 over the hot SLO
    assert bp.meets_slo(summary([0.05] * 200, refused=2), slo)  # 2 of 202 refused: < 1 %
    assert not bp.meets_slo(summary([0.05] * 100, refused=2), slo)  # 2 of 102: > 1 %
    assert not bp.meets_slo(summary([]), slo)  # nothing offered, nothing shown


def test_a_run_whose_client_fell_behind_is_run_again_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The host stalls on the first two tries (the client sent 1 s late), not on the third.
    lags = iter([1.0, 0.5, 0.01])
    calls = []

    async def one_run(*args: Any) -> tuple[list[Outcome], EngineDelta]:
        lag = next(lags)
        calls.append(lag)
        done = Outcome("hot", 100, "ok", ttft_s=0.05, e2e_s=0.2, tokens=10, send_lag_s=lag)
        return [done], EngineDelta(10.0, 10.0, [0.5], [])

    monkeypatch.setattr(run, "_one_run", one_run)
    step = bp.Step("inflight", "chat", 1.0)
    slo = {"hot": 0.25, "warm": 0.5, "cold": 2.0}

    async def measured() -> dict[str, Any]:
        _, summary = await run._measured_run(None, step, "policy", [], plans.QUICK, 1.0, slo)  # type: ignore[arg-type]
        return summary

    summary = asyncio.run(measured())
    assert calls == [1.0, 0.5, 0.01]
    assert summary["reruns"] == 2 and summary["send_lag_p99_ms"] == 10.0
    # Never more than MAX_RERUNS repeats, even if every try stalls: the last is kept, counted.
    lags = iter([1.0] * 10)
    calls.clear()
    summary = asyncio.run(measured())
    assert len(calls) == bp.MAX_RERUNS + 1 and summary["reruns"] == bp.MAX_RERUNS
    assert summary["send_lag_p99_ms"] == 1000.0


def test_kv_pressure_runs_count_pauses_and_kv_in_use() -> None:
    slo = {"hot": 0.25, "warm": 0.5, "cold": 1.0}
    outcomes = [Outcome("hot", 100, "ok", ttft_s=0.05, e2e_s=1.0, tokens=40) for _ in range(4)]
    delta = EngineDelta(100.0, 100.0, [0.5], [], paused=2.0, kv_used=[0.25, 0.75])
    s = bp.summarize(outcomes, 2.0, slo, delta)
    assert (s["engine_pauses"], s["pauses_per_request"], s["kv_utilization"]) == (2.0, 0.5, 0.5)


def test_the_kv_plan_searches_triton_and_the_policy_on_both_kv_policies() -> None:
    plan = plans.KV
    assert plan.engines == ("kv_noevict", "kv_maxutil")
    searched = ("triton", "policy", bp.SUMMED_TARGET)
    assert [plan.slo_targets(e, m) for e, m in plan.slo_points] == [searched] * 2
    # the summed-reservations policy is the forecast policy with one setting off
    summed = live.sidecar_config(
        "kv_maxutil", bp.SUMMED_TARGET, "", {"hot": 1, "warm": 1, "cold": 1}
    )
    policy = live.sidecar_config("kv_maxutil", "policy", "", {"hot": 1, "warm": 1, "cold": 1})
    assert summed["policy"].pop("kv") == {"forecast_peak": False} and summed == policy
    assert all(plan.mixes(e) == ["kv_pressure"] for e in plan.engines)
    assert "kv_pressure" in bp.ENDS_ITSELF and plan.warmup_requests > 0
    # Generous max_tokens go out as they are; other mixes are cut to their drawn output.
    sim = bp.schedule("kv_pressure", 5.0, 4.0, 0)
    prompts = live.Prompts()
    assert {r.max_tokens for r in live.materialize(sim, prompts, "t", generous=True)} == {512}
    assert [r.max_tokens for r in live.materialize(sim, prompts, "t")] == [
        s.output_tokens for s in sim
    ]


def test_the_kv_table_compares_with_triton_alone_on_no_evict_and_on_the_same_engine() -> None:
    def row(engine: str, target: str, qps: float, pauses: float) -> dict[str, Any]:
        outcomes = [Outcome("hot", 100, "ok", ttft_s=0.1, e2e_s=1.0, tokens=40)] * 10
        delta = EngineDelta(1.0, 1.0, [0.5], [], paused=pauses, kv_used=[0.9])
        at = bp.summarize(outcomes, 1.0, {"hot": 0.25, "warm": 1, "cold": 1}, delta)
        return {
            "engine": engine,
            "mix": "kv_pressure",
            "target": target,
            "qps_at_slo": qps,
            "at_slo": at,
            "trials": [{}] * 4,
        }

    results = {
        "slo_search": [
            row("kv_noevict", "triton", 1.0, 0.0),
            row("kv_noevict", "policy", 1.1, 0.0),
            row("kv_maxutil", "triton", 2.0, 3.0),
            row("kv_maxutil", "policy", 3.0, 0.0),
        ]
    }
    lines = report.kv_pressure(results)
    best = next(line for line in lines if line.startswith("| max_utilization | sidecar policy"))
    assert "| 3/s | 3× | 1.5× |" in best
    paused = next(line for line in lines if line.startswith("| max_utilization | Triton alone"))
    assert "| 3 | 30.0% |" in paused
