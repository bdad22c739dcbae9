"""The bench on a GPU-shaped engine: plans and arithmetic for `bench --engine-profile` (pure).

The reference engine with emulated timing keeps a cost profile's step times x `time_scale`, and
the simulator runs on the same profile; both see the same seeded requests (the bench's mixes,
`plan.MIXES`). Engine-driven figures (TTFT, goodput, QPS at the SLO) are in emulated time: the
live stack's arrivals are the emulated schedule stretched by the scale, its answers' times are
divided by it, and the sidecar's lane timers are multiplied by it. The sidecar's own overhead is
measured apart and reported in wall time, never divided.

Two plans:
- `agree`: the simulator against the live stack (Triton alone, the sidecar's policy), chat and
  mixed at 0.5x and 0.9x of capacity: TTFT P50 / P99 per lane, goodput, rows per step.
- `document`: the source document's table on the profile: QPS at the P99 SLO for short chat,
  mixed 3:1 and long documents (Triton alone, the sidecar), the 500 QPS burst, the sidecar's
  overhead.
Capacity is the simulator's: the completions per second Triton alone sustains when saturated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from scheduler_svc.core.slo import lane_slo_s
from scheduler_svc.profiles import CostProfile
from scheduler_svc.sim.simulate import RunResult, simulate
from scheduler_svc.sim.workload import Scenario
from scheduler_svc.tools.bench import plan as P  # noqa: N812 - read as the plan's namespace

# The engine the live stack runs (model_repo/emulated: TensorRT-LLM's default KV policy); the
# simulator's name for it.
SIM_ENGINE = "inflight_noevict"
SIM_TARGET = {"triton": "fifo", "policy": "policy"}
TARGETS = ("triton", "policy")
# The SLO on time to first token, in emulated seconds (core/slo.py's rule): the profile's
# unloaded time for the lane's typical prompt (its prefill alone) stands for the unloaded median.
LANE_PROMPTS = {"hot": 128, "warm": 512, "cold": 2048}
# The burst: the source document's 500 QPS of chat, bursty (gaps with a coefficient of
# variation of 2), offered for BURST_S emulated seconds.
BURST_QPS = 500.0
BURST_S = 2.0
# A request the client still waits for after this many emulated seconds is given up.
DEADLINE_S = 30.0
# The time scale, where the command does not fix one: each mix's engine slowed until, at its
# capacity, the stack streams at most this many tokens per wall second (what this 2-core
# machine carries through Triton, the sidecar and the client with no overrun: chat at 423/s
# ran with 0 overrun steps and a 2 ms send lag), and never below MIN_SCALE.
WALL_TOKENS_PER_S = 400.0
MIN_SCALE = 2.0


@dataclass(frozen=True)
class EmulatedPlan:
    name: str
    # (mix, load as a multiple of capacity) where the simulator and the live stack are compared.
    agree_points: tuple[tuple[str, float], ...] = ()
    # Mixes whose QPS at the P99 SLO is searched, live and in the simulator.
    slo_mixes: tuple[str, ...] = ()
    burst: bool = False
    overhead_rounds: int = 0
    window_s: float = 4.0  # emulated seconds of offered load per run
    min_requests: int = 300  # ... or long enough to offer this many
    max_window_s: float = 60.0  # ... but no longer than this
    slo_range: tuple[float, float] = (0.25, 1.5)  # x capacity
    slo_iterations: int = 4


AGREE = EmulatedPlan(
    "agree",
    agree_points=(("chat", 0.5), ("chat", 0.9), ("mixed", 0.5), ("mixed", 0.9)),
    min_requests=600,
)
DOCUMENT = EmulatedPlan(
    "document", slo_mixes=("chat", "mixed", "long_docs"), burst=True, overhead_rounds=40
)
# A few minutes: one agreement point, one short search; for trying a time scale.
QUICK = EmulatedPlan(
    "quick",
    agree_points=(("chat", 0.9),),
    slo_mixes=("chat",),
    window_s=2.0,
    min_requests=150,
    slo_iterations=1,
)
PLANS = {p.name: p for p in (AGREE, DOCUMENT, QUICK)}


def slo_for(profile: CostProfile) -> dict[str, float]:
    """Per-lane TTFT SLO in emulated seconds, from the profile's own unloaded times."""
    return {lane: lane_slo_s(profile.prefill_s(tokens)) for lane, tokens in LANE_PROMPTS.items()}


