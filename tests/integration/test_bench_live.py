"""`scheduler-svc bench --quick` against the real stack: every figure comes from a measurement.

One quick-sized run (the bench's own plan): a real Triton with both engine builds, real
sidecars (FIFO and policy), open-loop clients. What is checked is that the harness measured what
it reports, not how fast anything was (that is the benchmark's job, not a test's).
"""

from __future__ import annotations

import json
from pathlib import Path

from scheduler_svc.tools.bench import plan as bp
from scheduler_svc.tools.bench import plans, run


def test_a_quick_run_fills_every_column_from_measurements(tmp_path: Path) -> None:
    results = run.run(plans.QUICK, tmp_path, seed=1, command="scheduler-svc bench --quick --seed 1")
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["parameters"]["plan"] == "quick"
    cal = stored["calibration"]["inflight"]
    assert cal["capacity_rps"]["mixed"] > 0 and cal["capacity_rps"]["chat"] > 0
    assert set(cal["unloaded_ttft_ms"]) == {"hot", "warm", "cold"}

    runs = stored["runs"]
    # each step runs its own targets: the three always, make run's timers where the plan asks
    assert len(runs) == sum(len(plans.QUICK.targets(step)) for step in plans.QUICK.steps)
    assert any(r["target"] == bp.DEFAULTS_TARGET for r in runs)
    for r in runs:
        s = r["summary"]
        where = f"{r['mix']} {r['load']} {r['target']}"
        # every request ended in exactly one state, none left pending
        assert sum(s[state] for state in bp.STATES) == s["requests"] > 0, where
        assert s["ok"] > 0, where
        # engine-side columns were measured (the engine processed this run's tokens)
        assert s["padding_ratio"] is not None, where
        assert s["slot_occupancy"] is not None and s["slot_occupancy"] > 0, where
        assert s["kv_fragmentation"] is not None, where
        hot = s["lanes"]["hot"]
        assert hot["ttft_p50_ms"] > 0 and hot["e2e_p99_ms"] >= hot["ttft_p99_ms"] > 0, where
        assert 0 < len(r["ttft_ms"]["hot"]) <= hot["ok"], where
        cold = s["lanes"].get("cold", {"ok": 0})
        assert not cold["ok"] or cold["ttft_p50_ms"] > 0, where
    burst = [r for r in runs if r["mix"] == "burst"]
    burst_step = next(step for step in plans.QUICK.steps if step.mix == "burst")
    assert {r["target"] for r in burst} == set(plans.QUICK.targets(burst_step))
    assert all(r["offered_rps"] > 5 * cal["capacity_rps"]["chat"] for r in burst)

    for target in bp.TARGETS:
        assert stored["overhead"][target]["n"] == plans.QUICK.overhead_rounds
        assert stored["overhead"][target]["e2e_p50_ms"] > 0
    # QPS at the P99 SLO: the shared bisection ran for every target, and its answer is the
    # highest rate whose measured run met the SLO.
    slo = {lane: ms / 1000 for lane, ms in cal["slo_ttft_ms"].items()}
    searched = stored["slo_search"]
    assert [r["target"] for r in searched] == list(bp.TARGETS)
    for r in searched:
        trials = r["trials"]
        assert 1 <= len(trials) <= 1 + plans.QUICK.slo_iterations
        assert trials[0]["rate_rps"] == round(plans.QUICK.slo_range[0] * r["capacity_rps"], 3)
        assert all(t["met"] == bp.meets_slo(t["summary"], slo) for t in trials)
        met = [t["rate_rps"] for t in trials if t["met"]]
        assert r["qps_at_slo"] == (max(met) if met else 0.0)
        assert all(t["summary"]["requests"] > 0 for t in trials)
    text = (tmp_path / "results.md").read_text()
    assert "## QPS at the P99 SLO" in text
    assert "## mixed, inflight engine, 1.2× capacity" in text
    assert "## burst, inflight engine, 10× capacity" in text
    assert results["plots"] and all((tmp_path / p).stat().st_size > 0 for p in results["plots"])
