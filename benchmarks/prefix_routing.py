"""Shared prefixes across a pool of emulated Tritons (issue 32): cache hit rate and TTFT for
round robin, the sidecar by load only, and the sidecar by prefix and session.

`python benchmarks/prefix_routing.py [--out DIR]` (`make bench-prefix`). Starts REPLICAS
Tritons, each serving the reference engine with the H200 profile's emulated time (slowed
`--time-scale` times so this machine keeps it) and `enable_kv_cache_reuse` on, each with a KV
pool of KV_TOKENS: room for a few of the sessions' 16 system prompts, while the pool as a whole
holds all of them (round robin then caches every prompt everywhere and keeps evicting them).
Then, for each workload (tools/bench/prefix.py) and each offered rate, the same open-loop
arrivals go to:
- `round-robin`: straight to the Tritons, each request to the next one (Triton's own client
  balancing: what the pool does without the sidecar);
- `least-loaded`: one sidecar over the pool, `prefix_routing.enabled: false`;
- `prefix`: one sidecar over the pool with its defaults (prefix and session affinity; the
  slack from the engine: 8 for the profile's 256 sequences);
- `prefix-slackN` (with `--slack N`): the same with `prefix_routing.slack: N`.
`--target` keeps only the targets named, `--rate` replaces the sweep's rates.
Every target gets the same arrivals (and the same choice of shared prompt for each), with
tokens drawn anew for each run, so no run finds an earlier run's cache.

Reported per run: the prefix hit rate (prompt tokens the engines served from cache, from their
own counters, over those admitted, and over what one replica with an unbounded cache would
have served, `ideal_reused`), TTFT P50/P90/P99 (emulated seconds), requests served and output
tokens per emulated second, refusals, and the share of emulated steps that overran (a run
with more than 1 % is marked invalid). QPS at the P99 SLO, for the sessions workload: a
bisection per target (the simulator's and the live bench's `RateSearch`) over SEARCH_RANGE in
SEARCH_ITERATIONS halvings, each trial new arrivals at its rate (the same for every target);
a trial meets the SLO when its P99 TTFT is within it with at most 1 % refused or failed and at
most 1 % of steps overrun. The SLO is the project's rule, max(250 ms, 5x the unloaded TTFT), the
unloaded TTFT being the profile's modelled prefill of one whole session prompt. `--no-search`
skips it (the sweep's rates then give only "the highest rate run that met it").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scheduler_svc.core.config import PolicyConfig, to_mapping
from scheduler_svc.core.slo import percentile
from scheduler_svc.profiles import load_profile
from scheduler_svc.sim.report import RateSearch
from scheduler_svc.tools.bench import emulated as E  # noqa: N812
from scheduler_svc.tools.bench import prefix as W  # noqa: N812
from scheduler_svc.tools.bench.emulated_run import EMULATED_ENGINE, MODEL, engine_parameters
from scheduler_svc.tools.bench.fairness import refusal_reason
from scheduler_svc.tools.bench.live import (
    BenchRequest,
    SidecarClient,
    TritonClient,
    engine_value,
    open_loop,
    scrape,
    start_sidecar,
)
from scheduler_svc.tools.bench.plan import Outcome
from scheduler_svc.tools.bench.run import wait_idle
from scheduler_svc.tools.modelrepo import copy_engine_variant
from scheduler_svc.tools.triton.launcher import TritonServer, start_tritons

PROFILE = "h200-8b-bf16"
REPLICAS = 4
KV_TOKENS = 12_288  # per replica: 768 blocks, about six 2,000-token system prompts
TARGETS = ("round-robin", "least-loaded", "prefix")
# Offered rates (requests per emulated second) per workload.
RATES = {"sessions": (50.0, 100.0), "fewshot": (100.0,), "control": (50.0,)}
WINDOW_S = 4.0  # emulated seconds of arrivals (sessions' later turns follow for 6 s more)
SEARCH_RANGE = (40.0, 280.0)  # requests per emulated second: QPS at the SLO, sessions
SEARCH_ITERATIONS = 4  # halvings: a 15/s resolution


@dataclass
class Pool:
    tritons: list[TritonServer]
    scale: float


class RoundRobin:
    """Each request to the next Triton in turn, over Triton's own protocol."""

    def __init__(self, pool: Pool) -> None:
        self.clients = [TritonClient(t.grpc_url, MODEL, priority=False) for t in pool.tritons]
        self.turn = 0

    async def send(self, r: BenchRequest, deadline_s: float) -> Outcome:
        client = self.clients[self.turn % len(self.clients)]
        self.turn += 1
        return await client.send(r, deadline_s)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


