"""Does the emulated engine keep its profile's time under real Triton? (A benchmark, not a test.)

One Triton serves model_repo/emulated's engine (h200-8b-bf16 by default) at several time scales.
Two checks of issue 27's targets, in one run:
- unloaded TTFT of a 128-token prompt at each scale: TTFT(s) = overhead + s x one step. The
  step and Triton's overhead (this machine's, in wall time) are fitted from the two extreme
  scales; every scale's TTFT is then compared with s x the profile's one-step time + that
  overhead (target: within 15 %);
- decode inter-token time at 1 row and at 64 rows, contexts <= 512 tokens (target: 64 rows
  <= 1.5x one row; the profile itself gives ~1.35x there; the CPU engine ran 4.7x from 1 to 16).
Overrun steps are counted from the engine's metrics for the whole run.

    .venv/bin/python benchmarks/emulated_timing.py [--profile h200-8b-bf16] [--scales 5,10,20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from scheduler_svc.profiles import load_profile
from scheduler_svc.tools.bench.live import (
    BenchRequest,
    Prompts,
    TritonClient,
    engine_value,
    scrape,
)
from scheduler_svc.tools.bench.run import wait_idle
from scheduler_svc.tools.modelrepo import copy_engine_variant
from scheduler_svc.tools.triton.launcher import TritonServer

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "model_repo" / "emulated" / "tensorrt_llm"


def model(scale: int) -> str:
    return f"emulated_x{scale}"


async def ttfts(url: str, name: str, prompts: Prompts, n: int) -> list[float]:
    client = TritonClient(url, name, priority=False)
    out = []
    try:
        for i in range(n):
            r = BenchRequest(f"ttft-{name}-{i}", 0.0, prompts.ids(128, offset=97 * i), 1, 0, "t")
            outcome = await client.send(r, 120.0)
            assert outcome.state == "ok" and outcome.ttft_s is not None, outcome.error
            out.append(outcome.ttft_s)
    finally:
        await client.close()
    return out


async def inter_token(url: str, name: str, prompts: Prompts, rows: int, tokens: int) -> float:
    """Median time per output token after the first, over `rows` requests sent together."""
    client = TritonClient(url, name, priority=False)
    try:
        requests = [
            BenchRequest(f"itl-{name}-{rows}-{i}", 0.0, prompts.ids(128, 31 * i), tokens, 0, "t")
            for i in range(rows)
        ]
        outcomes = await asyncio.gather(*(client.send(r, 600.0) for r in requests))
    finally:
        await client.close()
    per = []
    for o in outcomes:
        assert o.state == "ok" and o.ttft_s is not None and o.e2e_s is not None, o.error
        per.append((o.e2e_s - o.ttft_s) / (o.tokens - 1))
    return statistics.median(per)


def counters(metrics_url: str, name: str) -> dict[str, float]:
    s = scrape(metrics_url)
    return {
        "steps": engine_value(
            s, "nv_trt_llm_general_metrics", name, general_type="iteration_counter"
        ),
        "overruns": engine_value(s, "scheduler_svc_engine_step_overruns_total", name),
        "work_s": engine_value(s, "scheduler_svc_engine_step_work_seconds_total", name),
        "paced_s": engine_value(s, "scheduler_svc_engine_step_paced_seconds_total", name),
    }


async def measure(server: TritonServer, scales: list[int], repeats: int, profile: Any) -> dict:
    prompts = Prompts()
    out: dict[str, Any] = {"ttft": {}, "itl": {}}
    for scale in scales:
        samples = await ttfts(server.grpc_url, model(scale), prompts, repeats)
        out["ttft"][scale] = statistics.median(samples)
    lo, hi = min(scales), max(scales)
    step = (out["ttft"][hi] - out["ttft"][lo]) / (hi - lo)
    overhead = out["ttft"][lo] - lo * step
    one_step = profile.prefill_s(128)
    out["fitted_step_s"], out["triton_overhead_s"], out["profile_step_s"] = step, overhead, one_step
    itl_scale = max(scales)
    for rows in (1, 64):
        wait_idle(server.metrics_url, model(itl_scale))
        out["itl"][rows] = await inter_token(server.grpc_url, model(itl_scale), prompts, rows, 48)
    out["itl_scale"] = itl_scale
    out["counters"] = {s: counters(server.metrics_url, model(s)) for s in scales}
    return out


def report(result: dict[str, Any], profile: Any) -> str:
    lines = [
        f"Profile {profile.name}: one 128-token prefill step is "
        f"{result['profile_step_s'] * 1e3:.2f} ms; fitted from TTFT at the extreme scales: "
        f"{result['fitted_step_s'] * 1e3:.2f} ms a step and {result['triton_overhead_s'] * 1e3:.2f}"
        " ms of Triton overhead (wall).",
        "",
        "| time scale | TTFT median (wall ms) | scale x profile step + overhead | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for scale, ttft in result["ttft"].items():
        expected = scale * result["profile_step_s"] + result["triton_overhead_s"]
        lines.append(
            f"| {scale} | {ttft * 1e3:.1f} | {expected * 1e3:.1f} | {ttft / expected:.3f} |"
        )
    s = result["itl_scale"]
    one, many = result["itl"][1], result["itl"][64]
    lines += [
        "",
        f"Decode inter-token time at scale {s} (emulated ms = wall / {s}): 1 row "
        f"{one / s * 1e3:.2f} ms, 64 rows {many / s * 1e3:.2f} ms: {many / one:.2f}x "
        f"(profile: {profile.step_s(64, 64 * 150, 0) / profile.step_s(1, 150, 0):.2f}x).",
        "",
        "| scale | steps | overrun steps | engine work / paced time |",
        "|---:|---:|---:|---:|",
    ]
    for scale, c in result["counters"].items():
        share = c["work_s"] / c["paced_s"] if c["paced_s"] else 0.0
        lines.append(f"| {scale} | {c['steps']:.0f} | {c['overruns']:.0f} | {share:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h200-8b-bf16")
    parser.add_argument("--scales", default="1,5,10,20")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/emulated_timing.json")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    scales = sorted(int(s) for s in args.scales.split(","))
    repo = Path(tempfile.mkdtemp(prefix="emulated-timing-"))
    for scale in scales:
        copy_engine_variant(
            ENGINE, repo, model(scale), {"time_scale": str(scale), "cost_profile": args.profile}
        )
    server = TritonServer(repo, grpc_port=0, http_port=0, metrics_port=0)
    server.start()
    try:
        result = asyncio.run(measure(server, scales, args.repeats, profile))
    finally:
        server.stop()
    print(report(result, profile))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
