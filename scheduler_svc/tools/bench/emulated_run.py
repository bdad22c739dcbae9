"""The live half of `scheduler-svc bench --engine-profile`: the stack, its runs, the report.

The stack: one embedded Triton serving the reference engine with emulated timing on the profile
(`model_repo/emulated`'s engine, its shape and time scale set from the profile and the command),
Triton's own queue as it ships (Triton alone, as the simulator's FIFO models it), and one sidecar
with its defaults, every duration of its policy multiplied by the time scale. Plans and the
arithmetic are in `emulated.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from scheduler_svc.core.config import PolicyConfig, to_mapping
from scheduler_svc.core.slo import percentile
from scheduler_svc.profiles import BUNDLED, CostProfile
from scheduler_svc.sim.report import RateSearch, highest_rate
from scheduler_svc.tools.bench import emulated as E  # noqa: N812 - read as the plan's namespace
from scheduler_svc.tools.bench import plan as P  # noqa: N812
from scheduler_svc.tools.bench.live import (
    ROOT,
    BenchRequest,
    EngineSampler,
    Prompts,
    SidecarClient,
    TritonClient,
    materialize,
    open_loop,
    start_sidecar,
)
from scheduler_svc.tools.bench.report import fmt, pct, table_lines
from scheduler_svc.tools.bench.run import Progress, wait_idle
from scheduler_svc.tools.modelrepo import copy_engine_variant
from scheduler_svc.tools.triton.launcher import TritonServer

EMULATED_ENGINE = ROOT / "model_repo" / "emulated" / "tensorrt_llm"
MODEL = "engine_emulated"
MAX_OVERRUN_SHARE = 0.01  # a run with more emulated steps overrun than this is not quoted
END_ID, PAD_ID = 1, 2


def engine_parameters(spec: str, profile: CostProfile, scale: float) -> dict[str, str]:
    """The emulated engine's parameters: the profile, the scale, and the profile's shape."""
    return {
        "cost_profile": spec if spec in BUNDLED else str(Path(spec).resolve()),
        "time_scale": f"{scale:g}",
        "max_num_sequences": str(profile.max_num_sequences),
        "max_num_tokens": str(profile.max_num_tokens),
        "tokens_per_block": str(profile.tokens_per_block),
        "max_tokens_in_paged_kv_cache": str(profile.total_blocks * profile.tokens_per_block),
        "context_chunking_policy": profile.context_chunking_policy,
        "max_queue_size": str(profile.max_queue_size),
    }


@dataclass
class EmulatedStack:
    triton: TritonServer
    sidecar: str
    scale: float
    processes: list[subprocess.Popen[str]]


@contextmanager
def emulated_stack(
    spec: str, profile: CostProfile, scale: float, log_dir: Path
) -> Iterator[EmulatedStack]:
    workdir = Path(tempfile.mkdtemp(prefix="scheduler-svc-emulated-"))
    repo = workdir / "repo"
    copy_engine_variant(EMULATED_ENGINE, repo, MODEL, engine_parameters(spec, profile, scale))
    triton_log = (log_dir / "triton.log").open("w")
    triton = TritonServer(
        repo,
        grpc_port=0,
        http_port=0,
        metrics_port=0,
        log=lambda line: print(line, file=triton_log, flush=True),
    )
    triton.start()
    processes: list[subprocess.Popen[str]] = []
    try:
        config = {
            "triton": {"engine_model": MODEL, "metrics_url": triton.metrics_url},
            # The sidecar's defaults, every duration stretched with the engine's time.
            "policy": E.time_keys_scaled(to_mapping(PolicyConfig()), scale),
        }
        path = workdir / "sidecar.yaml"
        path.write_text(yaml.safe_dump(config))
        proc, address = start_sidecar(triton.grpc_url, log_dir / "sidecar.log", path)
        processes.append(proc)
        yield EmulatedStack(triton, address, scale, processes)
    finally:
        for proc in processes:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        triton.stop()
        triton_log.close()


def _client(st: EmulatedStack, target: str) -> TritonClient | SidecarClient:
    if target == "triton":
        return TritonClient(st.triton.grpc_url, MODEL, priority=False)
    return SidecarClient(st.sidecar)


async def live_run(
    st: EmulatedStack, target: str, requests: list[BenchRequest]
) -> tuple[list[P.Outcome], P.EngineDelta]:
    """One open-loop run (arrivals already in wall seconds); outcomes in emulated seconds.
    Run again, up to `plan.MAX_RERUNS` times, while the client fell behind its schedule."""
    for attempt in range(P.MAX_RERUNS + 1):
        wait_idle(st.triton.metrics_url, MODEL)
        client = _client(st, target)
        try:
            with EngineSampler(st.triton.metrics_url, MODEL) as sampler:
                outcomes = await open_loop(client, requests, E.DEADLINE_S * st.scale)
                wait_idle(st.triton.metrics_url, MODEL)  # every step counted
        finally:
            await client.close()
        lag = percentile([o.send_lag_s for o in outcomes], 99) or 0.0
        if lag <= P.MAX_SEND_LAG_S or attempt == P.MAX_RERUNS:
            break
    return E.to_emulated(outcomes, st.scale), sampler.delta


def _requests(
    mix: str, rate: float, window_s: float, seed: int, prompts: Prompts, tag: str, scale: float
) -> list[BenchRequest]:
    sim = P.schedule(mix, rate, window_s, seed)
    return [replace(r, at_s=r.at_s * scale) for r in materialize(sim, prompts, tag)]


@dataclass
class Context:
    spec: str
    profile: CostProfile
    plan: E.EmulatedPlan
    seed: int
    slo: dict[str, float]
    capacity: dict[str, float]
    scales: dict[str, float]  # the engine's time scale for each mix
    prompts: Prompts
    progress: Progress


async def _compare(
    ctx: Context, st: EmulatedStack, mix: str, rate: float, window_s: float, tag: str
) -> dict[str, Any]:
    """One (mix, rate): the simulator and the live stack for every target."""
    out: dict[str, Any] = {}
    requests = _requests(mix, rate, window_s, ctx.seed, ctx.prompts, tag, st.scale)
    for target in E.TARGETS:
        ctx.progress.show(f"{mix} at {rate:.1f}/s: {P.TARGET_NAMES[target]}")
        sim_run = E.simulated(ctx.profile, mix, target, rate, window_s, ctx.seed)
        sim = E.sim_summary(sim_run, window_s, ctx.slo)
        outcomes, delta = await live_run(st, target, requests)
        live = P.summarize(outcomes, window_s, ctx.slo, delta)
        share = live["overrun_share"]
        out[target] = {
            "sim": sim,
            "live": live,
            "agreement": E.agreement(sim, live),
            "valid": share is not None and share <= MAX_OVERRUN_SHARE,
        }
        ctx.progress.advance(f"{mix} at {rate:.1f}/s: {P.TARGET_NAMES[target]}")
    return out


async def _agree(ctx: Context, st: EmulatedStack, mix: str) -> list[dict[str, Any]]:
    rows = []
    for index, (point_mix, load) in enumerate(ctx.plan.agree_points):
        if point_mix != mix:
            continue
        rate = ctx.capacity[mix] * load
        window = E.window_for(ctx.plan, rate)
        compared = await _compare(ctx, st, mix, rate, window, f"agree{index}")
        rows.append(
            {
                "mix": mix,
                "load": load,
                "rate_rps": round(rate, 2),
                "window_s": round(window, 2),
                "time_scale": st.scale,
                "targets": compared,
            }
        )
    return rows


async def _search(ctx: Context, st: EmulatedStack, mix: str) -> dict[str, Any]:
    """QPS at the P99 SLO of every target, live and in the simulator (the same bisection)."""
    cap = ctx.capacity[mix]
    lo, hi = (x * cap for x in ctx.plan.slo_range)
    out: dict[str, Any] = {"mix": mix, "capacity_rps": round(cap, 2), "time_scale": st.scale}
    for target in E.TARGETS:

        def sim_meets(rate: float, target: str = target) -> bool:
            window = E.window_for(ctx.plan, rate)
            run = E.simulated(ctx.profile, mix, target, rate, window, ctx.seed + round(rate))
            return P.meets_slo(E.sim_summary(run, window, ctx.slo), ctx.slo)

        sim = highest_rate(sim_meets, lo, hi, ctx.plan.slo_iterations)
        search = RateSearch(lo, hi, ctx.plan.slo_iterations)
        trials = []
        while (rate := search.next_rate()) is not None:
            label = f"QPS at SLO: {mix} {P.TARGET_NAMES[target]} at {rate:.1f}/s"
            ctx.progress.show(label)
            window = E.window_for(ctx.plan, rate)
            requests = _requests(
                mix, rate, window, ctx.seed + round(rate), ctx.prompts, f"slo-{mix}", st.scale
            )
            outcomes, delta = await live_run(st, target, requests)
            summary = P.summarize(outcomes, window, ctx.slo, delta)
            share = summary["overrun_share"]
            valid = share is not None and share <= MAX_OVERRUN_SHARE
            met = P.meets_slo(summary, ctx.slo)
            search.record(rate, met)
            trials.append(
                {"rate_rps": round(rate, 2), "met": met, "valid": valid, "summary": summary}
            )
            ctx.progress.advance(label)
        out[target] = {
            "qps_at_slo": round(search.rate, 2),
            "sim_qps_at_slo": round(sim.rate, 2),
            "valid": all(t["valid"] for t in trials),
            "trials": trials,
        }
    return out


async def _burst(ctx: Context, st: EmulatedStack) -> dict[str, Any]:
    compared = await _compare(ctx, st, "burst", E.BURST_QPS, E.BURST_S, "burst")
    return {
        "rate_rps": E.BURST_QPS,
        "window_s": E.BURST_S,
        "time_scale": st.scale,
        "targets": compared,
    }


async def _overhead(st: EmulatedStack, rounds: int, prompts: Prompts) -> dict[str, Any]:
    """Short requests one at a time, to Triton alone and through the sidecar, interleaved: the
    sidecar's added time, in wall milliseconds (never divided by the time scale)."""
    clients = {t: _client(st, t) for t in E.TARGETS}
    e2e: dict[str, list[float]] = {t: [] for t in clients}
    try:
        for i in range(rounds):
            r = BenchRequest(f"overhead-{i}", 0.0, prompts.ids(16, offset=i), 2, 0, "overhead")
            for target in E.TARGETS[i % 2 :] + E.TARGETS[: i % 2]:
                outcome = await clients[target].send(r, 30.0 * st.scale)
                if outcome.state == "ok" and outcome.e2e_s is not None:
                    e2e[target].append(outcome.e2e_s)
    finally:
        for c in clients.values():
            await c.close()
    p50 = {t: statistics.median(v) if v else None for t, v in e2e.items()}
    base, policy = p50["triton"], p50["policy"]
    return {
        "rounds": rounds,
        "e2e_p50_ms": {t: P.to_ms(v) for t, v in p50.items()},
        "added_p50_ms": None if base is None or policy is None else round((policy - base) * 1e3, 2),
    }


