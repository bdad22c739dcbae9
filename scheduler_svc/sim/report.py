"""Summaries of simulated runs: the figures of the source document's table, and QPS at an SLO.

A run meets the SLO by the rule every measurement uses (core/slo.py): every lane's P99 time to
first token within its bound (`runner.lane_slos`: 5x its unloaded median, at least 250 ms), at
most 1 % of requests refused or failed and, where the run asks for it (the KV projection), the
P99 time per output token within a bound; "QPS at SLO" is the highest offered rate, found by
bisection over seeded runs, that still meets it. Goodput counts requests served within their
lane's bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from scheduler_svc.core.slo import meets, percentile
from scheduler_svc.sim.simulate import LANES, RunResult


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def summarize(run: RunResult) -> dict[str, Any]:
    """Every figure of one run, JSON-ready (times in ms, ratios in [0, 1])."""
    outcomes = run.outcomes
    n = len(outcomes)
    served = [o for o in outcomes if o.state == "served"]
    good = sum(o.within_slo(run.slo_s) for o in outcomes)
    lanes: dict[str, Any] = {}
    for lane in LANES:
        mine = [o for o in outcomes if o.lane == lane]
        ttft = [o.ttft_s for o in mine if o.state == "served" and o.ttft_s is not None]
        e2e = [o.e2e_s for o in mine if o.state == "served" and o.e2e_s is not None]
        tpot = [o.tpot_s for o in mine if o.state == "served" and o.tpot_s is not None]
        if mine:
            lanes[lane] = {
                "requests": len(mine),
                "ttft_p50_ms": _ms(percentile(ttft, 50)),
                "ttft_p99_ms": _ms(percentile(ttft, 99)),
                "e2e_p99_ms": _ms(percentile(e2e, 99)),
                "tpot_p99_ms": _ms(percentile(tpot, 99)),
                "within_slo": round(sum(o.within_slo(run.slo_s) for o in mine) / len(mine), 4),
            }
    totals = run.engine_totals
    # Padding: what the engine padded (static), else the sidecar's batches (in-flight engines
    # do not pad, but the batches show the bucketing). Utilization: the sidecar's batches over
    # their lane's max batch where there are any, else the engine's rows over its row limit.
    padding: float | None = _mean(run.batch_padding)
    if run.engine == "static" and totals.padded_prompt_tokens:
        padding = 1 - totals.prompt_tokens / totals.padded_prompt_tokens
    utilization: float | None = _mean(run.batch_utilization)
    if utilization is None and run.engine == "static" and totals.batches:
        utilization = totals.batch_rows / (totals.batches * totals.row_limit)
    elif utilization is None and totals.steps:
        utilization = totals.rows / (totals.steps * totals.row_limit)
    span = max(run.duration_s, 1e-9)
    return {
        "scenario": run.scenario,
        "target": run.target,
        "engine": run.engine,
        "offered_qps": round(run.qps, 2),
        "requests": n,
        "throughput_rps": round(len(served) / span, 2),
        "goodput_rps": round(good / span, 2),
        "slo_attainment": round(good / n, 4) if n else None,
        "rejected_fast": sum(o.state == "rejected" for o in outcomes),
        "failed_after_accept": sum(o.state == "failed" for o in outcomes),
        "failure_rate": round(sum(o.state != "served" for o in outcomes) / n, 4) if n else None,
        "padding_ratio": None if padding is None else round(padding, 4),
        "batch_utilization": None if utilization is None else round(utilization, 4),
        "kv_fragmentation": (
            round(1 - totals.slots_used / totals.slots_allocated, 4)
            if totals.slots_allocated
            else None
        ),
        "kv_utilization": (
            round(totals.blocks_held / (totals.steps * totals.pool_blocks), 4)
            if totals.pool_blocks and totals.steps
            else None
        ),
        "rows_per_step": round(totals.rows / totals.steps, 1) if totals.steps else None,
        "paused": totals.paused,
        "lanes": lanes,
        "counters": dict(sorted(run.counters.items())),
    }


def meets_slo(run: RunResult, tpot_bound_s: float | None = None) -> bool:
    """Every lane's P99 TTFT within its bound, at most 1 % not served (core/slo.py), and the
    P99 time per output token within `tpot_bound_s` where one is given."""
    served = [o for o in run.outcomes if o.state == "served" and o.ttft_s is not None]
    ttft: dict[str, list[float]] = {}
    for o in served:
        ttft.setdefault(o.lane, []).append(o.ttft_s or 0.0)
    if not meets(ttft, run.slo_s, len(run.outcomes), len(served)):
        return False
    if tpot_bound_s is None:
        return True
    worst = percentile([o.tpot_s for o in served if o.tpot_s is not None], 99)
    return worst is None or worst <= tpot_bound_s


class RateSearch:
    """Bisection over offered rates for the highest one that meets a target, without I/O: ask
    `next_rate()`, run a trial there however the caller runs trials (the simulator at once,
    `scheduler-svc bench` against a live stack), `record` whether it met the target. QPS at
    the P99 SLO is this search with an SLO predicate; both harnesses share it.

    The first trial is at `lo`; if it fails the answer is 0. Then `iterations` halvings of
    [lo, hi]. `rate` is the highest rate that met the target, `tried` every (rate, met)."""

    def __init__(self, lo: float, hi: float, iterations: int) -> None:
        if not 0 < lo < hi:
            raise ValueError(f"need 0 < lo < hi (got {lo}, {hi})")
        self.lo, self.hi, self.left = lo, hi, iterations
        self.tried: list[tuple[float, bool]] = []

    def next_rate(self) -> float | None:
        """Where to try next; None when the search is over."""
        if not self.tried:
            return self.lo
        if not self.tried[0][1] or self.left == 0:
            return None
        return (self.lo + self.hi) / 2

    def record(self, rate: float, met: bool) -> None:
        if self.tried:
            self.left -= 1
            self.lo, self.hi = (rate, self.hi) if met else (self.lo, rate)
        self.tried.append((rate, met))

    @property
    def rate(self) -> float:
        return self.lo if self.tried and self.tried[0][1] else 0.0


def highest_rate(
    meets: Callable[[float], bool], lo: float, hi: float, iterations: int = 7
) -> RateSearch:
    """A whole `RateSearch` with a predicate that runs its own trials."""
    search = RateSearch(lo, hi, iterations)
    while (rate := search.next_rate()) is not None:
        search.record(rate, meets(rate))
    return search


def _cell(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and unit == "%":
        return f"{value * 100:.1f}%"
    return f"{value}{unit}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of summaries, one row per (scenario, engine, target)."""
    header = [
        "scenario", "engine", "target", "offered QPS", "QPS at SLO", "goodput",
        *(f"{lane} TTFT p99" for lane in LANES),
        "padding", "batch util", "KV frag", "fast rejects", "failed after accept",
    ]  # fmt: skip
    cells = [
        [
            r["scenario"],
            r["engine"],
            r["target"],
            _cell(r["offered_qps"]),
            _cell(r.get("qps_at_slo")),
            _cell(r["goodput_rps"]),
            *(_cell(r["lanes"].get(lane, {}).get("ttft_p99_ms"), " ms") for lane in LANES),
            _cell(r["padding_ratio"], "%"),
            _cell(r["batch_utilization"], "%"),
            _cell(r["kv_fragmentation"], "%"),
            _cell(r["rejected_fast"]),
            _cell(r["failed_after_accept"]),
        ]
        for r in rows
    ]
    return _markdown(header, cells)


