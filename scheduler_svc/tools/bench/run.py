"""`scheduler-svc bench`: calibrate, then run every (engine, mix, load) against every target.

Targets take turns within each step, in an order that rotates from step to step, so the drift
of a noisy machine falls on all of them alike. Between runs the engine is let go idle.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from scheduler_svc.core.slo import SLO_FACTOR, SLO_FLOOR_S, percentile
from scheduler_svc.sim.report import RateSearch
from scheduler_svc.sim.workload import SimRequest
from scheduler_svc.tools.bench import plan as P  # noqa: N812 - read as the plan's namespace
from scheduler_svc.tools.bench import report
from scheduler_svc.tools.bench.live import (
    MAX_SEQUENCES,
    BenchRequest,
    Client,
    EngineSampler,
    Prompts,
    SidecarClient,
    Stack,
    TritonClient,
    closed_loop,
    each_once,
    engine_model,
    engine_value,
    materialize,
    open_loop,
    scrape,
    stack,
    unloaded_ttft,
)

IDLE_WAIT_S = 60.0
# The engine's best closed-loop rate over these concurrencies is its capacity: on this CPU
# engine more rows in flight is not always more throughput (long prefills share each step).
CALIBRATION_CONCURRENCY = (4, MAX_SEQUENCES)


class Progress:
    """One line on stderr: a bar, the step, and an estimate of the time left."""

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.started = time.monotonic()
        self.tty = stream.isatty()

    def show(self, label: str) -> None:
        width = 24
        filled = round(width * self.done / self.total) if self.total else width
        elapsed = time.monotonic() - self.started
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        left = f"~{eta / 60:.1f} min left" if eta is not None else "estimating"
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label} ({left})"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self, label: str) -> None:
        self.done += 1
        self.show(label)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def wait_idle(metrics_url: str, model: str) -> None:
    """Until the engine holds no request (a client's give-up reaches it within an iteration)."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while time.monotonic() < deadline:
        samples = scrape(metrics_url)
        busy = sum(
            engine_value(samples, "nv_trt_llm_request_metrics", model, request_type=t)
            for t in ("active", "waiting")
        )
        if busy == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"engine {model} did not go idle within {IDLE_WAIT_S:.0f} s")


def _lane_probe(prompts: Prompts) -> list[BenchRequest]:
    """Three requests per lane, at lengths typical of the mixes, 8 tokens out."""
    lengths = {"hot": 128, "warm": 512, "cold": 2048}
    return [
        BenchRequest(f"probe-{lane}-{i}", 0.0, prompts.ids(n, offset=101 * i), 8, 1, "probe")
        for lane, n in lengths.items()
        for i in range(3)
    ]


async def _calibrate(
    st: Stack, strategy: str, plan: P.Plan, prompts: Prompts, seed: int
) -> dict[str, Any]:
    model = engine_model(strategy)
    client = TritonClient(st.triton.grpc_url, model)
    try:
        ttft = await unloaded_ttft(client, _lane_probe(prompts), plan.deadline_s)
        capacity: dict[str, float] = {}
        for mix in plan.mixes(strategy):
            sim = P.schedule(mix, 20.0, 20.0, seed)
            generous = mix in P.ENDS_ITSELF
            requests = materialize(sim, prompts, f"cal-{strategy}-{mix}", generous)
            rates = []
            for concurrency in CALIBRATION_CONCURRENCY:
                finished = await closed_loop(
                    client, requests, concurrency, plan.calibrate_s, plan.deadline_s
                )
                wait_idle(st.triton.metrics_url, model)
                rates.append(P.sustained_rate(finished, plan.calibrate_s))
            capacity[mix] = max(rates)
            if not capacity[mix]:
                raise RuntimeError(f"calibration: {strategy} engine finished no {mix} request")
    finally:
        await client.close()
    slo = P.slo_ttft(ttft)
    return {
        "unloaded_ttft_ms": {lane: round(v * 1000, 1) for lane, v in ttft.items()},
        "slo_ttft_ms": {lane: round(v * 1000, 1) for lane, v in slo.items()},
        "capacity_rps": capacity,
    }


