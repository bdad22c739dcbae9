"""What `scheduler-svc bench` writes: results.json (every figure and the run's parameters),
results.md (tables shaped like the source document's) and PNG plots.

Just over 500 lines: the deadline plan's tables and the below plan's noise floor (issue 28)
share this module's table helpers (`runs_at`, `_lane`, `_refused`, `table_lines`) and would
otherwise import them back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler_svc.tools.bench import plan as P  # noqa: N812 - read as the plan's namespace
from scheduler_svc.tools.bench.plan import ENDS_ITSELF, LANES, TARGET_NAMES, TARGETS, ratio

KV_ENGINE_NAMES = {
    "kv_noevict": "guaranteed_no_evict",
    "kv_maxutil": "max_utilization",
}


def fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return text + unit
    return f"{value}{unit}"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def table_lines(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def runs_at(results: dict[str, Any], engine: str, mix: str, load: float) -> dict[str, Any]:
    """The summaries of one step, by target."""
    return {
        r["target"]: r["summary"]
        for r in results["runs"]
        if r["engine"] == engine and r["mix"] == mix and r["load"] == load
    }


def steps(results: dict[str, Any]) -> list[tuple[str, str, float]]:
    seen: list[tuple[str, str, float]] = []
    for r in results["runs"]:
        key = (r["engine"], r["mix"], r["load"])
        if key not in seen:
            seen.append(key)
    return seen


def _lane(summary: dict[str, Any], lane: str, key: str) -> Any:
    return summary["lanes"].get(lane, {}).get(key)


def _worst_lane(summary: dict[str, Any], key: str) -> float | None:
    values = [v[key] for v in summary["lanes"].values() if v.get(key) is not None]
    return max(values) if values else None


HEADLINE: list[tuple[str, Any, str]] = [
    ("goodput (req/s within SLO)", lambda s: s["goodput_rps"], ""),
    ("throughput (req/s served)", lambda s: s["throughput_rps"], ""),
    ("hot P50 TTFT", lambda s: _lane(s, "hot", "ttft_p50_ms"), " ms"),
    ("hot P99 TTFT", lambda s: _lane(s, "hot", "ttft_p99_ms"), " ms"),
    ("worst lane P99 TTFT", lambda s: _worst_lane(s, "ttft_p99_ms"), " ms"),
    ("worst lane P99 end-to-end", lambda s: _worst_lane(s, "e2e_p99_ms"), " ms"),
    ("prompt padding (engine)", lambda s: s["padding_ratio"], "%"),
    ("idle generation slots (engine)", lambda s: s.get("generation_waste"), "%"),
    ("slot occupancy (engine)", lambda s: s["slot_occupancy"], "%"),
    ("KV fragmentation (engine)", lambda s: s["kv_fragmentation"], "%"),
    ("rejected fast", lambda s: s["rejected_fast"], ""),
    ("rejected after queueing", lambda s: s["rejected_queued"], ""),
    ("failed after acceptance", lambda s: s["failed"], ""),
    ("refusals within 50 ms", lambda s: s.get("refused_fast_share"), "%"),
    ("failed or past SLO (the document's burst figure)", lambda s: s.get("failed_or_late"), "%"),
    ("client send lag P99 (host stalls)", lambda s: s.get("send_lag_p99_ms"), " ms"),
    ("runs repeated after a stall", lambda s: s.get("reruns"), ""),
]


# Rows about the measurement itself, not the scheduler: no policy ÷ Triton ratio.
NO_RATIO = {"client send lag P99 (host stalls)", "runs repeated after a stall"}


def headline(results: dict[str, Any], engine: str, mix: str, load: float) -> list[str]:
    by_target = runs_at(results, engine, mix, load)
    targets = [*TARGETS, *(t for t in by_target if t not in TARGETS)]
    unloaded = results.get("calibration", {}).get(engine, {}).get("unloaded_ttft_ms", {})
    rows = []
    for name, get, unit in HEADLINE:
        values = [get(by_target[t]) if t in by_target else None for t in targets]
        cells = [pct(v) if unit == "%" else fmt(v, unit) for v in values]
        r = ratio(values[2], values[0]) if unit != "%" and name not in NO_RATIO else None
        rows.append([name, *cells, fmt(r, "×")])
        if name == "hot P99 TTFT" and unloaded.get("hot"):
            # The issue 14 target: a short prompt's P99 against its unloaded median.
            times = [ratio(v, unloaded["hot"]) for v in values]
            rows.append(["hot P99 TTFT ÷ unloaded", *(fmt(t, "×") for t in times), ""])
    header = ["", *(TARGET_NAMES[t] for t in targets), "policy ÷ Triton"]
    return table_lines(header, rows)


def all_runs(results: dict[str, Any]) -> list[str]:
    header = [
        "engine", "mix", "load", "target", "offered/s", "goodput/s", "served/s",
        *(f"{lane} TTFT p50/p99 ms" for lane in LANES),
        "e2e p99 ms", "padding", "idle gen", "occupancy", "KV frag",
        "rej. fast", "rej. queued", "failed",
    ]  # fmt: skip
    rows = []
    for r in results["runs"]:
        s = r["summary"]
        lanes = [
            f"{fmt(_lane(s, lane, 'ttft_p50_ms'))} / {fmt(_lane(s, lane, 'ttft_p99_ms'))}"
            if lane in s["lanes"]
            else "–"
            for lane in LANES
        ]
        rows.append(
            [
                r["engine"], r["mix"], f"{r['load']:g}×", TARGET_NAMES[r["target"]],
                fmt(r["offered_rps"]), fmt(s["goodput_rps"]), fmt(s["throughput_rps"]),
                *lanes, fmt(_worst_lane(s, "e2e_p99_ms")), pct(s["padding_ratio"]),
                pct(s.get("generation_waste")), pct(s["slot_occupancy"]),
                pct(s["kv_fragmentation"]),
                str(s["rejected_fast"]), str(s["rejected_queued"]), str(s["failed"]),
            ]
        )  # fmt: skip
    return table_lines(header, rows)


def calibration(results: dict[str, Any]) -> list[str]:
    rows = []
    for engine, cal in results["calibration"].items():
        for mix, rps in cal["capacity_rps"].items():
            ttft = cal["unloaded_ttft_ms"]
            slo = cal["slo_ttft_ms"]
            rows.append(
                [
                    engine,
                    mix,
                    fmt(rps),
                    " / ".join(fmt(ttft.get(lane)) for lane in LANES),
                    " / ".join(fmt(slo.get(lane)) for lane in LANES),
                ]
            )
    header = [
        "engine", "mix", "capacity (req/s)", "unloaded TTFT hot/warm/cold ms", "SLO TTFT ms",
    ]  # fmt: skip
    return table_lines(header, rows)


def overhead(results: dict[str, Any]) -> list[str]:
    o = results["overhead"]
    rows = [
        [
            TARGET_NAMES[t],
            str(o[t]["n"]),
            fmt(o[t].get("ttft_p50_ms"), " ms"),
            fmt(o[t].get("added_ttft_p50_ms"), " ms"),
            fmt(o[t]["e2e_p50_ms"], " ms"),
            fmt(o[t]["e2e_p99_ms"], " ms"),
            fmt(o[t]["added_p50_ms"], " ms"),
        ]
        for t in TARGET_NAMES
        if t in o
    ]
    header = [
        "target", "requests", "P50 TTFT", "added P50 TTFT", "P50 end-to-end", "P99 end-to-end",
        "added P50",
    ]  # fmt: skip
    return table_lines(header, rows)


def _searched(results: dict[str, Any]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """The QPS-at-SLO searches by (engine, mix), then by target."""
    out: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in results.get("slo_search", []):
        out.setdefault((row["engine"], row["mix"]), {})[row["target"]] = row
    return out


def qps_at_slo(results: dict[str, Any]) -> list[str]:
    """The document's metric: the highest offered rate meeting every lane's P99 TTFT SLO."""
    rows = []
    for (engine, mix), by_target in _searched(results).items():
        qps = [by_target.get(t, {}).get("qps_at_slo") for t in TARGETS]
        triton, policy = qps[0], qps[2]
        rows.append([engine, mix, *(fmt(q, "/s") for q in qps), fmt(ratio(policy, triton), "×")])
    header = ["engine", "mix", *(TARGET_NAMES[t] for t in TARGETS), "policy ÷ Triton"]
    return table_lines(header, rows)


def slo_matrix(results: dict[str, Any], engine: str, mix: str) -> list[str]:
    """The document's parameter matrix: each target at its QPS at SLO, and what the engine did
    there."""
    by_target = _searched(results).get((engine, mix), {})
    base = by_target.get("triton", {}).get("qps_at_slo")
    rows = []
    for target, row in by_target.items():
        at = row.get("at_slo") or {}
        rows.append(
            [
                TARGET_NAMES[target],
                fmt(row["qps_at_slo"], "/s"),
                fmt(ratio(row["qps_at_slo"], base), "×"),
                fmt(_worst_lane(at, "ttft_p99_ms") if at else None, " ms"),
                pct(at.get("slot_occupancy")),
                pct(at.get("padding_ratio")),
                pct(at.get("generation_waste")),
                str(len(row["trials"])),
            ]
        )
    header = [
        "target (max_ratio / timeout)",
        "QPS at SLO",
        "÷ Triton alone",
        "worst lane P99 TTFT",
        "slot occupancy",
        "prompt padding",
        "idle generation slots",
        "trials",
    ]
    return table_lines(header, rows)


def kv_pressure(results: dict[str, Any]) -> list[str]:
    """Issue 15's table: QPS at the P99 SLO under KV pressure, against Triton alone on
    guaranteed_no_evict and on the same engine, with what the engine did at that rate."""
    searched = {
        (engine, row["target"]): row
        for (engine, mix), by_target in _searched(results).items()
        if mix in ENDS_ITSELF
        for row in by_target.values()
    }
    if not searched:
        return []
    base = searched.get(("kv_noevict", "triton"), {}).get("qps_at_slo")
    rows = []
    for (engine, target), row in searched.items():
        same = searched.get((engine, "triton"), {}).get("qps_at_slo")
        at = row.get("at_slo") or {}
        rows.append(
            [
                KV_ENGINE_NAMES.get(engine, engine),
                TARGET_NAMES[target],
                fmt(row["qps_at_slo"], "/s"),
                fmt(ratio(row["qps_at_slo"], base), "×"),
                fmt(ratio(row["qps_at_slo"], same), "×"),
                fmt(at.get("goodput_rps"), "/s"),
                fmt(at.get("engine_pauses")),
                pct(at.get("pauses_per_request")),
                pct(at.get("kv_utilization")),
                pct(at.get("slot_occupancy")),
                fmt(_worst_lane(at, "ttft_p99_ms") if at else None, " ms"),
                fmt(_worst_lane(at, "tpot_p99_ms") if at else None, " ms"),
                str(len(row["trials"])),
            ]
        )
    header = [
        "engine",
        "target",
        "QPS at SLO",
        "÷ Triton alone, no_evict",
        "÷ Triton alone, same engine",
        "goodput there",
        "engine pauses there",
        "pauses per request",
        "KV blocks in use",
        "slot occupancy",
        "P99 TTFT",
        "P99 time per output token",
        "trials",
    ]
    return table_lines(header, rows)


def top_load(results: dict[str, Any], engine: str, mix: str) -> float:
    return max(load for e, m, load in steps(results) if e == engine and m == mix)


def markdown(results: dict[str, Any]) -> str:
    p = results["parameters"]
    lines = [
        f"# scheduler-svc bench ({p['plan']})",
        "",
        f"`{p['command']}`, seed {p['seed']}, started {p['started_utc']}, took "
        f"{p['wall_s'] / 60:.1f} min on {p['machine']['cpus']} CPUs "
        f"({p['machine']['platform']}).",
        f"SLO: {p['slo']['rule']}; a refusal within {p['slo']['fast_reject_s'] * 1000:.0f} ms "
        "is fast.",
        "",
        "## Calibration",
        "",
        *calibration(results),
        "",
    ]
    pairs: list[tuple[str, str]] = []
    for engine, mix, _ in steps(results):
        if (engine, mix) not in pairs:
            pairs.append((engine, mix))
    for engine, mix in pairs:
        load = top_load(results, engine, mix)
        lines += [f"## {mix}, {engine} engine, {load:g}× capacity", ""]
        lines += [*headline(results, engine, mix, load), ""]
    if results.get("parameters", {}).get("plan") == "deadline":
        lines += deadline_sections(results)
    floor = noise_floor(results)
    if len(floor) > 2:
        lines += ["## Below saturation against the noise floor (Triton alone run twice)", ""]
        lines += [*floor, ""]
    kv = kv_pressure(results)
    if kv:
        lines += ["## KV pressure: QPS at the P99 SLO with a generous max_tokens", "", *kv, ""]
    if results.get("slo_search"):
        lines += ["## QPS at the P99 SLO", "", *qps_at_slo(results), ""]
        for engine, mix in _searched(results):
            lines += [f"### {mix}, {engine} engine, at the P99 SLO", ""]
            lines += [*slo_matrix(results, engine, mix), ""]
    if "overhead" in results:
        lines += ["## Sidecar overhead (short requests, one at a time)", "", *overhead(results)]
        lines += [""]
    if results["runs"]:
        lines += ["## Every run", "", *all_runs(results), ""]
    return "\n".join(lines)


def _refused(summary: dict[str, Any]) -> int:
    return int(summary["rejected_fast"] + summary["rejected_queued"])


def below_saturation(results: dict[str, Any], other: str) -> list[str]:
    """Issue 28's second target: every lane's P99 TTFT through `other` over Triton alone's at
    the same arrivals, and what was refused, at each load below capacity."""
    rows = []
    for engine, mix, load in steps(results):
        if load >= 1.0 or mix == "burst":
            continue
        by_target = runs_at(results, engine, mix, load)
        base, mine = by_target.get("triton"), by_target.get(other)
        if base is None or mine is None:
            continue
        cells, ratios = [], []
        for lane in (lane for lane in LANES if lane in mine["lanes"]):
            a99 = base["lanes"].get(lane, {}).get("ttft_p99_ms")
            b99 = mine["lanes"][lane].get("ttft_p99_ms")
            lane_ratio = ratio(b99, a99)
            ratios.append(lane_ratio or 0.0)
            cells.append(f"{lane} {fmt(a99)} → {fmt(b99)} ms ({fmt(lane_ratio, '×')})")
        worst = max(ratios, default=None)
        rows.append(
            [
                mix,
                f"{load:g}×",
                str(mine["requests"]),
                "; ".join(cells),
                fmt(worst, "×"),
                f"{_refused(mine)} ({_refused(base)})",
            ]
        )
    header = [
        "mix", "load", "requests", "P99 TTFT per lane: Triton alone → sidecar",
        "worst lane ratio", "refused: sidecar (Triton alone)",
    ]  # fmt: skip
    return table_lines(header, rows)


def noise_floor(results: dict[str, Any]) -> list[str]:
    """Each step run with Triton alone twice (the below plan): every lane's P99 TTFT through
    make run's sidecar and through Triton alone again, each over the first Triton alone run's on
    the same arrivals. The second ratio is what the same thing scores against itself here."""
    by_step: dict[int, dict[str, dict[str, Any]]] = {}
    for r in results["runs"]:
        if "step" in r:
            by_step.setdefault(r["step"], {})[r["target"]] = r
    rows = []
    for runs in by_step.values():
        base, again = runs.get("triton"), runs.get(P.TRITON_AGAIN)
        mine = runs.get(P.DEFAULTS_TARGET)
        if base is None or again is None or mine is None:
            continue
        cells = []
        worst: dict[str, float] = {}
        for lane in LANES:
            a99 = _lane(base["summary"], lane, "ttft_p99_ms")
            if a99 is None:
                continue
            parts = []
            for name, run in (("sidecar", mine), ("again", again)):
                r = ratio(_lane(run["summary"], lane, "ttft_p99_ms"), a99)
                worst[name] = max(worst.get(name, 0.0), r or 0.0)
                parts.append(fmt(r, "×"))
            cells.append(f"{lane} {fmt(a99)} ms: {' / '.join(parts)}")
        rows.append(
            [
                base["mix"],
                f"{base['load']:g}×",
                str(base["summary"]["requests"]),
                "; ".join(cells),
                fmt(worst.get("sidecar"), "×"),
                fmt(worst.get("again"), "×"),
                f"{_refused(mine['summary'])} ({_refused(again['summary'])})",
            ]
        )
    header = [
        "mix", "load", "requests",
        "P99 TTFT per lane: Triton alone; sidecar ÷ it / Triton alone again ÷ it",
        "worst lane: sidecar", "worst lane: Triton alone again",
        "refused: sidecar (Triton alone again)",
    ]  # fmt: skip
    return table_lines(header, rows)


def slo_against(results: dict[str, Any], other: str) -> list[str]:
    """QPS at the P99 SLO through `other` and Triton alone, over each other and as a share of
    the engine's closed-loop capacity (the ceiling)."""
    rows = []
    for (engine, mix), by_target in _searched(results).items():
        base = by_target.get("triton", {}).get("qps_at_slo")
        mine = by_target.get(other, {}).get("qps_at_slo")
        capacity = (by_target.get("triton") or by_target.get(other) or {}).get("capacity_rps")
        rows.append(
            [
                engine,
                mix,
                fmt(capacity, "/s"),
                fmt(ratio(capacity, base), "×"),
                fmt(base, "/s"),
                fmt(mine, "/s"),
                fmt(ratio(mine, base), "×"),
                fmt(ratio(mine, capacity), ""),
            ]
        )
    header = [
        "engine", "mix", "capacity (closed loop)", "ceiling (capacity ÷ Triton alone)",
        "Triton alone", TARGET_NAMES[other], "sidecar ÷ Triton alone", "sidecar ÷ capacity",
    ]  # fmt: skip
    return table_lines(header, rows)


