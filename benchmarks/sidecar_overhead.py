"""What the sidecar costs: the same short requests sent to Triton directly and through the sidecar.

Starts the embedded Triton (CPU reference engine) and the sidecar as separate processes, then
1. latency, interleaved: request i goes to every target in turn (order shuffled per round), one
   at a time, so drift on this noisy machine hits all targets alike;
2. throughput: each target driven closed-loop at a few concurrencies for a fixed time.

Targets: Triton's `ensemble` (text in, text out, tokenized by Triton's preprocessing) and the
`tensorrt_llm` model (token ids; the client tokenizes), both streamed, against the sidecar's
scheduler.v1 `Generate` (unary), `GenerateStream` (text, and token ids) and its KServe
`ensemble` (text, unary and streamed). Each is compared with Triton's path for the same
input: time to the first tokens where streamed, and end to end. Prints Markdown tables and
writes results/sidecar_overhead.json.

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
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.codec import build_request, is_final, output_ids
from scheduler_svc.serving.tokenizer import load_tokenizer
from scheduler_svc.tools.bench.live import start_sidecar
from scheduler_svc.tools.triton.launcher import TritonServer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Summarise the status of the cluster in one word, please."
Call = Callable[[float], Awaitable[float | None]]


def _text_inputs(max_tokens: int, stream: bool = False) -> list[grpcaio.InferInput]:
    text = grpcaio.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPT]], dtype=np.object_))
    limit = grpcaio.InferInput("max_tokens", [1, 1], "INT32")
    limit.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    inputs = [text, limit]
    if stream:
        flag = grpcaio.InferInput("stream", [1, 1], "BOOL")
        flag.set_data_from_numpy(np.array([[True]], dtype=np.bool_))
        inputs.append(flag)
    return inputs


async def _stream_once(
    client: grpcaio.InferenceServerClient, inputs: list[grpcaio.InferInput], start: float
) -> float | None:
    """Stream one ensemble request; the time its first text came, from `start`."""

    async def one() -> object:
        yield {"model_name": "ensemble", "inputs": inputs, "enable_empty_final_response": True}

    first = None
    async for result, error in client.stream_infer(one()):
        if error is not None:
            raise RuntimeError(str(error))
        response = result.get_response()
        if first is None and response.outputs:
            first = time.perf_counter() - start
        if response.parameters["triton_final_response"].bool_param:
            return first
    return first


def targets(triton_url: str, sidecar_url: str, max_tokens: int) -> dict[str, Call]:
    """Each target's call: it sends one request and returns when its first tokens came (None
    for a unary call, whose answer comes whole)."""
    ids = load_tokenizer().encode(PROMPT, add_special_tokens=False).ids
    triton_text = grpcaio.InferenceServerClient(triton_url)
    sidecar_kserve = grpcaio.InferenceServerClient(sidecar_url)
    engine = service_pb2_grpc.GRPCInferenceServiceStub(grpc.aio.insecure_channel(triton_url))
    scheduler = pb_grpc.SchedulerStub(grpc.aio.insecure_channel(sidecar_url))
    request = build_request(
        "tensorrt_llm", GenerationInput("bench", ids, max_tokens, end_id=-1, pad_id=2)
    )

    async def triton_ensemble(start: float) -> float | None:
        return await _stream_once(triton_text, _text_inputs(max_tokens, stream=True), start)

    async def triton_engine(start: float) -> float | None:
        async def one() -> object:
            yield request

        first = None
        async for response in engine.ModelStreamInfer(one()):
            if response.error_message:
                raise RuntimeError(response.error_message)
            if first is None and output_ids(response.infer_response):
                first = time.perf_counter() - start
            if is_final(response.infer_response):
                return first
        return first

    async def sidecar_stream(start: float, message: pb.GenerateRequest) -> float | None:
        first = None
        async for chunk in scheduler.GenerateStream(message):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - start
        return first

    async def sidecar_v1(start: float) -> float | None:
        await scheduler.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens))
        return None

    async def sidecar_v1_stream(start: float) -> float | None:
        return await sidecar_stream(start, pb.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens))

    async def sidecar_v1_ids(start: float) -> float | None:
        message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens)
        return await sidecar_stream(start, message)

    async def sidecar_kserve_unary(start: float) -> float | None:
        await sidecar_kserve.infer("ensemble", _text_inputs(max_tokens))
        return None

    async def sidecar_kserve_stream(start: float) -> float | None:
        return await _stream_once(sidecar_kserve, _text_inputs(max_tokens, stream=True), start)

    return {
        "triton ensemble (text, streamed)": triton_ensemble,
        "triton tensorrt_llm (ids, streamed)": triton_engine,
        "sidecar scheduler.v1 Generate (text)": sidecar_v1,
        "sidecar scheduler.v1 GenerateStream (text)": sidecar_v1_stream,
        "sidecar scheduler.v1 GenerateStream (ids)": sidecar_v1_ids,
        "sidecar KServe ensemble (text)": sidecar_kserve_unary,
        "sidecar KServe ensemble (text, streamed)": sidecar_kserve_stream,
    }


# Each target's reference: Triton's own path for the same input.
BASE = {
    "sidecar scheduler.v1 Generate (text)": "triton ensemble (text, streamed)",
    "sidecar scheduler.v1 GenerateStream (text)": "triton ensemble (text, streamed)",
    "sidecar scheduler.v1 GenerateStream (ids)": "triton tensorrt_llm (ids, streamed)",
    "sidecar KServe ensemble (text)": "triton ensemble (text, streamed)",
    "sidecar KServe ensemble (text, streamed)": "triton ensemble (text, streamed)",
}


async def latency(
    calls: dict[str, Call], rounds: int, seed: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """End-to-end and first-token milliseconds per target (first token: streamed ones only)."""
    rng = random.Random(seed)
    e2e: dict[str, list[float]] = {name: [] for name in calls}
    ttft: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for name in names:  # warm every path up once
        await calls[name](time.perf_counter())
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            start = time.perf_counter()
            first = await calls[name](start)
            e2e[name].append((time.perf_counter() - start) * 1000)
            if first is not None:
                ttft[name].append(first * 1000)
    return e2e, ttft


async def throughput(call: Call, concurrency: int, seconds: float) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await call(time.perf_counter())
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def measure(args: argparse.Namespace, triton_url: str, sidecar_url: str) -> dict[str, object]:
    calls = targets(triton_url, sidecar_url, args.max_tokens)
    lat, ttft = await latency(calls, args.rounds, args.seed)
    rates: dict[str, dict[int, float]] = {name: {} for name in calls}
    slices = 3  # each cell is measured in slices, alternating targets, so drift hits all alike
    for concurrency in args.concurrency:
        got: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(slices):
            for name, call in calls.items():
                got[name].append(await throughput(call, concurrency, args.seconds / slices))
        for name, values in got.items():
            rates[name][concurrency] = statistics.fmean(values)
    return {"latency_ms": lat, "ttft_ms": ttft, "requests_per_s": rates}


def report(results: dict[str, object], args: argparse.Namespace) -> None:
    lat: dict[str, list[float]] = results["latency_ms"]  # type: ignore[assignment]
    ttft: dict[str, list[float]] = results["ttft_ms"]  # type: ignore[assignment]
    rates: dict[str, dict[int, float]] = results["requests_per_s"]  # type: ignore[assignment]

    def added(values: dict[str, list[float]], name: str) -> str:
        ref = BASE.get(name)
        if ref is None or not values[name] or not values[ref]:
            return ""
        return f"{statistics.median(values[name]) - statistics.median(values[ref]):+.2f} ms"

    print(
        f"\nLatency, {args.rounds} interleaved rounds, max_tokens={args.max_tokens}, one at a time"
    )
    print("| target | TTFT p50 ms | added TTFT p50 | e2e p50 ms | e2e p99 ms | added e2e p50 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in lat.items():
        first = f"{statistics.median(ttft[name]):.2f}" if ttft[name] else "(unary)"
        print(
            f"| {name} | {first} | {added(ttft, name)} | {pct(values, 50):.2f} | "
            f"{pct(values, 99):.1f} | {added(lat, name)} |"
        )
    print(f"\nThroughput, closed loop, {args.seconds:.0f} s per cell (requests/s)")
    print("| target | " + " | ".join(f"c={c}" for c in args.concurrency) + " |")
    print("|---|" + "---:|" * len(args.concurrency))
    for name, by_c in rates.items():
        print(f"| {name} | " + " | ".join(f"{by_c[c]:.1f}" for c in args.concurrency) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=2)
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