def counters(pool: Pool) -> dict[str, float]:
    """The engines' reuse, token and step counters, summed over the pool."""
    out = {"admitted": 0.0, "reused": 0.0, "overruns": 0.0, "steps": 0.0}
    for triton in pool.tritons:
        s = scrape(triton.metrics_url)
        name = "scheduler_svc_engine_prompt_tokens_total"
        out["admitted"] += engine_value(s, name, MODEL, kind="admitted")
        out["reused"] += engine_value(s, name, MODEL, kind="reused")
        out["overruns"] += engine_value(s, "scheduler_svc_engine_step_overruns_total", MODEL)
        out["steps"] += engine_value(
            s, "nv_trt_llm_general_metrics", MODEL, general_type="iteration_counter"
        )
    return out


def routing_of(target: str) -> dict[str, Any]:
    """A sidecar target's `prefix_routing` section: `least-loaded` (off), `prefix` (the
    defaults), `prefix-slackN` (the defaults with slack N)."""
    if target == "least-loaded":
        return {"enabled": False}
    if target.startswith("prefix-slack"):
        return {"enabled": True, "slack": int(target.removeprefix("prefix-slack"))}
    return {"enabled": True}


def sidecar(pool: Pool, workdir: Path, log_dir: Path, name: str) -> tuple[Any, str]:
    first, rest = pool.tritons[0], pool.tritons[1:]
    config = {
        "triton": {
            "engine_model": MODEL,
            "metrics_url": first.metrics_url,
            "replicas": [{"url": t.grpc_url, "metrics_url": t.metrics_url} for t in rest],
            "prefix_routing": routing_of(name),
        },
        "policy": E.time_keys_scaled(to_mapping(PolicyConfig()), pool.scale),
    }
    path = workdir / f"sidecar-{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return start_sidecar(first.grpc_url, log_dir / f"sidecar-{name}.log", path)


def summary(
    outcomes: list[Outcome], requests: list[W.PrefixRequest], delta: dict[str, float], run_s: float
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.state == "ok"]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    ideal = W.ideal_reused(requests, 16)
    return {
        "offered": len(outcomes),
        "served": len(ok),
        "refused": sum(1 for o in outcomes if o.state.startswith("rejected")),
        "refusals": dict(
            Counter(refusal_reason(o.error) for o in outcomes if o.state.startswith("rejected"))
        ),
        "failed": sum(1 for o in outcomes if o.state == "failed"),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "served_per_s": len(ok) / run_s,
        "tokens_per_s": sum(o.tokens for o in ok) / run_s,
        "prompt_admitted": delta["admitted"],
        "prompt_reused": delta["reused"],
        "hit_rate": delta["reused"] / delta["admitted"] if delta["admitted"] else 0.0,
        "ideal_reused": ideal,
        "of_ideal": delta["reused"] / ideal if ideal else None,
        "overrun_share": delta["overruns"] / delta["steps"] if delta["steps"] else 0.0,
    }


async def one_run(
    pool: Pool,
    target: str,
    address: str,
    requests: list[W.PrefixRequest],
    tag: str,
    window_s: float,
) -> dict[str, Any]:
    bench = [
        BenchRequest(
            f"{tag}-{r.request_id}",
            r.at_s * pool.scale,
            r.prompt,
            r.max_tokens,
            0,
            "bench",
            f"{tag}-{r.session}" if r.session else "",
        )
        for r in requests
    ]
    for triton in pool.tritons:
        wait_idle(triton.metrics_url, MODEL)
    before = counters(pool)
    client: RoundRobin | SidecarClient = (
        RoundRobin(pool) if target == "round-robin" else SidecarClient(address)
    )
    try:
        outcomes = await open_loop(client, bench, E.DEADLINE_S * pool.scale)
    finally:
        await client.close()
    for triton in pool.tritons:
        wait_idle(triton.metrics_url, MODEL)  # idle in the same publication as the counters
    after = counters(pool)
    delta = {k: after[k] - before[k] for k in after}
    emulated = E.to_emulated(outcomes, pool.scale)
    run_s = max(r.at_s for r in requests) if requests else 1.0
    return summary(emulated, requests, delta, max(run_s, window_s))


def fmt_s(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f} ms"