def scenario(mix: str, window_s: float) -> Scenario:
    """The mix's requests over `window_s` (what `plan.schedule` draws, for the live stack)."""
    return replace(P.MIXES[mix], duration_s=window_s)


def output_tokens_mean(mix: str) -> float:
    """A mix's mean output length, as its classes draw it (the engine runs each to it)."""
    classes = P.MIXES[mix].classes
    return sum(c.weight * c.output_mean for c in classes) / sum(c.weight for c in classes)


def scale_for(mix: str, capacity_rps: float) -> float:
    """The time scale at which `mix` at its capacity streams WALL_TOKENS_PER_S tokens per wall
    second (a whole number, at least MIN_SCALE)."""
    return float(
        max(MIN_SCALE, math.ceil(capacity_rps * output_tokens_mean(mix) / WALL_TOKENS_PER_S))
    )


def window_for(plan: EmulatedPlan, rate: float) -> float:
    """Emulated seconds a run offers load for: the plan's window, or enough for its minimum
    number of requests."""
    return min(plan.max_window_s, max(plan.window_s, plan.min_requests / rate))


def simulated(
    profile: CostProfile, mix: str, target: str, rate: float, window_s: float, seed: int
) -> RunResult:
    return simulate(scenario(mix, window_s), SIM_TARGET[target], SIM_ENGINE, seed, rate, profile)


def sim_outcomes(run: RunResult) -> list[P.Outcome]:
    """The simulator's outcomes as the bench's client records them (emulated seconds)."""
    states = {"served": "ok", "rejected": "rejected_fast", "failed": "failed", "queued": "failed"}
    out = []
    for o in run.outcomes:
        r = o.request
        state = states[o.state]
        out.append(
            P.Outcome(
                P.lane_of(r.prompt_tokens),
                r.prompt_tokens,
                state,
                o.ttft_s,
                o.e2e_s,
                r.output_tokens if state == "ok" else 0,
            )
        )
    return out


def sim_summary(run: RunResult, window_s: float, slo: dict[str, float]) -> dict[str, Any]:
    totals = run.engine_totals
    delta = P.EngineDelta(steps=totals.steps, rows=totals.rows)
    return P.summarize(sim_outcomes(run), window_s, slo, delta)


def capacity(profile: CostProfile, mix: str, seed: int, window_s: float = 10.0) -> float:
    """Completions per emulated second Triton alone sustains on the simulator when saturated:
    the offered rate doubles until the engine falls behind it."""
    rate = 8.0
    while True:
        run = simulated(profile, mix, "triton", rate, window_s, seed)
        done = [o.done_s for o in run.outcomes if o.state == "served" and o.done_s is not None]
        sustained = P.sustained_rate(done, window_s)
        if sustained < 0.9 * rate or rate > 1e5:
            return sustained
        rate *= 2


def time_keys_scaled(mapping: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """Only the durations of a config mapping (keys ending in `_s`, numbers), times `scale`;
    lanes keep their names so that an override changes only those keys."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if key == "lanes" and isinstance(value, list):
            out[key] = [{"name": lane["name"], **time_keys_scaled(lane, scale)} for lane in value]
        elif isinstance(value, Mapping):
            inner = time_keys_scaled(value, scale)
            if inner:
                out[key] = inner
        elif key == "ttft_target_s":
            continue  # the sidecar derives it from the engine's cost profile, at its scale
        elif key.endswith("_s") and isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value * scale
    return out


def to_emulated(outcomes: list[P.Outcome], scale: float) -> list[P.Outcome]:
    """The live client's outcomes with engine-driven times in emulated seconds (its send lag
    stays in wall seconds: it is the client host's, not the engine's)."""
    return [
        replace(
            o,
            ttft_s=None if o.ttft_s is None else o.ttft_s / scale,
            e2e_s=None if o.e2e_s is None else o.e2e_s / scale,
        )
        for o in outcomes
    ]


def agreement(sim: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, float | None]:
    """live / sim for every compared figure (None where either is missing)."""
    out: dict[str, float | None] = {"goodput": P.ratio(live["goodput_rps"], sim["goodput_rps"])}
    out["rows_per_step"] = P.ratio(live["rows_per_step"], sim["rows_per_step"])
    for lane in P.LANES:
        for key in ("ttft_p50_ms", "ttft_p99_ms"):
            a = live["lanes"].get(lane, {}).get(key)
            b = sim["lanes"].get(lane, {}).get(key)
            out[f"{lane}_{key}"] = P.ratio(a, b)
    return out
