"""`bench --engine-profile`'s own arithmetic: SLOs and time scales from the profile, the sidecar's
durations scaled, the simulator's outcomes read as the client's, agreement ratios, the report
(no server: what must be right to trust the emulated tables)."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler_svc.config import load_config
from scheduler_svc.core.config import PolicyConfig, to_mapping
from scheduler_svc.core.slo import SLO_FLOOR_S
from scheduler_svc.profiles import load_profile
from scheduler_svc.tools.bench import emulated as E  # noqa: N812
from scheduler_svc.tools.bench import emulated_run
from scheduler_svc.tools.bench import plan as P  # noqa: N812

H200 = load_profile("h200-8b-bf16")


def test_slos_come_from_the_profiles_unloaded_times_with_a_floor() -> None:
    slo = E.slo_for(H200)
    assert slo["cold"] == pytest.approx(5 * H200.prefill_s(2048))  # 280 ms
    assert slo["hot"] == slo["warm"] == SLO_FLOOR_S  # 5 x 9 ms and 5 x 18 ms are below it
    a100 = E.slo_for(load_profile("a100-8b-awq"))
    assert a100["cold"] > slo["cold"]  # a slower GPU, a looser target


def test_every_duration_of_the_policy_and_nothing_else_is_scaled() -> None:
    scaled = E.time_keys_scaled(to_mapping(PolicyConfig()), 20.0)
    hot = scaled["lanes"][0]
    assert hot == {
        "name": "hot",
        "queue_timeout_s": 2.0,
        "max_wait_s": 2.0,
        "batch_timeout_s": 1.0,
    }
    assert "queue_timeout_s" not in scaled["lanes"][2]  # cold has none: it stays none
    assert scaled["breaker"] == {"min_open_s": 20.0}
    assert scaled["admission"] == {"half_life_s": 200.0, "min_busy_s": 10.0}
    assert scaled["kv"] == {"stale_after_s": 100.0} and scaled["retry_after_s"] == 10.0
    assert "max_in_flight" not in scaled["kv"]  # left to follow the engine
    # The sidecar takes it as an override: only those keys change, lanes matched by name.
    cfg = load_config(None, {"policy": scaled}).policy_config()
    assert cfg.lanes[0].queue_timeout_s == 2.0 and cfg.lanes[0].max_batch == 16
    assert cfg.lanes[1].max_requeues == 2 and cfg.kv.max_in_flight == 16


def test_the_time_scale_holds_the_wall_token_rate_and_a_minimum() -> None:
    assert E.output_tokens_mean("chat") == 24
    assert E.scale_for("chat", 234.0) == 15.0  # 234 x 24 / 400, rounded up
    assert E.scale_for("long_docs", 5.8) == E.MIN_SCALE
    plan = E.EmulatedPlan("x", window_s=4.0, min_requests=300, max_window_s=60.0)
    assert E.window_for(plan, 200.0) == 4.0
    assert E.window_for(plan, 30.0) == 10.0
    assert E.window_for(plan, 1.0) == 60.0


def test_the_simulators_capacity_is_where_triton_alone_falls_behind() -> None:
    cap = E.capacity(H200, "chat", seed=0)
    below = E.simulated(H200, "chat", "triton", 0.5 * cap, 10.0, 0)
    above = E.simulated(H200, "chat", "triton", 1.5 * cap, 10.0, 0)
    done = [o.done_s for o in below.outcomes if o.done_s is not None]
    assert P.sustained_rate(done, 10.0) == pytest.approx(0.5 * cap, rel=0.1)
    served = [o.done_s for o in above.outcomes if o.done_s is not None]
    assert P.sustained_rate(served, 10.0) < 1.05 * cap


def test_the_simulators_outcomes_read_as_the_clients_and_agreement_divides_live_by_sim() -> None:
    run = E.simulated(H200, "mixed", "policy", 20.0, 4.0, seed=1)
    outcomes = E.sim_outcomes(run)
    assert len(outcomes) == len(run.outcomes)
    for mine, theirs in zip(outcomes, run.outcomes, strict=True):
        assert mine.lane == P.lane_of(theirs.request.prompt_tokens)
        assert mine.ttft_s == theirs.ttft_s
        assert mine.state == {"served": "ok", "rejected": "rejected_fast"}.get(
            theirs.state, "failed"
        )
    summary = E.sim_summary(run, 4.0, E.slo_for(H200))
    assert summary["rows_per_step"] == round(run.engine_totals.rows / run.engine_totals.steps, 2)
    live: dict[str, Any] = {
        **summary,
        "goodput_rps": summary["goodput_rps"] * 1.1,
        "lanes": {"hot": {**summary["lanes"]["hot"], "ttft_p99_ms": 0.0}},
    }
    ratios = E.agreement(summary, live)
    assert ratios["goodput"] == pytest.approx(1.1, abs=0.01) and ratios["rows_per_step"] == 1.0
    assert ratios["hot_ttft_p99_ms"] == 0.0 and ratios["cold_ttft_p50_ms"] is None


def test_live_times_become_emulated_and_the_send_lag_stays_wall() -> None:
    live = [P.Outcome("hot", 100, "ok", 2.0, 4.0, 8, send_lag_s=0.1)]
    (emulated,) = E.to_emulated(live, 20.0)
    assert (emulated.ttft_s, emulated.e2e_s, emulated.send_lag_s) == (0.1, 0.2, 0.1)


def test_the_report_marks_runs_with_overruns_invalid() -> None:
    summary = P.summarize(
        [P.Outcome("hot", 100, "ok", 0.02, 0.3, 8)],
        1.0,
        {"hot": 0.1, "warm": 0.1, "cold": 0.3},
        P.EngineDelta(steps=100, rows=900, overruns=2, paced_s=2.0, work_s=0.5),
    )
    assert summary["overrun_share"] == 0.02 and summary["engine_work_share"] == 0.25
    entry = {"sim": summary, "live": summary, "agreement": {}, "valid": False}
    row = {"mix": "chat", "load": 0.5, "rate_rps": 10.0, "targets": {"triton": entry}}
    lines = emulated_run.agreement_table([row])
    assert "2.0% (work 25.0%) INVALID" in lines[-1] and "| 9 / 9 |" in lines[-1]
    engine = emulated_run.engine_parameters("h200-8b-bf16", H200, 20.0)
    assert engine["time_scale"] == "20" and engine["max_tokens_in_paged_kv_cache"] == "830304"
    plan = E.EmulatedPlan("p", agree_points=(("mixed", 0.5), ("chat", 0.5)), slo_mixes=("chat",))
    assert emulated_run.mixes_in_order(plan) == ["mixed", "chat"]
    assert emulated_run.total_steps(plan) == 2 * 2 + 2 * (1 + plan.slo_iterations)
