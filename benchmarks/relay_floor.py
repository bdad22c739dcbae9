"""What any Python gRPC hop costs: the sidecar against the thinnest relay we can write.

Issue 28's first target asks the sidecar to add at most 0.5 ms (p50, serial requests) to
Triton's own time to first token and end to end. This measures how much of what it adds is the
hop itself: the same token-id request (max_tokens 8, streamed) goes, in interleaved rounds,
1. straight to the engine model (`ModelStreamInfer` on Triton, as a TensorRT-LLM client sends);
2. through a bare relay: a gRPC asyncio server (the same grpcio as the sidecar) whose
   `scheduler.v1 GenerateStream` builds the engine request and forwards each response, nothing
   else (no admission, no queue, no policy, no logging, no metrics);
3. through the sidecar (`scheduler-svc serve`, make run's configuration).
(2) minus (1) is the floor for a Python sidecar on this host; (3) minus (2) is what the
sidecar's own work adds. Prints a Markdown table; writes results/relay_floor.json.

    .venv/bin/python benchmarks/relay_floor.py [--rounds 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
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
MAX_TOKENS = 8
Call = Callable[[], Awaitable[tuple[float, float]]]


class Relay(pb_grpc.SchedulerServicer):
    """GenerateStream, forwarded as it is: token ids in, the engine's ids out."""

    def __init__(self, engine: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
        self.engine = engine

    async def GenerateStream(  # noqa: N802 - gRPC's method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        row = GenerationInput("relay", tuple(request.token_ids.ids), request.max_tokens, -1, 2)
        message = build_request("tensorrt_llm", row)

        async def one() -> AsyncIterator[object]:
            yield message

        async for response in self.engine.ModelStreamInfer(one()):
            ids = output_ids(response.infer_response)
            if ids:
                yield pb.GenerateResponse(token_ids=ids)
            if is_final(response.infer_response):
                return


def serve_relay(triton_url: str, port: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        channel = grpc.aio.insecure_channel(triton_url)
        server = grpc.aio.server()
        pb_grpc.add_SchedulerServicer_to_server(
            Relay(service_pb2_grpc.GRPCInferenceServiceStub(channel)), server
        )
        port.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def calls(triton_url: str, relay_url: str, sidecar_url: str) -> dict[str, Call]:
    """Each target's call: (time to its first tokens, end to end), seconds."""
    ids = load_tokenizer().encode(PROMPT, add_special_tokens=False).ids
    engine = service_pb2_grpc.GRPCInferenceServiceStub(grpc.aio.insecure_channel(triton_url))
    direct = build_request("tensorrt_llm", GenerationInput("bench", ids, MAX_TOKENS, -1, 2))
    message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=MAX_TOKENS)

    async def straight() -> tuple[float, float]:
        async def one() -> AsyncIterator[object]:
            yield direct

        start, first = time.perf_counter(), None
        async for response in engine.ModelStreamInfer(one()):
            if first is None and output_ids(response.infer_response):
                first = time.perf_counter()
            if is_final(response.infer_response):
                break
        assert first is not None
        return first - start, time.perf_counter() - start

    def scheduler(url: str) -> Call:
        stub = pb_grpc.SchedulerStub(grpc.aio.insecure_channel(url))

        async def call() -> tuple[float, float]:
            start, first = time.perf_counter(), None
            async for chunk in stub.GenerateStream(message):
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
            assert first is not None
            return first - start, time.perf_counter() - start

        return call

    return {
        "Triton, engine model (ids)": straight,
        "bare Python relay": scheduler(relay_url),
        "sidecar (make run's)": scheduler(sidecar_url),
    }


async def measure(
    urls: tuple[str, str, str], rounds: int, seed: int
) -> dict[str, dict[str, float]]:
    targets = calls(*urls)  # on this loop: an asyncio channel belongs to the loop it was made on
    rng = random.Random(seed)
    names = list(targets)
    for name in names:  # warm every path up
        for _ in range(5):
            await targets[name]()
    ttft: dict[str, list[float]] = {name: [] for name in names}
    e2e: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            first, whole = await targets[name]()
            ttft[name].append(first * 1000)
            e2e[name].append(whole * 1000)
    return {
        name: {
            "ttft_p50_ms": statistics.median(ttft[name]),
            "e2e_p50_ms": statistics.median(e2e[name]),
            "e2e_p90_ms": statistics.quantiles(e2e[name], n=10)[-1],
        }
        for name in targets
    }


def report(results: dict[str, dict[str, float]], rounds: int) -> str:
    base = results["Triton, engine model (ids)"]
    lines = [
        f"{rounds} interleaved rounds, max_tokens={MAX_TOKENS}, token ids, one request at a time",
        "| target | TTFT p50 ms | added TTFT | e2e p50 ms | added e2e | e2e p90 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in results.items():
        added_first = row["ttft_p50_ms"] - base["ttft_p50_ms"]
        added_whole = row["e2e_p50_ms"] - base["e2e_p50_ms"]
        lines.append(
            f"| {name} | {row['ttft_p50_ms']:.2f} | {added_first:+.2f} ms | "
            f"{row['e2e_p50_ms']:.2f} | {added_whole:+.2f} ms | {row['e2e_p90_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/relay_floor.json")
    args = parser.parse_args()
    triton = TritonServer(ROOT / "model_repo" / "cpu", grpc_port=0, http_port=0, metrics_port=0)
    triton.start()
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that has used gRPC
    port: multiprocessing.Queue = spawn.Queue()  # type: ignore[type-arg]
    relay = spawn.Process(target=serve_relay, args=(triton.grpc_url, port), daemon=True)
    relay.start()
    relay_url = f"127.0.0.1:{port.get(timeout=60)}"
    log_path = Path(args.out).with_suffix(".sidecar.log")
    sidecar, sidecar_url = start_sidecar(triton.grpc_url, log_path)
    try:
        urls = (triton.grpc_url, relay_url, sidecar_url)
        results = asyncio.run(measure(urls, args.rounds, args.seed))
    finally:
        sidecar.terminate()
        sidecar.wait(30)
        relay.terminate()
        triton.stop()
    table = report(results, args.rounds)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"params": vars(args), "results": results}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
