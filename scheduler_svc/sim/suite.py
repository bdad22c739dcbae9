"""A whole simulation run: scenarios x engines x targets, summarized, plus QPS at the SLO.

`GOLDEN` is the small, fixed suite whose summaries are stored in tests/data/sim_golden.json and
compared by the tests; `scheduler-svc simulate --write-golden` regenerates them when the policy
changes on purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from scheduler_svc.core.config import KvMode
from scheduler_svc.sim.costmodel import A100_AWQ_8B
from scheduler_svc.sim.report import qps_at_slo, summarize
from scheduler_svc.sim.runner import ENGINES, TARGETS, RunResult, simulate, with_duration
from scheduler_svc.sim.workload import SCENARIOS, Scenario


@dataclass(frozen=True)
class SuiteParams:
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    engines: tuple[str, ...] = ENGINES
    targets: tuple[str, ...] = TARGETS
    seed: int = 0
    duration_scale: float = 1.0  # multiplies each scenario's duration
    slo_search: bool = True  # bisect for QPS at SLO (every engine; not for the burst)
    kv_mode: str = "paged"  # "contiguous" replays the source document's "before" allocation


GOLDEN = SuiteParams(duration_scale=0.25, slo_search=False)


def run_suite(params: SuiteParams, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every run's summary, with the parameters and the cost model's constants."""
    unknown = [s for s in params.scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown} (choose from {', '.join(SCENARIOS)})")
    kv = KvMode(params.kv_mode)
    rows: list[dict[str, Any]] = []
    for name in params.scenarios:
        scenario = with_duration(
            SCENARIOS[name], SCENARIOS[name].duration_s * params.duration_scale
        )
        for engine in params.engines:
            for target in params.targets:
                if progress is not None:
                    progress(f"{name} / {engine} / {target}")
                summary = summarize(simulate(scenario, target, engine, params.seed, kv_mode=kv))
                if params.slo_search and name != "burst":

                    def run_at(
                        qps: float, s: Scenario = scenario, t: str = target, e: str = engine
                    ) -> RunResult:
                        return simulate(s, t, e, params.seed, qps, kv_mode=kv)

                    summary["qps_at_slo"] = qps_at_slo(run_at, lo=0.5, hi=4 * scenario.qps)
                rows.append(summary)
    return {"params": _plain(params), "cost_model": asdict(A100_AWQ_8B), "runs": rows}


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