async def _overhead(st: Stack, rounds: int, prompts: Prompts) -> dict[str, Any]:
    """Short requests one at a time, to Triton directly and through each in-flight sidecar,
    interleaved."""
    clients: dict[str, Client] = {
        "triton": TritonClient(st.triton.grpc_url, engine_model("inflight"))
    }
    for (strategy, target), address in st.sidecars.items():
        if strategy == "inflight":
            clients[target] = SidecarClient(address)
    e2e: dict[str, list[float]] = {t: [] for t in clients}
    ttft: dict[str, list[float]] = {t: [] for t in clients}
    try:
        for i in range(rounds):
            r = BenchRequest(f"overhead-{i}", 0.0, prompts.ids(16, offset=i), 2, 0, "overhead")
            turn = i % len(clients)
            order = list(clients)[turn:] + list(clients)[:turn]
            for target in order:
                outcome = await clients[target].send(r, 30.0)
                if outcome.state == "ok" and outcome.e2e_s is not None:
                    e2e[target].append(outcome.e2e_s)
                if outcome.state == "ok" and outcome.ttft_s is not None:
                    ttft[target].append(outcome.ttft_s)
    finally:
        for c in clients.values():
            await c.close()
    out: dict[str, Any] = {"rounds": rounds, "prompt_tokens": 16, "max_tokens": 2}
    base = statistics.median(e2e["triton"]) if e2e["triton"] else None
    base_ttft = statistics.median(ttft["triton"]) if ttft["triton"] else None
    for target, values in e2e.items():
        p50 = statistics.median(values) if values else None
        first = statistics.median(ttft[target]) if ttft[target] else None
        out[target] = {
            "n": len(values),
            "e2e_p50_ms": P.to_ms(p50),
            "e2e_p99_ms": P.to_ms(percentile(values, 99)),
            "added_p50_ms": None if p50 is None or base is None else round((p50 - base) * 1000, 2),
            "ttft_p50_ms": P.to_ms(first),
            "added_ttft_p50_ms": (
                None if first is None or base_ttft is None else round((first - base_ttft) * 1000, 2)
            ),
        }
    return out


def _client(st: Stack, strategy: str, target: str) -> Client:
    if target in P.TRITON_TARGETS:
        return TritonClient(st.triton.grpc_url, engine_model(strategy))
    return SidecarClient(st.sidecars[(strategy, target)])


async def _one_run(
    st: Stack, step: P.Step, target: str, requests: list[BenchRequest], plan: P.Plan
) -> tuple[list[P.Outcome], P.EngineDelta]:
    model = engine_model(step.engine)
    wait_idle(st.triton.metrics_url, model)
    client = _client(st, step.engine, target)
    try:
        with EngineSampler(st.triton.metrics_url, model) as sampler:
            outcomes = await open_loop(client, requests, plan.deadline_s)
    finally:
        await client.close()
    return outcomes, sampler.delta


async def _measured_run(
    st: Stack,
    step: P.Step,
    target: str,
    requests: list[BenchRequest],
    plan: P.Plan,
    window_s: float,
    slo: dict[str, float],
) -> tuple[list[P.Outcome], dict[str, Any]]:
    """One run and its summary, run again (up to `MAX_RERUNS` times) while the client fell
    behind its schedule by more than `MAX_SEND_LAG_S` at P99: then the host stalled and the
    load offered was not the load planned. `summary["reruns"]` says how many it took."""
    reruns = 0
    while True:
        outcomes, delta = await _one_run(st, step, target, requests, plan)
        summary = P.summarize(outcomes, window_s, slo, delta)
        if summary["send_lag_p99_ms"] <= P.MAX_SEND_LAG_S * 1000 or reruns == P.MAX_RERUNS:
            break
        reruns += 1
    summary["reruns"] = reruns
    return outcomes, summary


