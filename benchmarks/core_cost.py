"""Scheduling cost of the policy core (a benchmark, never a test).

1. Per-request cost with 10,000 requests queued: fill the lanes with 10,000 requests the KV pool
   cannot take yet, then time `submit` + `schedule` for more arrivals, and `schedule` + `on_done`
   as capacity frees.
2. Simulated requests per second: wall time of the simulator over the mixed scenario.
Prints a table; writes results/core_cost.json.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from scheduler_svc.core.config import KvConfig, PolicyConfig, default_lanes
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.types import Dispatch, Request
from scheduler_svc.sim.simulate import simulate
from scheduler_svc.sim.workload import SCENARIOS

QUEUED = 10_000
PROBES = 2_000


def _lengths(rng: random.Random) -> int:
    return rng.choice([rng.randint(16, 255), rng.randint(256, 1023), rng.randint(1024, 4000)])


def queued_cost() -> dict[str, float]:
    rng = random.Random(0)
    lanes = tuple(
        replace(lane, max_queued=20_000, queue_timeout_s=None) for lane in default_lanes()
    )
    policy = PolicyScheduler(
        PolicyConfig(lanes=lanes, kv=KvConfig(total_blocks=600, max_in_flight=64))
    )
    now = 0.0
    for i in range(QUEUED):
        policy.submit(Request(f"q{i}", _lengths(rng), 256, tenant=f"t{i % 8}"), now)
    running = [d.request_id for d in policy.schedule(now) if isinstance(d, Dispatch)]
    submit_s, done_s = [], []
    for i in range(PROBES):
        now += 0.0001
        t0 = time.perf_counter()
        policy.submit(Request(f"p{i}", _lengths(rng), 256, tenant=f"t{i % 8}"), now)
        policy.schedule(now)
        submit_s.append(time.perf_counter() - t0)
        if running:
            t0 = time.perf_counter()
            policy.on_done(running.pop(0), now, 100)
            running += [d.request_id for d in policy.schedule(now) if isinstance(d, Dispatch)]
            done_s.append(time.perf_counter() - t0)
    return {
        "queued": policy.stats().queued,
        "submit_schedule_us_median": statistics.median(submit_s) * 1e6,
        "submit_schedule_us_p99": sorted(submit_s)[int(0.99 * len(submit_s))] * 1e6,
        "done_schedule_us_median": statistics.median(done_s) * 1e6 if done_s else float("nan"),
    }


def sim_speed() -> dict[str, float]:
    scenario = SCENARIOS["mixed"]
    t0 = time.perf_counter()
    run = simulate(scenario, "policy", "inflight", seed=0)
    wall = time.perf_counter() - t0
    return {
        "requests": len(run.outcomes),
        "virtual_s": scenario.duration_s,
        "wall_s": wall,
        "requests_per_s": len(run.outcomes) / wall,
    }


def main() -> None:
    cost, speed = queued_cost(), sim_speed()
    print("| measure | value |\n|---|---|")
    print(f"| requests queued while measuring | {cost['queued']:,} |")
    print(f"| submit + schedule, median | {cost['submit_schedule_us_median']:.0f} µs |")
    print(f"| submit + schedule, p99 | {cost['submit_schedule_us_p99']:.0f} µs |")
    done_us = cost["done_schedule_us_median"]
    print(f"| on_done + schedule (dispatching), median | {done_us:.0f} µs |")
    print(
        f"| simulator, mixed scenario ({speed['requests']} requests, "
        f"{speed['virtual_s']:.0f} s virtual) | {speed['wall_s']:.2f} s wall, "
        f"{speed['requests_per_s']:,.0f} simulated requests/s |"
    )
    out = Path("results/core_cost.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"queued_cost": cost, "sim_speed": speed}, indent=1) + "\n")
    print(f"figures: {out}")


if __name__ == "__main__":
    main()
