"""Drive a target (a scheduler in front of a simulated engine) through a workload, in virtual time.

Targets, all fed the same arrivals:
- `fifo`: Triton alone, as configured out of the box: requests go straight to the engine's own
  queue (bounded by max_queue_size; a full queue refuses at once).
- `priority`: Triton's dynamic batcher with priority levels and a queue policy (per-level
  timeouts, a max queue size), length-blind. Modelled generously, as if the priority reached
  the engine (with in-flight batching it does not: Triton's priority levels order only its own
  queue, and the TensorRT-LLM backend never sees them).
- `policy`: scheduler_svc's full policy (`core.policy.PolicyScheduler`) in front of the engine.

The loop is the shell's in miniature: arrivals are submitted, `schedule(now)` decides, dispatched
rows go to the engine, the engine's steps report tokens back (`on_progress`, `on_done`) and its
free blocks (`observe_kv`), and the loop wakes at `next_wakeup`.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace

from scheduler_svc.core.admission import PROGRESS_EVERY_TOKENS
from scheduler_svc.core.config import (
    MEDIAN_FOR_ALLOCATING_ENGINES,
    FairnessConfig,
    KvConfig,
    KvMode,
    PolicyConfig,
    PredictConfig,
    default_lanes,
)
from scheduler_svc.core.engine import prefill_budget_tokens
from scheduler_svc.core.fifo import FifoScheduler
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.slo import lane_slo_s, lane_targets
from scheduler_svc.core.types import Dispatch, Expired, Rejected, Request, Scheduler, Urgency
from scheduler_svc.profiles import CostProfile, load_profile
from scheduler_svc.sim.engine import (
    EngineTotals,
    InflightEngine,
    SimSequence,
    StaticEngine,
    StepResult,
)
from scheduler_svc.sim.workload import Scenario, SimRequest, generate

TARGETS = ("fifo", "priority", "policy")
# The profile the source document's tables are projected on (an A100, as the document's).
DEFAULT_SIM_PROFILE = "a100-8b-awq"
# In-flight on max_utilization (KV as tokens come, pauses when dry), in-flight on
# guaranteed_no_evict (prompt + max_tokens reserved at admission), static (V1).
ENGINES = ("inflight", "inflight_noevict", "static")
LANES = ("hot", "warm", "cold")
# Triton queue policy a careful user would set per priority level (seconds in queue).
PRIORITY_TIMEOUT_S = {0: 0.5, 1: 2.0, 2: 10.0}
DRAIN_S = 120.0
WARMUP_SEED = 1000  # warm-up requests come from seed + this: the same mix, other draws
# The Triton-with-priority target on a static engine: about one batch's rows in flight at once.
STATIC_ROWS_IN_FLIGHT = 16


def lane_of(prompt_tokens: int) -> str:
    """The reporting lane (the policy's default thresholds), the same for every target."""
    return "hot" if prompt_tokens < 256 else "warm" if prompt_tokens < 1024 else "cold"


@dataclass
class Outcome:
    request: SimRequest
    lane: str
    state: str = "queued"  # served | rejected (fast, at submission) | failed (after acceptance)
    first_token_s: float | None = None
    done_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.request.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for one-token answers)."""
        first, done, tokens = self.first_token_s, self.done_s, self.request.output_tokens
        if first is None or done is None or tokens < 2:
            return None
        return (done - first) / (tokens - 1)

    def within_slo(self, slo_s: dict[str, float], tpot_bound_s: float | None = None) -> bool:
        """Served with a first token within its lane's bound and, where a bound on time per
        output token is given, streamed at least that fast."""
        ttft = self.ttft_s
        if self.state != "served" or ttft is None or ttft > slo_s[self.lane]:
            return False
        tpot = self.tpot_s
        return tpot_bound_s is None or tpot is None or tpot <= tpot_bound_s


@dataclass
class RunResult:
    scenario: str
    target: str
    engine: str
    qps: float
    duration_s: float
    outcomes: list[Outcome]
    engine_totals: EngineTotals
    batch_padding: list[float] = field(default_factory=list)
    batch_utilization: list[float] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    end_s: float = 0.0
    slo_s: dict[str, float] = field(default_factory=dict)  # each lane's TTFT bound (core/slo.py)


def lane_slos(requests: list[SimRequest], cost: CostProfile) -> dict[str, float]:
    """Each lane's TTFT bound by the one SLO rule (core/slo.py): from its unloaded median, here
    the profile's prefill time of the median prompt the lane holds (what an idle engine takes)."""
    slo: dict[str, float] = {}
    for lane in LANES:
        prompts = sorted(r.prompt_tokens for r in requests if lane_of(r.prompt_tokens) == lane)
        unloaded = cost.prefill_s(prompts[len(prompts) // 2]) if prompts else 0.0
        slo[lane] = lane_slo_s(unloaded)
    return slo


def make_scheduler(
    target: str,
    engine: str,
    cost: CostProfile,
    kv_mode: KvMode,
    fairness: FairnessConfig | None = None,
) -> Scheduler | None:
    if target == "fifo":
        return None
    if target == "priority":
        rows = cost.max_num_sequences if engine != "static" else STATIC_ROWS_IN_FLIGHT
        return FifoScheduler(max_queued=cost.max_queue_size, max_in_flight=rows)
    if target == "policy":
        # The sidecar's rule for an engine profile (SidecarConfig.policy_for): an in-flight
        # engine batches continuously; a static one runs one batch at a time, so exactly one
        # released batch is in it. Lane shares bound an in-flight engine's unprefilled prompt
        # tokens within two of its steps. The mirror reserves as the engine allocates:
        # prompt + max_tokens under guaranteed_no_evict, the median predicted output under
        # max_utilization.
        inflight = engine != "static"
        no_evict = engine == "inflight_noevict"
        kv = KvConfig(
            mode=kv_mode,
            tokens_per_block=cost.tokens_per_block,
            total_blocks=cost.total_blocks,
            max_seq_len=cost.max_seq_len,
            max_in_flight=cost.max_num_sequences,
            reserve_max_tokens=no_evict,
        )
        predict = PredictConfig()
        if engine == "inflight":
            predict = PredictConfig(quantile=MEDIAN_FOR_ALLOCATING_ENGINES)
        # The lanes work to the one SLO rule's bounds on this engine, from its cost profile,
        # as the sidecar's do where the engine says what a step costs (policy_for_engine).
        targets = lane_targets(
            ((lane.name, lane.min_prompt_tokens) for lane in default_lanes()), cost.prefill_s
        )
        lanes = tuple(replace(lane, ttft_target_s=targets[lane.name]) for lane in default_lanes())
        budget = prefill_budget_tokens(
            min(lane.ttft_target_s for lane in lanes),
            cost.per_prompt_token_s,
            cost.max_num_tokens,
            cost.context_chunking_policy,  # the simulated engine always chunks
        )
        return PolicyScheduler(
            PolicyConfig(
                lanes=lanes,
                kv=kv,
                predict=predict,
                continuous_batching=inflight,
                max_batches_in_flight=None if inflight else 1,
                prefill_budget_tokens=budget if inflight else None,
                fairness=fairness or FairnessConfig(),
            )
        )
    raise ValueError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")


def learn_outputs(sched: PolicyScheduler, served: list[SimRequest]) -> None:
    """What a deployed sidecar has learnt: the output lengths of requests it served before
    (the live bench's warm-up does the same with real requests)."""
    for r in served:
        request = Request(r.request_id, r.prompt_tokens, r.max_tokens, Urgency(r.urgency), r.tenant)
        lane = sched.classify(request)
        sched.predictor.observe(r.tenant, lane, r.max_tokens, r.output_tokens)


class _Run:
    def __init__(
        self,
        scenario: Scenario,
        target: str,
        engine: str,
        seed: int,
        qps: float | None,
        cost: CostProfile,
        kv_mode: KvMode,
        warmup: int = 0,
        requests: list[SimRequest] | None = None,
        fairness: FairnessConfig | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
        self.requests = requests if requests is not None else generate(scenario, seed, qps)
        slo = lane_slos(requests or generate(scenario, seed), cost)
        self.sched = make_scheduler(target, engine, cost, kv_mode, fairness)
        if isinstance(self.sched, PolicyScheduler) and warmup:
            learn_outputs(self.sched, generate(scenario, seed + WARMUP_SEED)[:warmup])
        self.engine: InflightEngine | StaticEngine = (
            StaticEngine(cost)
            if engine == "static"
            else InflightEngine(
                cost,
                contiguous=kv_mode is KvMode.CONTIGUOUS,
                reserve_max_tokens=engine == "inflight_noevict",
            )
        )
        self.result = RunResult(
            scenario.name,
            target,
            engine,
            qps or scenario.qps,
            scenario.duration_s,
            [Outcome(r, lane_of(r.prompt_tokens)) for r in self.requests],
            self.engine.totals,
            slo_s=slo,
        )
        self.by_id = {o.request.request_id: o for o in self.result.outcomes}
        self.seqs: dict[str, SimSequence] = {}
        self.events: list[tuple[float, int, str, str]] = []
        self.tick = itertools.count()
        self.stepping = False
        self.pending: StepResult | None = None
        self.wakes: set[float] = set()

    def push(self, when: float, kind: str, payload: str = "") -> None:
        heapq.heappush(self.events, (when, next(self.tick), kind, payload))

    def run(self) -> RunResult:
        for r in self.requests:
            self.push(r.arrival_s, "arrive", r.request_id)
        horizon = self.result.duration_s + DRAIN_S
        now = 0.0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if now > horizon:
                break
            if kind == "arrive":
                self.arrive(self.by_id[payload], now)
            elif kind == "step":
                self.stepping = False
                self.finish_step(now)
            self.decide(now)
        for outcome in self.result.outcomes:
            if outcome.state == "queued":
                outcome.state = "failed"  # still waiting or running when the run ended
        self.result.end_s = now
        if isinstance(self.sched, PolicyScheduler):
            self.result.counters = {str(e): n for e, n in self.sched.counters.items()}
        return self.result

    def arrive(self, outcome: Outcome, now: float) -> None:
        r = outcome.request
        if self.sched is None:
            self.send(outcome, 0)
            return
        deadline = None
        if self.result.target == "priority":
            deadline = now + PRIORITY_TIMEOUT_S[r.urgency]
        request = Request(
            r.request_id, r.prompt_tokens, r.max_tokens, Urgency(r.urgency), r.tenant, deadline
        )
        if isinstance(self.sched.submit(request, now), Rejected):
            outcome.state = "rejected"

    def send(self, outcome: Outcome, batch_id: int) -> None:
        r = outcome.request
        seq = SimSequence(r.request_id, r.prompt_tokens, r.output_tokens, r.max_tokens, batch_id)
        if self.engine.enqueue(seq):
            self.seqs[r.request_id] = seq
        else:
            # Refused by the engine's queue: fast for Triton alone, after acceptance otherwise.
            outcome.state = "rejected" if self.sched is None else "failed"
            if self.sched is not None:
                self.sched.cancel(r.request_id, 0.0)

    def decide(self, now: float) -> None:
        if self.sched is not None:
            for decision in self.sched.schedule(now):
                outcome = self.by_id[decision.request_id]
                if isinstance(decision, Expired):
                    outcome.state = "failed"
                elif isinstance(decision, Dispatch) and decision.batch is not None:
                    self.result.batch_padding.append(decision.batch.padding_ratio)
                    self.result.batch_utilization.append(decision.batch.utilization)
                    self.send(outcome, decision.batch.batch_id)
                else:
                    self.send(outcome, 0)
            wake = self.sched.next_wakeup(now)
            if wake is not None and wake > now and wake not in self.wakes:
                self.wakes.add(wake)
                self.push(wake, "wake")
        if not self.stepping and self.engine.busy():
            step = self.engine.step()
            self.pending = step
            self.stepping = True
            self.push(now + step.duration_s, "step")

    def finish_step(self, now: float) -> None:
        step = self.pending
        assert step is not None
        for seq in step.first_token:
            self.by_id[seq.request_id].first_token_s = now
        for seq in step.finished:
            outcome = self.by_id[seq.request_id]
            outcome.done_s, outcome.state = now, "served"
            if self.sched is not None:
                self.sched.on_done(seq.request_id, now, seq.generated)
        if self.sched is not None:
            for seq in step.progressed:
                first = seq.generated == 1  # prefilled: frees the lane's prefill share
                every = PROGRESS_EVERY_TOKENS
                if (first or seq.generated % every == 0) and seq.generated < seq.output_tokens:
                    self.sched.on_progress(seq.request_id, seq.generated, now)
            if isinstance(self.engine, InflightEngine):
                self.sched.observe_kv(self.engine.free_blocks, self.engine.total_blocks, now)


def simulate(
    scenario: Scenario,
    target: str,
    engine: str = "inflight",
    seed: int = 0,
    qps: float | None = None,
    cost: CostProfile | None = None,
    kv_mode: KvMode = KvMode.PAGED,
    warmup: int = 0,
) -> RunResult:
    """One seeded run of `scenario` against `target` on `engine`; the policy first learns the
    output lengths of `warmup` earlier requests of the same mix. `cost`: the engine's cost profile
    (default: the A100 estimate the simulator's tables use)."""
    profile = cost if cost is not None else load_profile(DEFAULT_SIM_PROFILE)
    return _Run(scenario, target, engine, seed, qps, profile, kv_mode, warmup).run()


def simulate_requests(
    name: str,
    requests: list[SimRequest],
    duration_s: float,
    cost: CostProfile | None = None,
    fairness: FairnessConfig | None = None,
) -> RunResult:
    """The policy on an in-flight engine over these requests (arrival order, tenants their
    own) rather than a scenario's mix: the tenant-fairness bench's arrivals, run as the live
    sidecar runs them."""
    profile = cost if cost is not None else load_profile(DEFAULT_SIM_PROFILE)
    scenario = Scenario(name, "given requests", 1.0, duration_s, ())
    return _Run(
        scenario, "policy", "inflight", 0, None, profile, KvMode.PAGED, 0, requests, fairness
    ).run()


def with_duration(scenario: Scenario, duration_s: float) -> Scenario:
    return replace(scenario, duration_s=duration_s)
