"""The plans `scheduler-svc bench` runs, one declaration each (a plan is data: its steps, targets
and windows; `plan.py` says what they mean and holds the arithmetic their results go through)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from scheduler_svc.tools.bench.plan import (
    BUDGET_TARGET,
    BURST_LOAD,
    DEFAULTS_TARGET,
    NO_GUARD_TARGET,
    NO_PREFILL_GUARD_TARGET,
    NO_ROW_WAIT_TARGET,
    SUMMED_TARGET,
    TRITON_AGAIN,
    Plan,
    Step,
)


def _grid(engine: str, mixes: Iterable[str], loads: Iterable[float]) -> list[Step]:
    return [Step(engine, mix, load) for mix in mixes for load in loads]


QUICK = Plan(
    "quick",
    ("inflight",),
    (*_grid("inflight", ["mixed"], [0.5, 1.2]), Step("inflight", "burst", BURST_LOAD)),
    duration_s=5.0,
    burst_s=1.0,
    calibrate_s=5.0,
    deadline_s=15.0,
    overhead_rounds=15,
    slo_points=(("inflight", "mixed"),),
    defaults_at=(("inflight", "mixed"), ("inflight", "burst")),
    slo_iterations=1,
    slo_window_s=4.0,
)
FULL = Plan(
    "full",
    ("inflight", "static"),
    tuple(
        _grid("inflight", ["chat", "mixed", "spread_8to1"], [0.8, 1.2])
        + _grid("inflight", ["long_docs"], [1.2])
        + [Step("inflight", "burst", BURST_LOAD)]
        + _grid("static", ["mixed", "spread_8to1"], [0.8, 1.2])
    ),
    duration_s=12.0,
    burst_s=2.0,
    calibrate_s=8.0,
    deadline_s=30.0,
    overhead_rounds=60,
    slo_points=(("static", "spread_8to1"), ("static", "mixed"), ("inflight", "spread_8to1")),
    slo_matrix=(("static", "spread_8to1"),),
    defaults_at=(("inflight", "mixed"), ("inflight", "burst")),
)
# QPS at the P99 SLO on the static engine alone, with longer trials at lower rates than the full
# plan's (a static engine meets a 250 ms first-token SLO only well below its capacity, where an
# 8 s window holds too few requests for a P99).
SLO = Plan(
    "slo",
    ("static",),
    (),
    duration_s=12.0,
    burst_s=2.0,
    calibrate_s=8.0,
    deadline_s=30.0,
    overhead_rounds=0,
    slo_points=(("static", "spread_8to1"), ("static", "mixed")),
    slo_range=(0.1, 1.0),
    slo_iterations=3,
    slo_window_s=15.0,
    slo_matrix=(("static", "spread_8to1"),),
)
# Generous max_tokens under KV pressure (issue 15): the engine's KV sized so that
# guaranteed_no_evict (prompt + max_tokens reserved) runs 4 sequences where max_num_sequences
# is 16; Triton alone and the policy sidecar on it and on max_utilization.
KV = Plan(
    "kv",
    ("kv_noevict", "kv_maxutil"),
    (),
    duration_s=12.0,
    burst_s=2.0,
    calibrate_s=10.0,
    deadline_s=30.0,
    overhead_rounds=0,
    slo_points=(("kv_noevict", "kv_pressure"), ("kv_maxutil", "kv_pressure")),
    slo_range=(0.25, 2.0),
    slo_iterations=3,
    slo_window_s=20.0,
    slo_min_requests=100,
    slo_target_set=("triton", "policy", SUMMED_TARGET),
    warmup_requests=48,
)
# Issue 28's protocol on the in-flight engine, for the shipped defaults (make run's sidecar)
# against Triton alone: below saturation (0.3x, 0.6x, 0.9x of the closed-loop capacity, the
# ceiling), overload (mixed at 1.2x; chat at 10x for the burst), QPS at the P99 SLO by bisection
# to 2 % of capacity (0.25x-1.5x, 6 halvings) with trials of at least 300 requests, and the
# no-load overhead. One search per target: a repeat costs another ~25 minutes here.
DEADLINE = Plan(
    "deadline",
    ("inflight",),
    tuple(
        _grid("inflight", ["mixed", "spread_8to1"], [0.3, 0.6, 0.9])
        + _grid("inflight", ["mixed"], [1.2])
        + [Step("inflight", "burst", BURST_LOAD)]
    ),
    duration_s=30.0,
    burst_s=2.0,
    calibrate_s=8.0,
    deadline_s=30.0,
    overhead_rounds=60,
    slo_points=(("inflight", "mixed"), ("inflight", "spread_8to1")),
    slo_range=(0.25, 1.5),
    slo_iterations=6,
    slo_window_s=20.0,
    slo_min_requests=300,
    slo_target_set=("triton", DEFAULTS_TARGET),
    step_targets=("triton", DEFAULTS_TARGET),
    warmup_requests=32,
)
# The prefill budget's cost and worth below saturation on the in-flight engine (issue 28's 8:1
# warm lane): make run's sidecar (no budget on this equal_progress engine) and the same with a
# two-step budget, against Triton alone on the same arrivals; each step three times over with
# fresh arrivals (~20 min).
BUDGET = Plan(
    "budget",
    ("inflight",),
    tuple(3 * _grid("inflight", ["spread_8to1", "mixed"], [0.6, 0.9])),
    duration_s=30.0,
    burst_s=2.0,
    calibrate_s=8.0,
    deadline_s=30.0,
    overhead_rounds=0,
    step_targets=("triton", DEFAULTS_TARGET, BUDGET_TARGET),
)
# Issue 28's overload target (5) and the 8:1 mix just below saturation (2), make run's sidecar
# against Triton alone on the same arrivals, twice with fresh arrivals (~12 min): the short
# form of the deadline plan for a change to when the policy refuses.
OVERLOAD = replace(
    BUDGET,
    name="overload",
    steps=2
    * (
        *_grid("inflight", ["mixed"], [1.2]),
        *_grid("inflight", ["spread_8to1"], [0.9]),
        Step("inflight", "burst", BURST_LOAD),
    ),
    step_targets=("triton", DEFAULTS_TARGET),
    warmup_requests=32,
)
# The row guard's worth on the mixed workload (issue 28, target 5): make run's sidecar against
# the same without the guard, and Triton alone, on the same arrivals, past and below saturation
# and in the burst (~10 min).
GUARD = replace(
    BUDGET,
    name="guard",
    steps=(
        *_grid("inflight", ["mixed"], [1.2, 0.9, 0.6]),
        Step("inflight", "burst", BURST_LOAD),
    ),
    step_targets=("triton", DEFAULTS_TARGET, NO_GUARD_TARGET),
    warmup_requests=32,
)
# The prefill guard's worth (issue 28, target 5, and target 2 below saturation): make run's
# sidecar against the same without the guard, and Triton alone, on the same arrivals; mixed past
# saturation twice, both mixes below it (~16 min).
PREFILL = replace(
    BUDGET,
    name="prefill",
    steps=(
        *_grid("inflight", ["mixed"], [1.2]),
        *_grid("inflight", ["spread_8to1"], [0.9]),
        *_grid("inflight", ["mixed"], [0.6]),
        *_grid("inflight", ["mixed"], [1.2]),
        *_grid("inflight", ["spread_8to1"], [0.6]),
        *_grid("inflight", ["mixed"], [0.9]),
    ),
    step_targets=("triton", DEFAULTS_TARGET, NO_PREFILL_GUARD_TARGET),
    warmup_requests=32,
)
# The row wait at admission (issue 28, target 5's fast refusals; target 2's refusals below
# saturation): make run's sidecar against the same without it, and Triton alone, on the same
# arrivals; past saturation, in the burst and both mixes below it (~10 min).
ROWS = replace(
    BUDGET,
    name="rows",
    steps=(
        *_grid("inflight", ["mixed"], [1.2]),
        Step("inflight", "burst", BURST_LOAD),
        *_grid("inflight", ["spread_8to1"], [0.9]),
        *_grid("inflight", ["mixed"], [0.9]),
    ),
    step_targets=("triton", DEFAULTS_TARGET, NO_ROW_WAIT_TARGET),
    warmup_requests=32,
)
# Issue 28's target 2 against its noise floor: the six below-saturation cells twice with fresh
# arrivals, make run's sidecar against Triton alone, and Triton alone again on the same arrivals
# (how far apart two runs of the same thing land here; ~25 min).
BELOW = replace(
    BUDGET,
    name="below",
    steps=tuple(2 * _grid("inflight", ["mixed", "spread_8to1"], [0.3, 0.6, 0.9])),
    step_targets=("triton", DEFAULTS_TARGET, TRITON_AGAIN),
    warmup_requests=32,
)
PLANS = {
    p.name: p
    for p in (QUICK, FULL, SLO, KV, DEADLINE, BUDGET, OVERLOAD, GUARD, PREFILL, ROWS, BELOW)
}