async def _bench(plan: P.Plan, seed: int, progress: Progress, log_dir: Path) -> dict[str, Any]:
    log_dir.mkdir(parents=True, exist_ok=True)
    triton_log = (log_dir / "triton.log").open("w")
    prompts = Prompts()
    results: dict[str, Any] = {"calibration": {}, "runs": []}
    with stack(log=lambda line: print(line, file=triton_log, flush=True)) as st:
        for strategy in plan.engines:
            progress.show(f"calibrating the {strategy} engine")
            cal = await _calibrate(st, strategy, plan, prompts, seed)
            results["calibration"][strategy] = cal
            slo = {lane: ms / 1000 for lane, ms in cal["slo_ttft_ms"].items()}
            # The sidecars this engine's steps and searches need.
            wanted = set(plan.slo_target_set)
            wanted |= {t for step in plan.steps for t in plan.targets(step)}
            targets: list[str] = [t for t in ("fifo", "policy", P.SUMMED_TARGET) if t in wanted]
            if any(engine == strategy for engine, _ in plan.slo_matrix):
                targets += P.MATRIX_TARGETS
            defaults = any(engine == strategy for engine, _ in plan.defaults_at)
            if defaults or P.DEFAULTS_TARGET in wanted:
                targets.append(P.DEFAULTS_TARGET)
            targets += [t for t in P.VARIANT_TARGETS if t in wanted]
            st.add_sidecars(strategy, slo, targets)
            progress.advance(f"calibrated the {strategy} engine")
        if plan.overhead_rounds:
            progress.show("sidecar overhead")
            results["overhead"] = await _overhead(st, plan.overhead_rounds, prompts)
            progress.advance("sidecar overhead")
        for index, step in enumerate(plan.steps):
            cal = results["calibration"][step.engine]
            base = "chat" if step.mix == "burst" else step.mix
            rate = cal["capacity_rps"][base] * step.load
            window = plan.burst_s if step.mix == "burst" else plan.duration_s
            sim: list[SimRequest] = P.schedule(step.mix, rate, window, seed + index)
            requests = materialize(sim, prompts, f"s{index}", step.mix in P.ENDS_ITSELF)
            slo = {lane: ms / 1000 for lane, ms in cal["slo_ttft_ms"].items()}
            who = plan.targets(step)
            turn = index % len(who)
            for target in who[turn:] + who[:turn]:
                label = f"{step.engine} {step.mix} {step.load:g}x {P.TARGET_NAMES[target]}"
                progress.show(label)
                outcomes, summary = await _measured_run(
                    st, step, target, requests, plan, window, slo
                )
                results["runs"].append(
                    {
                        **asdict(step),
                        "step": index,
                        "target": target,
                        "offered_rps": round(len(requests) / window, 3),
                        "rate_rps": round(rate, 3),
                        "window_s": window,
                        "summary": summary,
                        "ttft_ms": {
                            lane: sorted(
                                round(o.ttft_s * 1000, 1)
                                for o in outcomes
                                if o.lane == lane and o.state == "ok" and o.ttft_s is not None
                            )
                            for lane in P.LANES
                        },
                        "errors": sorted({o.error for o in outcomes if o.error})[:10],
                    }
                )
                progress.advance(label)
        results["slo_search"] = await _slo_search(st, plan, results, prompts, seed, progress)
    triton_log.close()
    return results