def overload(results: dict[str, Any], other: str) -> list[str]:
    """Issue 28's fifth target: past capacity, the short-prompt tail over its unloaded median,
    refusals answered fast, goodput, and requests lost after acceptance."""
    rows = []
    for engine, mix, load in steps(results):
        if load < 1.0:
            continue
        unloaded = results["calibration"][engine]["unloaded_ttft_ms"].get("hot")
        by_target = runs_at(results, engine, mix, load)
        for target in ("triton", other):
            summary = by_target.get(target)
            if summary is None:
                continue
            hot = summary["lanes"].get("hot", {}).get("ttft_p99_ms")
            rows.append(
                [
                    f"{mix} {load:g}×",
                    TARGET_NAMES[target],
                    fmt(hot, " ms"),
                    fmt(ratio(hot, unloaded), "×"),
                    pct(summary["refused_fast_share"]),
                    fmt(summary["goodput_rps"], "/s"),
                    fmt(ratio(summary["goodput_rps"], by_target["triton"]["goodput_rps"]), "×"),
                    str(summary["failed"]),
                ]
            )
    header = [
        "run", "target", "hot P99 TTFT", "÷ unloaded hot", "refusals within 50 ms", "goodput",
        "÷ Triton alone", "failed after acceptance",
    ]  # fmt: skip
    return table_lines(header, rows)


