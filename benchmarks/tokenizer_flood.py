"""A flood of huge prompts from one client must not slow another's short requests.

Starts the embedded Triton (CPU reference engine) and the sidecar with its default
configuration. A quiet client sends one 1,000-character prompt every 100 ms throughout; after a few
seconds a flooding client (another tenant) sends 40 concurrent prompts of 120 KB (under the
128 KiB byte cap, far over the token limit) and keeps that up for a few rounds. Reported per
round: the quiet client's median latency before the flood, its worst (and P99) during it, the
rise (target: worst ≤ median + 50 ms), and how the flood's calls ended.

    make bench-flood     # = python benchmarks/tokenizer_flood.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import grpc

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.tools.bench.live import start_sidecar
from scheduler_svc.tools.triton.launcher import TritonServer

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "platform",
    "teams",
    "run",
    "language",
    "models",
    "behind",
    "triton",
    "when",
    "traffic",
    "climbs",
    "past",
    "fifty",
    "requests",
    "per",
    "second",
    "long",
    "prompts",
    "block",
    "short",
    "chats",
    "and",
    "the",
    "cache",
    "runs",
    "out",
    "of",
    "room",
]


def huge_prompt(rng: random.Random, size: int) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


async def quiet_client(
    url: str, stop: asyncio.Event, period_s: float, prompt: str
) -> list[tuple[float, float]]:
    """(sent at, latency) for one request every `period_s`."""
    samples: list[tuple[float, float]] = []
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        request = pb.GenerateRequest(prompt=prompt, max_tokens=2, tenant="quiet")
        next_at = time.monotonic()
        while not stop.is_set():
            sent = time.monotonic()
            await stub.Generate(request, timeout=30)
            samples.append((sent, time.monotonic() - sent))
            next_at += period_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    return samples


async def flood(url: str, prompts: list[str]) -> Counter[str]:
    """Send every prompt at once; count how each call ended."""
    ended: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(
        url, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        stub = pb_grpc.SchedulerStub(channel)

        async def one(text: str) -> None:
            request = pb.GenerateRequest(prompt=text, max_tokens=2, tenant="flood")
            try:
                await stub.Generate(request, timeout=60)
                ended["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                ended[exc.code().name] += 1

        await asyncio.gather(*(one(p) for p in prompts))
    return ended


async def measure(url: str, args: argparse.Namespace) -> list[dict[str, object]]:
    rng = random.Random(args.seed)
    prompts = [huge_prompt(rng, args.prompt_bytes) for _ in range(args.concurrent)]
    quiet_prompt = huge_prompt(rng, args.quiet_chars)
    rounds = []
    for _ in range(args.rounds):
        stop = asyncio.Event()
        quiet = asyncio.create_task(quiet_client(url, stop, args.period_s, quiet_prompt))
        await asyncio.sleep(args.before_s)
        flood_started = time.monotonic()
        ended: Counter[str] = Counter()
        for _ in range(args.waves):
            ended += await flood(url, prompts)
        flood_ended = time.monotonic()
        await asyncio.sleep(args.period_s * 3)
        stop.set()
        samples = await quiet
        before = [lat for at, lat in samples if at < flood_started]
        during = [lat for at, lat in samples if flood_started <= at <= flood_ended]
        median = statistics.median(before)
        worst = max(during) if during else float("nan")
        rounds.append(
            {
                "before_median_ms": median * 1000,
                "during_median_ms": statistics.median(during) * 1000 if during else None,
                "during_worst_ms": worst * 1000,
                "rise_ms": (worst - median) * 1000,
                "quiet_requests_during": len(during),
                "flood_s": flood_ended - flood_started,
                "flood_calls": dict(ended),
            }
        )
    return rounds


def report(rounds: list[dict[str, object]], args: argparse.Namespace) -> None:
    print(
        f"\nQuiet client: one {args.quiet_chars:,}-character prompt every "
        f"{args.period_s * 1000:.0f} ms; flood: "
        f"{args.waves} waves of {args.concurrent} concurrent {args.prompt_bytes:,}-byte prompts\n"
    )
    print(
        "| round | quiet median before | quiet median during | quiet worst during | rise "
        "| quiet calls during | flood s | flood calls |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, r in enumerate(rounds, 1):
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["flood_calls"].items()))  # type: ignore[attr-defined]
        print(
            f"| {i} | {r['before_median_ms']:.1f} ms | {r['during_median_ms']:.1f} ms "
            f"| {r['during_worst_ms']:.1f} ms | {r['rise_ms']:+.1f} ms "
            f"| {r['quiet_requests_during']} | {r['flood_s']:.2f} | {calls} |"
        )
    worst_rise = max(float(r["rise_ms"]) for r in rounds)  # type: ignore[arg-type]
    verdict = "met" if worst_rise <= 50 else "NOT met"
    print(f"\nworst rise over the before-median: {worst_rise:+.1f} ms (target ≤ +50 ms: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--waves", type=int, default=3, help="floods of --concurrent per round")
    parser.add_argument("--concurrent", type=int, default=40)
    parser.add_argument("--prompt-bytes", type=int, default=120_000)
    parser.add_argument("--period-s", type=float, default=0.1)
    parser.add_argument(
        "--quiet-chars",
        type=int,
        default=1000,
        help="the quiet client's prompt (1,000: a chat turn, tokenized off the event loop)",
    )
    parser.add_argument("--before-s", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/tokenizer_flood.json")
    args = parser.parse_args()
    triton = TritonServer(ROOT / "model_repo" / "cpu", grpc_port=0, http_port=0, metrics_port=0)
    triton.start()
    log_path = Path(args.out).with_suffix(".sidecar.log")
    sidecar, sidecar_url = start_sidecar(triton.grpc_url, log_path)
    try:
        rounds = asyncio.run(measure(sidecar_url, args))
    finally:
        sidecar.terminate()
        sidecar.wait(30)
        triton.stop()
    report(rounds, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"params": vars(args), "rounds": rounds}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