async def _slo_search(
    st: Stack,
    plan: P.Plan,
    results: dict[str, Any],
    prompts: Prompts,
    seed: int,
    progress: Progress,
) -> list[dict[str, Any]]:
    """QPS at the P99 SLO for every target at every searched point, by the shared bisection
    (`RateSearch`). A rate's arrivals are the same for every target (seeded by the rate)."""
    out: list[dict[str, Any]] = []
    for engine, mix in plan.slo_points:
        cal = results["calibration"][engine]
        capacity = cal["capacity_rps"][mix]
        slo = {lane: ms / 1000 for lane, ms in cal["slo_ttft_ms"].items()}
        lo, hi = plan.slo_range
        for target in plan.slo_targets(engine, mix):
            warmed = await _warm_up(st, plan, engine, mix, target, prompts, seed, progress)
            search = RateSearch(lo * capacity, hi * capacity, plan.slo_iterations)
            trials: list[dict[str, Any]] = []
            while (rate := search.next_rate()) is not None:
                label = f"QPS at SLO: {engine} {mix} {P.TARGET_NAMES[target]} at {rate:.2f}/s"
                progress.show(label)
                window = max(plan.slo_window_s, plan.slo_min_requests / rate)
                sim = P.schedule(mix, rate, window, seed + round(rate * 1000))
                generous = mix in P.ENDS_ITSELF
                requests = materialize(sim, prompts, f"slo-{len(out)}-{len(trials)}", generous)
                step = P.Step(engine, mix, rate / capacity)
                _, summary = await _measured_run(st, step, target, requests, plan, window, slo)
                met = P.meets_slo(summary, slo)
                search.record(rate, met)
                trials.append(
                    {
                        "rate_rps": round(rate, 3),
                        "window_s": round(window, 1),
                        "met": met,
                        "summary": summary,
                    }
                )
                progress.advance(label)
            best = [t for t in trials if t["met"] and t["rate_rps"] == round(search.rate, 3)]
            out.append(
                {
                    "engine": engine,
                    "mix": mix,
                    "target": target,
                    "capacity_rps": capacity,
                    "qps_at_slo": round(search.rate, 3),
                    "at_slo": best[0]["summary"] if best else None,
                    "trials": trials,
                    "warmed_up_with": warmed,
                }
            )
    return out


async def _warm_up(
    st: Stack,
    plan: P.Plan,
    engine: str,
    mix: str,
    target: str,
    prompts: Prompts,
    seed: int,
    progress: Progress,
) -> int:
    """Serve the plan's warm-up requests through `target`, two at a time (so that none waits
    or is refused), before its search: a sidecar learns its output lengths as a deployed one
    has. Returns how many were served."""
    if not plan.warmup_requests:
        return 0
    progress.show(f"warming up {P.TARGET_NAMES[target]} on {engine}")
    sim = P.schedule(mix, 10.0, plan.warmup_requests / 10.0, seed + 7)[: plan.warmup_requests]
    requests = materialize(sim, prompts, f"warm-{engine}-{target}", mix in P.ENDS_ITSELF)
    client = _client(st, engine, target)
    try:
        served = await each_once(client, requests, 2, plan.deadline_s)
    finally:
        await client.close()
    wait_idle(st.triton.metrics_url, engine_model(engine))
    progress.advance(f"warmed up {P.TARGET_NAMES[target]} on {engine}")
    return served


def total_steps(plan: P.Plan) -> int:
    trials = 1 + plan.slo_iterations + (1 if plan.warmup_requests else 0)
    searches = sum(len(plan.slo_targets(*point)) for point in plan.slo_points)
    overhead = 1 if plan.overhead_rounds else 0
    runs = sum(len(plan.targets(step)) for step in plan.steps)
    return len(plan.engines) + overhead + runs + searches * trials


def run(plan: P.Plan, out_dir: Path, seed: int = 0, command: str = "") -> dict[str, Any]:
    """Run the plan; write results.json, results.md and plots under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(total_steps(plan))
    started = time.monotonic()
    started_utc = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        results = asyncio.run(_bench(plan, seed, progress, out_dir / "logs"))
    finally:
        progress.close()
    results["parameters"] = {
        "plan": plan.name,
        "seed": seed,
        "command": command,
        "started_utc": started_utc,
        "wall_s": round(time.monotonic() - started, 1),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "plan_detail": asdict(plan),
        "slo": {
            "rule": f"P99 TTFT <= max({SLO_FLOOR_S} s, {SLO_FACTOR} x the lane's unloaded median)",
            "fast_reject_s": P.FAST_REJECT_S,
        },
        "mixes": {name: asdict(mix) for name, mix in P.MIXES.items()},
    }
    report.write(results, out_dir)
    return results