def refused(s: dict[str, Any]) -> str:
    """A run's refusals, with the policy's reasons where there were any."""
    reasons = s.get("refusals") or {}
    if not reasons:
        return str(s["refused"])
    return f"{s['refused']} (" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Profile {results['profile']}, {results['replicas']} replicas of "
        f"{results['kv_tokens']:,} KV tokens each, time scale {results['scale']:g}; "
        f"SLO: P99 TTFT within {results['slo_s'] * 1000:.0f} ms (emulated).",
        "",
        "| workload | rate/s | target | served | refused | hit rate | of ideal | TTFT P50 | P90 "
        "| P99 | tokens/s | overrun |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["runs"]:
        s = row["summary"]
        ideal = "–" if s["of_ideal"] is None else f"{s['of_ideal'] * 100:.0f} %"
        lines.append(
            f"| {row['workload']} | {row['rate']:g} | {row['target']} | {s['served']}/"
            f"{s['offered']} | {refused(s)} | {s['hit_rate'] * 100:.1f} % | {ideal} | "
            f"{fmt_s(s['ttft_p50_s'])} | {fmt_s(s['ttft_p90_s'])} | {fmt_s(s['ttft_p99_s'])} | "
            f"{s['tokens_per_s']:,.0f} | {s['overrun_share'] * 100:.2f} % |"
        )
    lines += ["", "| workload | target | QPS at the P99 SLO (highest rate run that met it) |"]
    lines.append("|---|---|---:|")
    for (workload, target), rate in results["qps_at_slo"].items():
        lines.append(f"| {workload} | {target} | {'none met' if rate is None else f'{rate:g}'} |")
    if results.get("search"):
        low, high = SEARCH_RANGE
        lines += [
            "",
            f"QPS at the P99 SLO by bisection over {low:g}-{high:g}/s "
            f"({SEARCH_ITERATIONS} halvings), sessions:",
            "",
            "| target | QPS at the P99 SLO | trials (rate/s: met or P99, refused) |",
            "|---|---:|---|",
        ]
        for row in results["search"]:
            tried = "; ".join(
                f"{t['rate']:g}: "
                + ("met" if t["met"] else f"{fmt_s(t['summary']['ttft_p99_s'])}, ")
                + ("" if t["met"] else f"{t['summary']['refused']}/{t['summary']['offered']}")
                for t in row["trials"]
            )
            lines.append(f"| {row['target']} | {row['rate']:g} | {tried} |")
    return "\n".join(lines) + "\n"


def prepare_repo(repo: Path, profile: Any, scale: float) -> None:
    """The emulated engine on the profile at `scale`, KV_TOKENS of KV, KV cache reuse on."""
    params = engine_parameters(PROFILE, profile, scale)
    params.update({"max_tokens_in_paged_kv_cache": str(KV_TOKENS), "enable_kv_cache_reuse": "true"})
    copy_engine_variant(EMULATED_ENGINE, repo, MODEL, params)


def meets_slo(s: dict[str, Any], slo_s: float) -> bool:
    """A run's P99 TTFT within the SLO, at most 1 % refused or failed, at most 1 % of its
    steps overrun."""
    return (
        s["ttft_p99_s"] is not None
        and s["ttft_p99_s"] <= slo_s
        and s["refused"] + s["failed"] <= 0.01 * s["offered"]
        and s["overrun_share"] <= 0.01
    )


def qps_at_slo(runs: list[dict[str, Any]], slo_s: float) -> dict[tuple[str, str], float | None]:
    """Per workload and target, the highest rate run that met the SLO (`meets_slo`); None
    where none did."""
    qps: dict[tuple[str, str], float | None] = {}
    for row in runs:
        key = (row["workload"], row["target"])
        qps.setdefault(key, None)
        if meets_slo(row["summary"], slo_s) and row["rate"] > (qps[key] or 0.0):
            qps[key] = row["rate"]
    return qps


