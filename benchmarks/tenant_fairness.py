"""A noisy tenant must not starve a quiet one: fair shares by work, live and simulated (issue 31).

Starts the embedded Triton (CPU reference engine) and, per scenario, two sidecars in turn with
make run's defaults: fairness off (`policy.fairness.enabled: false`: first come, first served
within a lane) and on (the default, with the scenario's weights). Quotas are off in both, so
the fair share and not a cap does the work. Calibration first: the chat request's unloaded
time to first token (the hot SLO is max(250 ms, 5x it)) and the engine's capacity (chat
requests per second, 16 in flight, closed loop). Each scenario
(scheduler_svc/tools/bench/fairness.py) offers every tenant's open-loop Poisson arrivals for
30 s; the same arrivals go to both
sidecars; each scenario runs three times with fresh arrivals (`--repeats`). The simulator
then runs the same arrivals' scenarios on its cost profile at the same multiples of its own
capacity. Goodput is requests served within the hot SLO per second.

    make bench-fairness   # = python benchmarks/tenant_fairness.py (~15 min here)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from scheduler_svc.core.config import FairnessConfig
from scheduler_svc.core.slo import lane_slo_s
from scheduler_svc.sim.simulate import simulate_requests
from scheduler_svc.sim.workload import SimRequest
from scheduler_svc.tools.bench import fairness
from scheduler_svc.tools.bench.live import (
    Prompts,
    SidecarClient,
    closed_loop,
    materialize,
    open_loop,
    start_sidecar,
    unloaded_ttft,
)
from scheduler_svc.tools.triton.launcher import TritonServer

ROOT = Path(__file__).resolve().parents[1]
CHAT = fairness.FairScenario(
    "chat", "the chat request", (fairness.TenantLoad("cal", 1.0, 60, 24),), backlogged=False
)
DEADLINE_S = 60.0


def chat_requests(n: int) -> list[SimRequest]:
    """`n` chat requests (60 prompt tokens, outputs drawn as the scenarios draw them)."""
    return fairness.arrivals(CHAT, capacity_rps=n, seed=7, duration_s=10.0)[:n]


class Sidecars:
    """One sidecar at a time on the shared Triton, each with its own config."""

    def __init__(self, triton: TritonServer, out: Path) -> None:
        self.triton, self.out = triton, out

    def start(self, name: str, policy: dict[str, Any]) -> tuple[subprocess.Popen[str], str]:
        path = self.out / f"sidecar-{name}.yaml"
        path.write_text(yaml.safe_dump({"policy": policy}))
        return start_sidecar(self.triton.grpc_url, self.out / f"sidecar-{name}.log", path)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


async def calibrate(url: str, prompts: Prompts) -> tuple[float, float]:
    """(unloaded chat TTFT in seconds, capacity in chat requests per second)."""
    client = SidecarClient(url)
    try:
        reqs = materialize(chat_requests(24), prompts, "warm")
        await closed_loop(client, reqs, 16, 4.0, DEADLINE_S)  # warm up: learn output lengths
        unloaded = await unloaded_ttft(client, materialize(chat_requests(20), prompts, "u"), 30)
        finished = await closed_loop(
            client, materialize(chat_requests(64), prompts, "cap"), 16, 10.0, DEADLINE_S
        )
    finally:
        await client.close()
    return unloaded["hot"], len(finished) / 10.0


async def run_live(
    url: str, requests: list[SimRequest], prompts: Prompts, tag: str
) -> list[fairness.Ended]:
    client = SidecarClient(url)
    try:
        sent = materialize(requests, prompts, tag)
        outcomes = await open_loop(client, sent, DEADLINE_S)
    finally:
        await client.close()
    ended = []
    for r, o in zip(requests, outcomes, strict=True):
        served = o.state == "ok"
        reason = "ok" if served else fairness.refusal_reason(o.error or "")
        work = r.prompt_tokens + o.tokens if served else 0
        ended.append(fairness.Ended(r.tenant, served, reason, o.ttft_s, work))
    return ended


def run_sim(
    scenario: fairness.FairScenario, requests: list[SimRequest], duration_s: float, enabled: bool
) -> tuple[list[fairness.Ended], float]:
    """How each request ended in the simulator, and its hot SLO (the same rule, its engine)."""
    config = FairnessConfig(enabled=enabled, weights=tuple(sorted(scenario.weights().items())))
    result = simulate_requests(scenario.name, requests, duration_s, fairness=config)
    return [
        fairness.Ended(
            o.request.tenant,
            o.state == "served",
            "ok" if o.state == "served" else o.state,
            o.ttft_s,
            o.request.prompt_tokens + o.request.output_tokens if o.state == "served" else 0,
        )
        for o in result.outcomes
    ], result.slo_s["hot"]


def sim_capacity() -> float:
    """The simulated engine's chat capacity: what it serves per second offered far more."""
    requests = fairness.arrivals(CHAT, 400.0, seed=99, duration_s=10.0)
    result = simulate_requests("capacity", requests, 10.0, fairness=FairnessConfig(enabled=False))
    return sum(o.state == "served" for o in result.outcomes) / 10.0