def mixes_in_order(plan: E.EmulatedPlan) -> list[str]:
    """Each mix the plan runs, once, in the order it first comes (the burst last)."""
    out: list[str] = []
    for mix in [m for m, _ in plan.agree_points] + list(plan.slo_mixes):
        if mix not in out:
            out.append(mix)
    return out + (["burst"] if plan.burst else [])


async def _bench(ctx: Context, log_dir: Path) -> dict[str, Any]:
    """A stack per mix, at the mix's time scale: the agreement points, the search, the burst."""
    results: dict[str, Any] = {"agree": [], "slo_search": []}
    for mix in mixes_in_order(ctx.plan):
        scale = ctx.scales[mix]
        mix_logs = log_dir / mix
        mix_logs.mkdir(parents=True, exist_ok=True)
        with emulated_stack(ctx.spec, ctx.profile, scale, mix_logs) as st:
            if ctx.plan.overhead_rounds and "overhead" not in results:
                ctx.progress.show("the sidecar's overhead (wall time)")
                results["overhead"] = await _overhead(st, ctx.plan.overhead_rounds, ctx.prompts)
                ctx.progress.advance("the sidecar's overhead")
            results["agree"] += await _agree(ctx, st, mix)
            if mix in ctx.plan.slo_mixes:
                results["slo_search"].append(await _search(ctx, st, mix))
            if mix == "burst":
                results["burst"] = await _burst(ctx, st)
    return results


