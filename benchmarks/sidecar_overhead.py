"""What the sidecar costs: the same short requests sent to Triton directly and through the sidecar.

Starts the embedded Triton (CPU reference engine) and the sidecar as separate processes, then
1. latency, interleaved: request i goes to every target in turn (order shuffled per round), one
   at a time, so drift on this noisy machine hits all targets alike;
2. throughput: each target driven closed-loop at a few concurrencies for a fixed time.

Targets: Triton's `ensemble` (text in, text out, tokenized by Triton's preprocessing) and the
`tensorrt_llm` model (token ids; the client tokenizes), against the sidecar's scheduler.v1
`Generate` and its KServe `ensemble` (both text). Prints Markdown tables and writes
results/sidecar_overhead.json.

    .venv/bin/python benchmarks/sidecar_overhead.py [--rounds 200] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import service_pb2_grpc

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.backends.base import GenerationInput
from scheduler_svc.backends.triton import build_request, is_final
from scheduler_svc.bench.live import start_sidecar
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.triton.launcher import TritonServer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Summarise the status of the cluster in one word, please."
Call = Callable[[], Awaitable[None]]


def _text_inputs(max_tokens: int) -> list[grpcaio.InferInput]:
    text = grpcaio.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPT]], dtype=np.object_))
    limit = grpcaio.InferInput("max_tokens", [1, 1], "INT32")
    limit.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    return [text, limit]


async def _stream_once(
    client: grpcaio.InferenceServerClient, inputs: list[grpcaio.InferInput]
) -> None:
    async def one() -> object:
        yield {"model_name": "ensemble", "inputs": inputs, "enable_empty_final_response": True}

    async for result, error in client.stream_infer(one()):
        if error is not None:
            raise RuntimeError(str(error))
        if result.get_response().parameters["triton_final_response"].bool_param:
            return


def targets(triton_url: str, sidecar_url: str, max_tokens: int) -> dict[str, Call]:
    ids = load_tokenizer().encode(PROMPT, add_special_tokens=False).ids
    triton_text = grpcaio.InferenceServerClient(triton_url)
    sidecar_kserve = grpcaio.InferenceServerClient(sidecar_url)
    engine = service_pb2_grpc.GRPCInferenceServiceStub(grpc.aio.insecure_channel(triton_url))
    scheduler = pb_grpc.SchedulerStub(grpc.aio.insecure_channel(sidecar_url))
    request = build_request(
        "tensorrt_llm", GenerationInput("bench", ids, max_tokens, end_id=-1, pad_id=2)
    )

    async def triton_ensemble() -> None:
        await _stream_once(triton_text, _text_inputs(max_tokens))

    async def triton_engine() -> None:
        async def one() -> object:
            yield request

        async for response in engine.ModelStreamInfer(one()):
            if response.error_message:
                raise RuntimeError(response.error_message)
            if is_final(response.infer_response):
                return

    async def sidecar_v1() -> None:
        await scheduler.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens))

    async def sidecar_kserve_unary() -> None:
        await sidecar_kserve.infer("ensemble", _text_inputs(max_tokens))

    return {
        "triton ensemble (text)": triton_ensemble,
        "triton tensorrt_llm (ids)": triton_engine,
        "sidecar scheduler.v1 (text)": sidecar_v1,
        "sidecar KServe ensemble (text)": sidecar_kserve_unary,
    }


async def latency(calls: dict[str, Call], rounds: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for name in names:  # warm every path up once
        await calls[name]()
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            start = time.perf_counter()
            await calls[name]()
            samples[name].append((time.perf_counter() - start) * 1000)
    return samples


async def throughput(call: Call, concurrency: int, seconds: float) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await call()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def measure(args: argparse.Namespace, triton_url: str, sidecar_url: str) -> dict[str, object]:
    calls = targets(triton_url, sidecar_url, args.max_tokens)
    lat = await latency(calls, args.rounds, args.seed)
    rates: dict[str, dict[int, float]] = {name: {} for name in calls}
    slices = 3  # each cell is measured in slices, alternating targets, so drift hits all alike
    for concurrency in args.concurrency:
        got: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(slices):
            for name, call in calls.items():
                got[name].append(await throughput(call, concurrency, args.seconds / slices))
        for name, values in got.items():
            rates[name][concurrency] = statistics.fmean(values)
    return {"latency_ms": lat, "requests_per_s": rates}


def report(results: dict[str, object], args: argparse.Namespace) -> None:
    lat: dict[str, list[float]] = results["latency_ms"]  # type: ignore[assignment]
    rates: dict[str, dict[int, float]] = results["requests_per_s"]  # type: ignore[assignment]
    base = {
        "sidecar scheduler.v1 (text)": "triton ensemble (text)",
        "sidecar KServe ensemble (text)": "triton ensemble (text)",
    }
    print(
        f"\nLatency, {args.rounds} interleaved rounds, max_tokens={args.max_tokens}, one at a time"
    )
    print("| target | p50 ms | p99 ms | p50 vs triton ensemble |")
    print("|---|---:|---:|---:|")
    for name, values in lat.items():
        ref = base.get(name)
        delta = f"{statistics.median(values) - statistics.median(lat[ref]):+.1f} ms" if ref else ""
        print(f"| {name} | {pct(values, 50):.1f} | {pct(values, 99):.1f} | {delta} |")
    print(f"\nThroughput, closed loop, {args.seconds:.0f} s per cell (requests/s)")
    print("| target | " + " | ".join(f"c={c}" for c in args.concurrency) + " |")
    print("|---|" + "---:|" * len(args.concurrency))
    for name, by_c in rates.items():
        print(f"| {name} | " + " | ".join(f"{by_c[c]:.1f}" for c in args.concurrency) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/sidecar_overhead.json")
    args = parser.parse_args()
    triton = TritonServer(ROOT / "model_repo" / "cpu", grpc_port=0, http_port=0, metrics_port=0)
    triton.start()
    log_path = Path(args.out).with_suffix(".sidecar.log")
    sidecar, sidecar_url = start_sidecar(triton.grpc_url, log_path)
    try:
        results = asyncio.run(measure(args, triton.grpc_url, sidecar_url))
    finally:
        sidecar.terminate()
        sidecar.wait(30)
        triton.stop()
    report(results, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"params": vars(args), **results}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