def fmt(v: object, unit: str = "", digits: int = 0) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{unit}"
    return f"{v}{unit}"


Tables = dict[str, dict[str, fairness.TenantRow]]


def markdown(results: dict[str, Any], tables: dict[str, Tables]) -> str:
    lines = [
        f"Calibration: unloaded chat TTFT {results['unloaded_ms']:.1f} ms, hot SLO "
        f"{results['slo_ms']:.0f} ms; capacity {results['capacity_rps']:.1f} chat requests/s "
        f"(the simulator's: {results['sim_capacity_rps']:.1f}/s).",
        "",
        "| scenario | run | tenant | offered | served | refused (reason) | P99 TTFT | "
        "work/s | share | fair share |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, runs in tables.items():
        for run, table in runs.items():
            for tenant, row in table.items():
                refused = ", ".join(f"{k} {v}" for k, v in sorted(row.refused.items()))
                frac = None if row.served_frac is None else 100 * row.served_frac
                lines.append(
                    f"| {name} | {run} | {tenant} | {row.offered} | {row.served} "
                    f"({fmt(frac, ' %', 1)}) | {refused or '–'} | {fmt(row.p99_ttft_ms, ' ms')} "
                    f"| {fmt(row.work_per_s)} | {fmt(row.share, '', 3)} "
                    f"| {fmt(row.fair_share, '', 3)} |"
                )
    lines += ["", "| scenario | check | live | simulator | target |", "|---|---|---|---|---|"]
    for name, scenario in results["scenarios"].items():
        for check, values in scenario["checks"].items():
            lines.append(
                f"| {name} | {check} | {values['live']} | {values['sim']} | {values['target']} |"
            )
    return "\n".join(lines)


def pct(value: float | None) -> str:
    return fmt(None if value is None else 100 * value, " %", 1)


def checks(
    scenario: fairness.FairScenario, tables: Tables, duration_s: float
) -> dict[str, dict[str, str]]:
    """The issue's targets for one scenario, from the live and simulated tables."""
    out: dict[str, dict[str, str]] = {}
    if not scenario.backlogged:
        out["quiet served within the hot SLO"] = {
            "live": pct(tables["live, fairness on"]["quiet"].served_in_slo_frac),
            "sim": pct(tables["sim, fairness on"]["quiet"].served_in_slo_frac),
            "target": f"≥ {100 * fairness.QUIET_SERVED:.0f} %",
        }
        ratios = {}
        for where in ("live", "sim"):
            on = fairness.goodput(tables[f"{where}, fairness on"], duration_s)
            off = fairness.goodput(tables[f"{where}, fairness off"], duration_s)
            ratios[where] = f"{on / off:.3f} ({on:.1f} / {off:.1f} req/s)"
        out["total goodput, on ÷ off"] = {
            **ratios,
            "target": f"≥ {1 - fairness.GOODPUT_TOLERANCE:.2f}",
        }
        return out
    for mode in ("on", "off"):
        out[f"worst share error, fairness {mode}"] = {
            "live": pct(fairness.share_error(tables[f"live, fairness {mode}"])),
            "sim": pct(fairness.share_error(tables[f"sim, fairness {mode}"])),
            "target": f"≤ {100 * fairness.SHARE_TOLERANCE:.0f} %"
            if mode == "on"
            else "(reference)",
        }
    live_on, sim_on = tables["live, fairness on"], tables["sim, fairness on"]
    gaps = [
        abs(live_on[t].share - sim_on[t].share) / live_on[t].share  # type: ignore[operator]
        for t in live_on
        if live_on[t].share and sim_on[t].share is not None
    ]
    out["simulator's shares against live, worst"] = {
        "live": "–",
        "sim": pct(max(gaps) if gaps else None) + " apart",
        "target": f"≤ {100 * fairness.SHARE_TOLERANCE:.0f} %",
    }
    return out


def run_scenario(
    scenario: fairness.FairScenario,
    sidecars: Sidecars,
    prompts: Prompts,
    calibration: dict[str, float],
    args: argparse.Namespace,
    seed: int,
) -> Tables:
    """Both sidecars on the live arrivals, then the simulator on its own."""
    live_reqs = fairness.arrivals(scenario, calibration["capacity_rps"], seed, args.seconds)
    sim_reqs = fairness.arrivals(scenario, calibration["sim_capacity_rps"], seed, args.seconds)
    slo = calibration["slo_ms"] / 1000
    tables: Tables = {}
    for enabled in (False, True):
        mode = "on" if enabled else "off"
        weights = scenario.weights() if enabled else {}
        policy: dict[str, Any] = {"fairness": {"enabled": enabled, "weights": weights}}
        if args.no_row_wait:
            policy["admission"] = {"row_wait": False}
        proc, url = sidecars.start(f"{scenario.name}-{mode}", policy)
        began = time.monotonic()
        try:
            ended = asyncio.run(run_live(url, live_reqs, prompts, f"{scenario.name}{mode}"))
        finally:
            stop(proc)
        print(f"{scenario.name}, fairness {mode}: {time.monotonic() - began:.0f} s", flush=True)
        tables[f"live, fairness {mode}"] = fairness.tenant_table(scenario, ended, args.seconds, slo)
        sim, sim_slo = run_sim(scenario, sim_reqs, args.seconds, enabled)
        tables[f"sim, fairness {mode}"] = fairness.tenant_table(
            scenario, sim, args.seconds, sim_slo
        )
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", help="one of the scenarios (repeat)")
    parser.add_argument("--seconds", type=float, default=fairness.DURATION_S)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="each scenario this often, fresh arrivals each"
    )
    parser.add_argument("--out", default="results/fairness")
    parser.add_argument(
        "--no-row-wait",
        action="store_true",
        help="both sidecars without the wait for a row at admission (`admission.row_wait`), "
        "to pair with a run that has it",
    )
    args = parser.parse_args()
    chosen = [s for s in fairness.SCENARIOS if not args.scenario or s.name in args.scenario]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = Prompts()
    triton = TritonServer(ROOT / "model_repo" / "cpu", grpc_port=0, http_port=0, metrics_port=0)
    triton.start()
    sidecars = Sidecars(triton, out)
    results: dict[str, Any] = {"params": vars(args), "scenarios": {}}
    tables: dict[str, Tables] = {}
    try:
        proc, url = sidecars.start("calibrate", {})
        try:
            unloaded, capacity = asyncio.run(calibrate(url, prompts))
        finally:
            stop(proc)
        calibration = {
            "unloaded_ms": unloaded * 1000,
            "slo_ms": lane_slo_s(unloaded) * 1000,
            "capacity_rps": capacity,
            "sim_capacity_rps": sim_capacity(),
        }
        results.update(calibration)
        print(json.dumps(calibration), flush=True)
        for scenario in chosen:
            for i in range(args.repeats):
                key = f"{scenario.name} #{i + 1}"
                tables[key] = run_scenario(
                    scenario, sidecars, prompts, calibration, args, args.seed + i
                )
                results["scenarios"][key] = {
                    "description": scenario.description,
                    "checks": checks(scenario, tables[key], args.seconds),
                    "tables": {
                        run: {t: asdict(row) for t, row in table.items()}
                        for run, table in tables[key].items()
                    },
                }
    finally:
        triton.stop()
    text = markdown(results, tables)
    print("\n" + text)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(text + "\n")
    print(f"\nwrote {out / 'results.json'} and {out / 'results.md'}")


if __name__ == "__main__":
    main()