def kv_table(rows: list[dict[str, Any]], suffix: str = "") -> str:
    """Issue 15's table: QPS at the SLO (`qps_at_slo` + `suffix`) per (scenario, engine,
    target), over Triton alone on guaranteed_no_evict and on the same engine, with pauses and
    KV use in the run at that rate."""
    field = f"qps_at_slo{suffix}"
    qps = {(r["scenario"], r["engine"], r["target"]): r.get(field) for r in rows}
    header = [
        "scenario", "engine", "target", "QPS at SLO", "÷ Triton alone, no_evict",
        "÷ Triton alone, same engine", "pauses there (per request)", "KV blocks in use",
        "rows per step",
    ]  # fmt: skip
    cells = []
    for r in rows:
        at = r.get(f"at_slo{suffix}") or {}
        rate = r.get(field)
        paused = at.get("paused")
        per_request = None if paused is None else f"{paused} ({paused / at['requests']:.1%})"
        cells.append(
            [
                r["scenario"],
                r["engine"],
                r["target"],
                _cell(rate),
                _ratio(rate, qps.get((r["scenario"], "inflight_noevict", "fifo"))),
                _ratio(rate, qps.get((r["scenario"], r["engine"], "fifo"))),
                _cell(per_request),
                _cell(at.get("kv_utilization"), "%"),
                _cell(at.get("rows_per_step")),
            ]
        )
    return _markdown(header, cells)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}×" if value and base else "—"