def total_steps(plan: E.EmulatedPlan) -> int:
    per_search = len(E.TARGETS) * (1 + plan.slo_iterations)
    compares = len(plan.agree_points) + (1 if plan.burst else 0)
    return (
        (1 if plan.overhead_rounds else 0)
        + compares * len(E.TARGETS)
        + len(plan.slo_mixes) * per_search
    )


def run(
    plan: E.EmulatedPlan,
    spec: str,
    profile: CostProfile,
    scale: float | None,
    out_dir: Path,
    seed: int = 0,
    command: str = "",
) -> dict[str, Any]:
    """Run the plan (`scale`: one time scale for every mix; None: each mix's own, from its
    capacity); write results.json and results.md under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    mixes = mixes_in_order(plan)
    capacity = {mix: E.capacity(profile, "chat" if mix == "burst" else mix, seed) for mix in mixes}
    scales = {mix: scale if scale is not None else E.scale_for(mix, capacity[mix]) for mix in mixes}
    progress = Progress(total_steps(plan))
    slo = E.slo_for(profile)
    ctx = Context(spec, profile, plan, seed, slo, capacity, scales, Prompts(), progress)
    started = time.monotonic()
    started_utc = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        results = asyncio.run(_bench(ctx, log_dir))
    finally:
        progress.close()
    results["parameters"] = {
        "plan": asdict(plan),
        "profile": {"spec": spec, **asdict(profile)},
        "time_scale": scales,
        "seed": seed,
        "command": command,
        "started_utc": started_utc,
        "wall_s": round(time.monotonic() - started, 1),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "slo_ttft_ms": {lane: round(v * 1000, 1) for lane, v in ctx.slo.items()},
        "capacity_rps": {mix: round(v, 2) for mix, v in capacity.items()},
        "sim_engine": E.SIM_ENGINE,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "results.md").write_text(markdown(results) + "\n")
    return results


# -- report -----------------------------------------------------------------------------------


def _lane_ms(summary: dict[str, Any], lane: str, key: str) -> Any:
    return summary["lanes"].get(lane, {}).get(key)


def _validity(entry: dict[str, Any]) -> str:
    live = entry["live"]
    text = f"{pct(live['overrun_share'])} (work {pct(live['engine_work_share'])})"
    return text + ("" if entry["valid"] else " INVALID")


def agreement_table(rows: list[dict[str, Any]]) -> list[str]:
    """Simulator against live, per lane: TTFT P50 and P99, goodput, rows per step."""
    body = []
    for row in rows:
        for target, entry in row["targets"].items():
            sim, live = entry["sim"], entry["live"]
            for lane in P.LANES:
                if lane not in live["lanes"] and lane not in sim["lanes"]:
                    continue
                cells = []
                for key in ("ttft_p50_ms", "ttft_p99_ms"):
                    a, b = _lane_ms(sim, lane, key), _lane_ms(live, lane, key)
                    cells += [fmt(a), fmt(b), fmt(P.ratio(b, a), "×")]
                body.append(
                    [
                        row["mix"],
                        f"{row['load']:g}× ({row['rate_rps']:g}/s)",
                        P.TARGET_NAMES[target],
                        lane,
                        *cells,
                        f"{fmt(sim['goodput_rps'])} / {fmt(live['goodput_rps'])}",
                        f"{fmt(sim['rows_per_step'])} / {fmt(live['rows_per_step'])}",
                        _validity(entry),
                    ]
                )
    header = [
        "mix", "load", "target", "lane",
        "P50 sim", "P50 live", "live÷sim", "P99 sim", "P99 live", "live÷sim",
        "goodput sim / live (req/s)", "rows per step sim / live", "overrun steps (engine work)",
    ]  # fmt: skip
    return table_lines(header, body)


def slo_table(searches: list[dict[str, Any]]) -> list[str]:
    body = []
    for s in searches:
        live = [s[t]["qps_at_slo"] for t in E.TARGETS]
        sim = [s[t]["sim_qps_at_slo"] for t in E.TARGETS]
        valid = all(s[t]["valid"] for t in E.TARGETS)
        body.append(
            [
                s["mix"],
                fmt(s["capacity_rps"], "/s"),
                *(fmt(v, "/s") for v in live),
                fmt(P.ratio(live[1], live[0]), "×"),
                *(fmt(v, "/s") for v in sim),
                fmt(P.ratio(sim[1], sim[0]), "×"),
                "yes" if valid else "NO (overruns)",
            ]
        )
    header = [
        "mix", "capacity (sim)", "Triton alone", "sidecar policy", "policy ÷ Triton",
        "sim: Triton alone", "sim: policy", "sim: policy ÷ Triton", "valid",
    ]  # fmt: skip
    return table_lines(header, body)


def burst_table(burst: dict[str, Any]) -> list[str]:
    body = []
    for target, entry in burst["targets"].items():
        for side in ("sim", "live"):
            s = entry[side]
            body.append(
                [
                    P.TARGET_NAMES[target],
                    side,
                    str(s["requests"]),
                    pct(s["failed_or_late"]),
                    fmt(s["goodput_rps"], "/s"),
                    pct(s["refused_fast_share"]),
                    fmt(_lane_ms(s, "hot", "ttft_p99_ms"), " ms"),
                    _validity(entry) if side == "live" else "",
                ]
            )
    header = [
        "target", "", "requests", "failed, refused or late", "goodput",
        "refusals within 50 ms wall", "hot P99 TTFT", "overrun steps (engine work)",
    ]  # fmt: skip
    return table_lines(header, body)


def markdown(results: dict[str, Any]) -> str:
    p = results["parameters"]
    prof = p["profile"]
    lines = [
        f"# `{p['command'] or 'scheduler-svc bench --engine-profile'}`",
        "",
        f"Profile {prof['name']} ({prof['kind']}), time scale per mix {p['time_scale']}: engine "
        "times below are emulated (wall ÷ scale); the sidecar's overhead is wall time. Started "
        f"{p['started_utc']}, {p['wall_s'] / 60:.1f} min; SLO on TTFT (emulated ms) "
        f"{p['slo_ttft_ms']}; capacity (simulator, Triton alone saturated) {p['capacity_rps']}.",
        "",
    ]
    if "overhead" in results:
        o = results["overhead"]
        lines += [
            f"Sidecar overhead, {o['rounds']} serial requests (16 prompt tokens, 2 out), wall "
            f"time: end-to-end P50 Triton alone {fmt(o['e2e_p50_ms']['triton'], ' ms')}, "
            f"through the sidecar {fmt(o['e2e_p50_ms']['policy'], ' ms')}, added "
            f"{fmt(o['added_p50_ms'], ' ms')}.",
            "",
        ]
    if results.get("agree"):
        lines += ["## The simulator against the live stack", "", *agreement_table(results["agree"])]
        lines.append("")
    if results.get("slo_search"):
        lines += ["## QPS at the P99 TTFT SLO", "", *slo_table(results["slo_search"]), ""]
    if "burst" in results:
        lines += [
            f"## Burst: {E.BURST_QPS:g} QPS of chat for {E.BURST_S:g} s (emulated)",
            "",
            *burst_table(results["burst"]),
            "",
        ]
    return "\n".join(lines)
