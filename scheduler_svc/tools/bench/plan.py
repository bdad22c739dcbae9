"""What `scheduler-svc bench` runs, and the arithmetic of its results (pure: no I/O, no clock).

The mixes are the simulator's scenarios (`sim/workload.py`) with output lengths cut to what a CPU
engine can decode in a benchmark's time; prompt lengths are the source document's. Arrival
times are fixed in advance from a seeded Poisson (or, for the burst, gamma) process at a
multiple of the rate the engine sustains, measured first (calibration).

What a plan is (`Plan`, `Step`) and the targets it names live here; the plans themselves, one
declaration each, are in `plans.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler_svc.core.slo import SLO_FLOOR_S, lane_slo_s, meets, percentile
from scheduler_svc.sim.workload import RequestClass, Scenario, SimRequest, generate

TARGETS = ("triton", "fifo", "policy")
# The source document's SmartBatching settings (max_ratio, batch timeout): the policy target runs
# the first; the QPS-at-SLO search on a static engine runs the others as extra sidecars too.
SMART_BATCHING = {
    "policy": (1.5, 0.05),
    "policy_2.0_30": (2.0, 0.03),
    "policy_1.2_80": (1.2, 0.08),
    "policy_summed": (1.5, 0.05),
}
MATRIX_TARGETS = ("policy_2.0_30", "policy_1.2_80")
TARGET_NAMES = {
    "triton": "Triton alone",
    "fifo": "sidecar FIFO",
    "policy": "sidecar policy",
    "policy_2.0_30": "sidecar policy 2.0 / 30 ms",
    "policy_1.2_80": "sidecar policy 1.2 / 80 ms",
    "policy_defaults": "sidecar policy, make run's timers",
    "policy_summed": "sidecar policy, KV by summed reservations",
    "policy_budget_off": "make run's sidecar, no prefill budget",
    "policy_budget_4steps": "make run's sidecar, prefill budget 4 steps",
    "policy_budget_2steps": "make run's sidecar, prefill budget 2 steps",
    "policy_no_row_guard": "make run's sidecar, no row guard",
    "policy_no_prefill_guard": "make run's sidecar, no prefill guard",
    "policy_no_row_wait": "make run's sidecar, no row wait at admission",
    "triton_again": "Triton alone, again",
}
# Triton alone a second time on the same arrivals, in the same step: how far two runs of the very
# same thing land apart here, the noise floor under a ratio against Triton alone (the below plan).
TRITON_AGAIN = "triton_again"
TRITON_TARGETS = ("triton", TRITON_AGAIN)
# The policy whose KV mirror admits by the sum of every reservation's final size instead of the
# pool's forecast peak (`kv.forecast_peak: false`, the rule before it): the kv plan runs both.
SUMMED_TARGET = "policy_summed"
# The policy with `make run`'s settings: the core's defaults, the source document's A100 lane
# timers (hot 100 ms, warm 500 ms), not rescaled to this engine. Run where a plan says.
DEFAULTS_TARGET = "policy_defaults"
# make run's policy with one setting changed (its `policy` section's overrides), run beside the
# default by the plan that asks: its prefill budget (`policy.prefill_budget_tokens`) pinned to
# two of the CPU engine's 256-token steps, the default before it followed the engine's chunking
# policy (none under equal_progress: the budget plan); no row guard (the first lane's share so
# small that it keeps no row: the guard plan); no prefill guard (the prefill plan); no wait for
# a row in a first-lane arrival's predicted wait (`admission.row_wait`: the rows plan).
BUDGET_TARGET = "policy_budget_2steps"
NO_GUARD_TARGET = "policy_no_row_guard"
NO_PREFILL_GUARD_TARGET = "policy_no_prefill_guard"
NO_ROW_WAIT_TARGET = "policy_no_row_wait"
VARIANT_TARGETS: dict[str, dict[str, Any]] = {
    BUDGET_TARGET: {"prefill_budget_tokens": 512},
    NO_GUARD_TARGET: {
        "lanes": [{"name": "hot", "share": 0.001}, {"name": "warm"}, {"name": "cold"}]
    },
    NO_PREFILL_GUARD_TARGET: {"prefill_guard_slots": None},
    NO_ROW_WAIT_TARGET: {"admission": {"row_wait": False}},
}
# QPS at the P99 SLO: a run meets it when every lane's P99 TTFT is within its SLO and at most
# MAX_REFUSED of its requests was refused or failed (core/slo.py: the rule everything uses).
LANES = ("hot", "warm", "cold")
STATES = ("ok", "rejected_fast", "rejected_queued", "failed")
LANE_BOUNDS = (256, 1024)  # prompt tokens where warm and cold begin (the source document's)
# A clean refusal answered within this long counts as fast; later ones waited in a queue first.
FAST_REJECT_S = 0.05
# A run whose client sent its requests this late (P99 against the schedule) did not offer the
# load it was meant to: the host stalled (a 2-core VM can lose seconds). It is run again, up to
# MAX_RERUNS times; the last try is kept and the report says how many it took.
MAX_SEND_LAG_S = 0.2
MAX_RERUNS = 2

_CHAT = RequestClass(1.0, 128, 16, 255, 24, 48, 0)
MIXES: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("chat", "short chat, 128 prompt tokens on average", 1.0, 1.0, (_CHAT,)),
        Scenario(
            "mixed",
            "long:short = 1:3",
            1.0,
            1.0,
            (
                replace(_CHAT, weight=3.0),
                RequestClass(1.0, 1500, 1024, 3000, 32, 64, 2, spread=0.35),
            ),
        ),
        Scenario(
            "long_docs",
            "long documents, 3,856 prompt tokens on average",
            1.0,
            1.0,
            (RequestClass(1.0, 3856, 2048, 4000, 32, 64, 2, spread=0.25),),
        ),
        Scenario("burst", "a burst of chat at 10x capacity", 1.0, 1.0, (_CHAT,), burstiness=2.0),
        Scenario(
            "spread_8to1",
            "prompts spread 8:1 (64-512 tokens)",
            1.0,
            1.0,
            (RequestClass(1.0, 180, 64, 512, 24, 48, 1, spread=0.7),),
        ),
        Scenario(
            "kv_pressure",
            "chat with a generous max_tokens (512); the engine ends outputs itself",
            1.0,
            1.0,
            (RequestClass(1.0, 128, 16, 255, 512, 512, 0),),
        ),
    )
}
# Mixes sent with their generous max_tokens to an engine whose synthetic end-of-sequence model
# ends each output (mean 40 tokens): the others are cut to their drawn output length, since the
# random-weights engine never stops by itself.
ENDS_ITSELF = frozenset({"kv_pressure"})
# The burst is offered at this multiple of the chat mix's capacity.
BURST_LOAD = 10.0


@dataclass(frozen=True)
class Step:
    """One (engine, mix, load) point; every target runs it, in turn."""

    engine: str
    mix: str
    load: float  # multiple of the mix's calibrated capacity


@dataclass(frozen=True)
class Plan:
    name: str
    engines: tuple[str, ...]
    steps: tuple[Step, ...]
    duration_s: float  # offered-load window of one run
    burst_s: float
    calibrate_s: float
    deadline_s: float  # the client gives up on a request after this long
    overhead_rounds: int
    # QPS at the P99 SLO: (engine, mix) points searched by bisection over offered rates in
    # `slo_range` (multiples of the calibrated capacity), `slo_iterations` halvings, each trial
    # an open-loop run of `slo_window_s`.
    slo_points: tuple[tuple[str, str], ...] = ()
    slo_range: tuple[float, float] = (0.25, 2.0)
    slo_iterations: int = 4
    slo_window_s: float = 8.0
    # Points where the document's other SmartBatching settings are searched too (its matrix).
    slo_matrix: tuple[tuple[str, str], ...] = ()
    # (engine, mix) steps where the policy with make run's timers runs too.
    defaults_at: tuple[tuple[str, str], ...] = ()
    # Who the QPS-at-SLO search runs (the matrix adds its settings where it applies).
    slo_target_set: tuple[str, ...] = TARGETS
    # A trial lasts long enough to offer at least this many requests (a P99 over a few dozen
    # is one request's luck on a noisy host).
    slo_min_requests: int = 0
    # Requests each target serves, closed loop, before its search: what a deployed sidecar has
    # learned (output lengths) by the time it is measured. Not counted in any figure.
    warmup_requests: int = 0
    # Who runs every step (`defaults_at` adds make run's policy where it says).
    step_targets: tuple[str, ...] = TARGETS

    def targets(self, step: Step) -> tuple[str, ...]:
        """Who runs a step."""
        extra = (DEFAULTS_TARGET,) if (step.engine, step.mix) in self.defaults_at else ()
        return self.step_targets + tuple(t for t in extra if t not in self.step_targets)

    def mixes(self, engine: str) -> list[str]:
        """Mixes to calibrate on `engine` (the burst is offered at the chat mix's rate)."""
        out: list[str] = []
        for step in self.steps:
            mix = "chat" if step.mix == "burst" else step.mix
            if step.engine == engine and mix not in out:
                out.append(mix)
        for point_engine, mix in self.slo_points:
            if point_engine == engine and mix not in out:
                out.append(mix)
        return out

    def slo_targets(self, engine: str, mix: str) -> tuple[str, ...]:
        """Who the QPS-at-SLO search runs at a point."""
        return self.slo_target_set + (MATRIX_TARGETS if (engine, mix) in self.slo_matrix else ())


def lane_of(prompt_tokens: int) -> str:
    warm, cold = LANE_BOUNDS
    return "hot" if prompt_tokens < warm else "warm" if prompt_tokens < cold else "cold"


def schedule(mix: str, rate: float, duration_s: float, seed: int) -> list[SimRequest]:
    """The run's requests, arrival times fixed in advance (open loop)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0 (got {rate}, {duration_s})")
    scenario = replace(MIXES[mix], duration_s=duration_s)
    return generate(scenario, seed, qps=rate)


@dataclass
class Outcome:
    """What one request got, as the client saw it (times in seconds from its send)."""

    lane: str
    prompt_tokens: int
    state: str = "pending"  # ok | rejected_fast | rejected_queued | failed
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    send_lag_s: float = 0.0  # how late the client sent it against the schedule
    error: str = ""


def classify_error(elapsed_s: float, got_tokens: bool, refusal: bool) -> str:
    """A clean refusal (overload, queue full, queue timeout) before any token is a rejection,
    fast if answered within FAST_REJECT_S; anything else after acceptance is a failure."""
    if refusal and not got_tokens:
        return "rejected_fast" if elapsed_s <= FAST_REJECT_S else "rejected_queued"
    return "failed"


def sustained_rate(finished_s: Sequence[float], window_s: float) -> float:
    """Completions per second in steady state: those that finished inside the window, after
    its first fifth (the ramp-up, when the engine is still filling)."""
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    warmup = window_s / 5
    inside = [t for t in finished_s if warmup < t <= window_s]
    return round(len(inside) / (window_s - warmup), 3)


def slo_ttft(unloaded_ttft_s: dict[str, float]) -> dict[str, float]:
    """Per-lane SLO on time to first token, from the unloaded medians measured in calibration;
    a lane with no unloaded figure borrows the largest measured one."""
    fallback = max(unloaded_ttft_s.values()) if unloaded_ttft_s else SLO_FLOOR_S
    return {lane: lane_slo_s(unloaded_ttft_s.get(lane, fallback)) for lane in LANES}


def within_slo(o: Outcome, slo: dict[str, float]) -> bool:
    return o.state == "ok" and o.ttft_s is not None and o.ttft_s <= slo[o.lane]


def to_ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


@dataclass
class EngineDelta:
    """What the engine's own counters and samples say about one run."""

    # Tokens the engine pushed through the model, and those that belonged to a real row, in the
    # prompt (context) phase; padding there is the source document's padding ratio.
    processed_tokens: float = 0.0
    useful_tokens: float = 0.0
    occupancy: list[float] = field(default_factory=list)  # active / max sequences, sampled
    fragmentation: list[float] = field(default_factory=list)  # sampled while blocks were held
    # The same for generation steps: a static batch keeps finished rows' slots busy.
    generation_processed: float = 0.0
    generation_useful: float = 0.0
    paused: float = 0.0  # sequences the engine paused (freed, to recompute later) to free KV
    kv_used: list[float] = field(default_factory=list)  # used / total KV blocks, sampled
    steps: float = 0.0  # engine iterations
    rows: float = 0.0  # sequences those iterations ran, summed
    overruns: float = 0.0  # emulated steps whose real work outlasted their modelled time
    paced_s: float = 0.0  # wall seconds emulated steps were held to
    work_s: float = 0.0  # ... and the engine's own work inside them

    def padding(self) -> float | None:
        return _waste(self.processed_tokens, self.useful_tokens)

    def generation_waste(self) -> float | None:
        return _waste(self.generation_processed, self.generation_useful)

    def rows_per_step(self) -> float | None:
        return round(self.rows / self.steps, 2) if self.steps else None

    def overrun_share(self) -> float | None:
        return round(self.overruns / self.steps, 4) if self.steps else None

    def work_share(self) -> float | None:
        """How much of its emulated steps the engine's own work filled (its headroom)."""
        return round(self.work_s / self.paced_s, 4) if self.paced_s else None


def _waste(processed: float, useful: float) -> float | None:
    return round(1 - useful / processed, 4) if processed > 0 else None


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def summarize(
    outcomes: Sequence[Outcome],
    window_s: float,
    slo: dict[str, float],
    engine: EngineDelta,
) -> dict[str, Any]:
    """Every figure of one run. Rates are per second of the offered window; times in ms."""
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    ok = [o for o in outcomes if o.state == "ok"]
    states = {s: sum(o.state == s for o in outcomes) for s in STATES}
    lanes: dict[str, Any] = {}
    for lane in LANES:
        mine = [o for o in outcomes if o.lane == lane]
        if not mine:
            continue
        served = [o for o in mine if o.state == "ok"]
        ttft = [o.ttft_s for o in served if o.ttft_s is not None]
        e2e = [o.e2e_s for o in served if o.e2e_s is not None]
        tpot = [
            (o.e2e_s - o.ttft_s) / (o.tokens - 1)
            for o in served
            if o.e2e_s is not None and o.ttft_s is not None and o.tokens > 1
        ]
        lanes[lane] = {
            "requests": len(mine),
            "ok": len(served),
            "within_slo": sum(within_slo(o, slo) for o in mine),
            "ttft_p50_ms": to_ms(percentile(ttft, 50)),
            "ttft_p99_ms": to_ms(percentile(ttft, 99)),
            "e2e_p50_ms": to_ms(percentile(e2e, 50)),
            "e2e_p99_ms": to_ms(percentile(e2e, 99)),
            # Time per output token after the first: what pausing and recomputing stretches.
            "tpot_p50_ms": to_ms(percentile(tpot, 50)),
            "tpot_p99_ms": to_ms(percentile(tpot, 99)),
        }
    lags = [o.send_lag_s for o in outcomes]
    good = sum(within_slo(o, slo) for o in outcomes)
    refused = states["rejected_fast"] + states["rejected_queued"]
    return {
        "requests": len(outcomes),
        **states,
        # The source document's burst figure: the share of requests that failed, were refused
        # or started past their SLO.
        "failed_or_late": round(1 - good / len(outcomes), 4) if outcomes else None,
        "refused_fast_share": round(states["rejected_fast"] / refused, 4) if refused else None,
        "goodput_rps": round(sum(within_slo(o, slo) for o in outcomes) / window_s, 3),
        "throughput_rps": round(len(ok) / window_s, 3),
        "tokens_per_s": round(sum(o.tokens for o in ok) / window_s, 1),
        "lanes": lanes,
        "padding_ratio": engine.padding(),
        "generation_waste": engine.generation_waste(),
        "slot_occupancy": _mean(engine.occupancy),
        "kv_fragmentation": _mean(engine.fragmentation),
        "kv_utilization": _mean(engine.kv_used),
        "engine_pauses": engine.paused,
        # Pauses per request sent: at most the share of requests paused (one may be paused
        # more than once).
        "pauses_per_request": round(engine.paused / len(outcomes), 4) if outcomes else None,
        "rows_per_step": engine.rows_per_step(),
        "overrun_share": engine.overrun_share(),
        "engine_work_share": engine.work_share(),
        "send_lag_p99_ms": to_ms(percentile(lags, 99)),
    }


def meets_slo(summary: dict[str, Any], slo: dict[str, float]) -> bool:
    """Every lane's P99 time to first token within its SLO, at most MAX_REFUSED not served
    (core/slo.py's rule, on the summary's P99s)."""
    ttft = {
        lane: [figures["ttft_p99_ms"] / 1000] if figures["ttft_p99_ms"] is not None else []
        for lane, figures in summary["lanes"].items()
        if figures["ok"]
    }
    if any(not values for values in ttft.values()):
        return False
    return meets(ttft, slo, summary["requests"], summary["ok"])


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is zero."""
    if a is None or b is None or b == 0 or math.isnan(b):
        return None
    return round(a / b, 2)
