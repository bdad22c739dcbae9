"""A whole simulation run: scenarios x engines x targets, summarized, plus QPS at the SLO.

`GOLDEN` is the small, fixed suite whose summaries are stored in tests/data/sim_golden.json and
compared by the tests; `make sim-golden` regenerates them when the policy
changes on purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

from scheduler_svc.core.config import KvMode
from scheduler_svc.profiles import load_profile
from scheduler_svc.sim.report import highest_rate, meets_slo, summarize
from scheduler_svc.sim.simulate import (
    DEFAULT_SIM_PROFILE,
    TARGETS,
    RunResult,
    simulate,
    with_duration,
)
from scheduler_svc.sim.workload import DOCUMENT_SCENARIOS, KV_SCENARIOS, SCENARIOS, Scenario


@dataclass(frozen=True)
class SuiteParams:
    scenarios: tuple[str, ...] = DOCUMENT_SCENARIOS
    engines: tuple[str, ...] = ("inflight", "static")  # the source document's comparison
    targets: tuple[str, ...] = TARGETS
    seed: int = 0
    duration_scale: float = 1.0  # multiplies each scenario's duration
    slo_search: bool = True  # bisect for QPS at SLO (every engine; not for the burst)
    kv_mode: str = "paged"  # "contiguous" replays the source document's "before" allocation
    profile: str = DEFAULT_SIM_PROFILE  # a bundled cost profile's name, or a profile file
    max_num_sequences: int | None = None  # the engine's sequence limit; None: the profile's
    kv_blocks: int | None = None  # the KV pool in blocks; None: what the profile's GPU leaves
    warmup: int = 0  # output lengths the policy has learnt before a run (as a deployed one has)
    # A second QPS-at-SLO search that also bounds every request's time per output token
    # (`qps_at_slo_tpot`): what engine pauses and overcommitted KV cost shows there, not in TTFT.
    tpot_slo_s: float | None = None


GOLDEN = SuiteParams(duration_scale=0.25, slo_search=False)
# Issue 15's KV pressure on the A100 model: both of TensorRT-LLM's KV policies, Triton alone and
# the policy, with a sequence limit (256) high enough that guaranteed_no_evict's reservations,
# not the limit, bind first.
KV_PROJECTION = SuiteParams(
    scenarios=KV_SCENARIOS,
    engines=("inflight_noevict", "inflight"),
    targets=("fifo", "policy"),
    max_num_sequences=256,
    warmup=64,
    tpot_slo_s=0.05,
)


def run_suite(params: SuiteParams, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every run's summary, with the parameters and the cost profile's constants."""
    unknown = [s for s in params.scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown} (choose from {', '.join(SCENARIOS)})")
    if params.kv_blocks is not None and params.kv_blocks < 1:
        raise ValueError(f"the KV pool must hold at least one block (got {params.kv_blocks})")
    kv = KvMode(params.kv_mode)
    cost = load_profile(params.profile)
    if params.max_num_sequences is not None:
        cost = replace(cost, max_num_sequences=params.max_num_sequences)
    if params.kv_blocks is not None:
        cost = cost.with_pool_blocks(params.kv_blocks)
    rows: list[dict[str, Any]] = []
    for name in params.scenarios:
        scenario = with_duration(
            SCENARIOS[name], SCENARIOS[name].duration_s * params.duration_scale
        )
        for engine in params.engines:
            for target in params.targets:
                if progress is not None:
                    progress(f"{name} / {engine} / {target}")
                summary = summarize(
                    simulate(scenario, target, engine, params.seed, None, cost, kv, params.warmup)
                )
                if params.slo_search and name != "burst":

                    def run_at(
                        qps: float, s: Scenario = scenario, t: str = target, e: str = engine
                    ) -> RunResult:
                        return simulate(s, t, e, params.seed, qps, cost, kv, params.warmup)

                    bounds: dict[str, float | None] = {"": None}
                    if params.tpot_slo_s is not None:
                        bounds["_tpot"] = params.tpot_slo_s
                    for suffix, bound in bounds.items():
                        rate = highest_rate(
                            partial(_meets, run_at, bound), lo=0.5, hi=4 * scenario.qps
                        ).rate
                        summary[f"qps_at_slo{suffix}"] = round(rate, 2)
                        if rate:  # the run at that rate, as the KV table reports it
                            summary[f"at_slo{suffix}"] = _at_slo(summarize(run_at(rate)))
                rows.append(summary)
    return {"params": _plain(params), "cost_profile": asdict(cost), "runs": rows}


def _meets(run_at: Callable[[float], RunResult], bound: float | None, qps: float) -> bool:
    return meets_slo(run_at(qps), bound)


def _at_slo(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("requests", "goodput_rps", "paused", "kv_utilization", "rows_per_step")
    return {k: summary[k] for k in keys}


def _plain(params: SuiteParams) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(params).items()}


def ratios(runs: Iterable[dict[str, Any]], field: str, base: str = "fifo") -> dict[str, float]:
    """`field` of the policy over the `base` target, per (scenario, engine), where both exist."""
    index = {(r["scenario"], r["engine"], r["target"]): r.get(field) for r in runs}
    out: dict[str, float] = {}
    for (scenario, engine, target), value in index.items():
        ref = index.get((scenario, engine, base))
        if target == "policy" and value is not None and ref:
            out[f"{scenario}/{engine}"] = round(value / ref, 2)
    return out