def search_qps(
    pool: Pool, targets: list[str], sidecars: dict[str, str], slo_s: float, seed: int, content: int
) -> tuple[list[dict[str, Any]], int]:
    """QPS at the P99 SLO of every target on the sessions workload, by bisection: each
    trial's arrivals seeded by its rate (the same for every target), its prompts new. Returns
    one row per target (its trials with them) and the next content seed."""
    rows: list[dict[str, Any]] = []
    for target in targets:
        search = RateSearch(*SEARCH_RANGE, SEARCH_ITERATIONS)
        trials: list[dict[str, Any]] = []
        while (rate := search.next_rate()) is not None:
            content += 1
            requests = W.workload("sessions", rate, WINDOW_S, seed + round(rate * 1000), content)
            started = time.monotonic()
            result = asyncio.run(
                one_run(pool, target, sidecars.get(target, ""), requests, f"q{content}", WINDOW_S)
            )
            met = meets_slo(result, slo_s)
            search.record(rate, met)
            trials.append({"rate": rate, "met": met, "summary": result})
            print(
                f"QPS at SLO, sessions, {target} at {rate:g}/s: {'met' if met else 'missed'} "
                f"(P99 {fmt_s(result['ttft_p99_s'])}, refused {result['refused']}/"
                f"{result['offered']}; {time.monotonic() - started:.0f} s)",
                flush=True,
            )
        rows.append(
            {"workload": "sessions", "target": target, "rate": search.rate, "trials": trials}
        )
    return rows, content


def start_pool(stack: ExitStack, repo: Path, out: Path, scale: float) -> Pool:
    return Pool(start_tritons(stack, repo, REPLICAS, out / "triton.log"), scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", default="results/prefix")
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", action="append", choices=W.WORKLOADS)
    parser.add_argument("--quick", action="store_true", help="one low rate, a short window")
    parser.add_argument(
        "--no-search", action="store_true", help="skip the QPS-at-SLO bisection (sessions)"
    )
    parser.add_argument(
        "--slack", type=int, action="append", default=[], help="add a target prefix-slackN"
    )
    parser.add_argument("--target", action="append", help="run only these targets")
    parser.add_argument("--rate", type=float, action="append", help="the sweep's rates, each")
    args = parser.parse_args()
    rates = {w: (20.0,) for w in W.WORKLOADS} if args.quick else RATES
    if args.rate:
        rates = {w: tuple(args.rate) for w in W.WORKLOADS}
    targets = [*TARGETS, *(f"prefix-slack{n}" for n in args.slack)]
    targets = [t for t in targets if not args.target or t in args.target]
    window_s = 2.0 if args.quick else WINDOW_S
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(PROFILE)
    slo_s = max(0.25, 5 * profile.step_s(0, 0, W.SYSTEM_TOKENS + W.USER_TOKENS))
    workdir = Path(tempfile.mkdtemp(prefix="scheduler-svc-prefix-"))
    prepare_repo(workdir / "repo", profile, args.time_scale)
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        pool = start_pool(stack, workdir / "repo", out, args.time_scale)
        sidecars: dict[str, str] = {}
        for target in targets:
            if target != "round-robin":
                proc, address = sidecar(pool, workdir, out, target)
                stack.callback(_stop, proc)
                sidecars[target] = address
        content = args.seed
        for workload in args.workload or W.WORKLOADS:
            for rate in rates[workload]:
                for target in targets:
                    content += 1  # the same arrivals for every target, new prompts each run
                    requests = W.workload(workload, rate, window_s, args.seed, content)
                    started = time.monotonic()
                    address = sidecars.get(target, "")
                    result = asyncio.run(
                        one_run(pool, target, address, requests, f"{content}", window_s)
                    )
                    runs.append(
                        {"workload": workload, "rate": rate, "target": target, "summary": result}
                    )
                    print(
                        f"{workload} {rate:g}/s {target}: hit {result['hit_rate'] * 100:.0f} %, "
                        f"P99 {fmt_s(result['ttft_p99_s'])}, served {result['served']}/"
                        f"{result['offered']} ({time.monotonic() - started:.0f} s)",
                        flush=True,
                    )
        search: list[dict[str, Any]] = []
        if not (args.quick or args.no_search):
            search, content = search_qps(pool, targets, sidecars, slo_s, args.seed, content)
    qps = qps_at_slo(runs, slo_s)
    results: dict[str, Any] = {
        "command": " ".join(["python benchmarks/prefix_routing.py", *sys.argv[1:]]),
        "profile": PROFILE,
        "replicas": REPLICAS,
        "kv_tokens": KV_TOKENS,
        "scale": args.time_scale,
        "slo_s": slo_s,
        "runs": runs,
        "qps_at_slo": qps,
        "search": search,
    }
    text = markdown(results)
    (out / "results.md").write_text(text)
    results["qps_at_slo"] = [{"workload": w, "target": t, "rate": r} for (w, t), r in qps.items()]
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(text)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


if __name__ == "__main__":
    main()