def deadline_sections(results: dict[str, Any]) -> list[str]:
    """The deadline plan's tables (issue 28's targets), for make run's sidecar."""
    other = P.DEFAULTS_TARGET
    lines = ["## Issue 28's targets: make run's sidecar against Triton alone", ""]
    lines += ["### Below saturation (same arrivals)", "", *below_saturation(results, other), ""]
    if results.get("slo_search"):
        lines += ["### QPS at the P99 SLO", "", *slo_against(results, other), ""]
    lines += ["### Overload", "", *overload(results, other), ""]
    return lines


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415 - only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    written: list[Path] = []
    pairs = sorted({(e, m) for e, m, _ in steps(results)})
    for engine, mix in pairs:
        load = top_load(results, engine, mix)
        runs = [
            r
            for r in results["runs"]
            if r["engine"] == engine and r["mix"] == mix and r["load"] == load
        ]
        lanes = [lane for lane in LANES if any(r["ttft_ms"][lane] for r in runs)]
        if lanes:
            fig, axes = plt.subplots(1, len(lanes), figsize=(5 * len(lanes), 4), squeeze=False)
            for ax, lane in zip(axes[0], lanes, strict=True):
                for r in runs:
                    values = r["ttft_ms"][lane]
                    if values:
                        ys = [(i + 1) / len(values) for i in range(len(values))]
                        ax.step(values, ys, where="post", label=TARGET_NAMES[r["target"]])
                ax.set_xscale("log")
                ax.set_xlabel("time to first token (ms)")
                ax.set_ylabel("fraction of served requests")
                ax.set_title(f"{lane} lane")
                ax.legend()
            fig.suptitle(f"TTFT CDF: {mix}, {engine} engine, {load:g}× capacity")
            fig.tight_layout()
            path = out_dir / f"cdf_{engine}_{mix}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
        loads = sorted({ld for e, m, ld in steps(results) if e == engine and m == mix})
        if len(loads) > 1:
            fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
            for target in TARGETS:
                summaries = [runs_at(results, engine, mix, ld).get(target) for ld in loads]
                good = [s["goodput_rps"] if s else None for s in summaries]
                p99 = [_worst_lane(s, "ttft_p99_ms") if s else None for s in summaries]
                left.plot(loads, good, marker="o", label=TARGET_NAMES[target])
                right.plot(loads, p99, marker="o", label=TARGET_NAMES[target])
            left.set_xlabel("offered load (× capacity)")
            left.set_ylabel("goodput (req/s within SLO)")
            right.set_xlabel("offered load (× capacity)")
            right.set_ylabel("worst lane P99 TTFT (ms)")
            right.set_yscale("log")
            left.legend()
            fig.suptitle(f"{mix}, {engine} engine")
            fig.tight_layout()
            path = out_dir / f"load_{engine}_{mix}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


def write(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = [p.name for p in plots(results, out_dir)]
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    (out_dir / "results.md").write_text(markdown(results) + "\n")
