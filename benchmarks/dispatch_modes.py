"""Dispatch modes side by side: `wave` (one request per row) against `batch` (one multi-row
request per released batch), on both engine strategies, in one run (a benchmark, never a test).

Starts the embedded Triton serving the CPU reference engine twice (in-flight batching and static
batching), then for each engine x mode a sidecar with the policy, and drives it closed-loop:
`--clients` clients, each sending the next request when the last one ends, for `--seconds`.
Prompts are real text of 20-60 tokens (one length class, so buckets fill), 16 new tokens each.
The hot lane's queue timeout is raised to 10 s so that waiting is measured, not refused.
Prints a Markdown table; writes results/dispatch_modes.json.

    .venv/bin/python benchmarks/dispatch_modes.py [--seconds 20] [--clients 12]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sidecar_overhead import start_sidecar

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.triton.launcher import TritonServer

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"inflight": "inflight_fused_batching", "static": "V1"}
TEXT = (
    "Platform teams run large language models behind Triton, and short chats wait behind long "
    "documents when nothing sorts them. 平台团队在 Triton 后面运行大语言模型。 "
)


def engine_repo(folder: Path) -> None:
    """The CPU engine under two names, one per batching strategy (no ensemble needed)."""
    for name, strategy in ENGINES.items():
        target = folder / f"engine_{name}"
        shutil.copytree(
            ROOT / "model_repo" / "cpu" / "tensorrt_llm",
            target,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        config = (target / "config.pbtxt").read_text()
        config = re.sub(r'^name: ".*"$', f'name: "engine_{name}"', config, count=1, flags=re.M)
        config = config.replace('"inflight_fused_batching"', f'"{strategy}"')
        (target / "config.pbtxt").write_text(config)


def prompts(count: int) -> list[str]:
    tokenizer = load_tokenizer()
    ids = tokenizer.encode(TEXT * 4, add_special_tokens=False).ids
    rng = random.Random(0)
    return [tokenizer.decode(ids[: rng.randint(20, 30)]) for _ in range(count)]


def context_tokens(metrics_url: str, model: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            if s.name == "scheduler_svc_engine_tokens_total" and s.labels["phase"] == "context":
                out[s.labels["kind"]] = s.value
            if s.name == "nv_inference_request_success_total":
                out["requests"] = s.value
    return out


def drive(address: str, seconds: float, clients: int, texts: list[str]) -> dict[str, Any]:
    latencies: list[float] = []
    ttfts: list[float] = []
    errors = 0
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(n: int) -> None:
        nonlocal errors
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(address))
        i = n
        while time.monotonic() < stop_at:
            try:
                answer = stub.Generate(
                    pb.GenerateRequest(prompt=texts[i % len(texts)], max_tokens=16), timeout=60
                )
                with lock:
                    latencies.append(answer.timing.total_ms)
                    ttfts.append(answer.timing.time_to_first_token_ms)
            except grpc.RpcError:
                with lock:
                    errors += 1
            i += clients

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    return {
        "requests": len(latencies),
        "errors": errors,
        "req_per_s": len(latencies) / elapsed,
        "latency_p50_ms": statistics.median(latencies) if latencies else float("nan"),
        "latency_p99_ms": pct(latencies, 0.99),
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99_ms": pct(ttfts, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=12)
    args = parser.parse_args()
    texts = prompts(200)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        engine_repo(repo)
        triton = TritonServer(repo, grpc_port=0, http_port=0, metrics_port=0).start()
        try:
            for engine in ENGINES:
                model = f"engine_{engine}"
                for mode in ("wave", "batch"):
                    config = Path(tmp) / f"{engine}-{mode}.yaml"
                    config.write_text(
                        yaml.safe_dump(
                            {
                                "triton": {
                                    "engine_model": model,
                                    "dispatch": mode,
                                    "metrics_url": triton.metrics_url,
                                },
                                "policy": {"lanes": [{"name": "hot", "queue_timeout_s": 10}]},
                            }
                        )
                    )
                    log = ROOT / "results" / f"dispatch-{engine}-{mode}.log"
                    proc, address = start_sidecar(triton.grpc_url, log, config)
                    try:
                        before = context_tokens(triton.metrics_url, model)
                        result = drive(address, args.seconds, args.clients, texts)
                        after = context_tokens(triton.metrics_url, model)
                    finally:
                        proc.terminate()
                        proc.wait(timeout=60)
                    processed = after["processed"] - before["processed"]
                    useful = after["useful"] - before["useful"]
                    result.update(
                        engine=engine,
                        mode=mode,
                        engine_padding=1 - useful / processed if processed else 0.0,
                        triton_requests=after["requests"] - before["requests"],
                    )
                    rows.append(result)
                    print(f"  {engine} / {mode}: {result['req_per_s']:.1f} req/s", flush=True)
        finally:
            triton.stop()
    print(f"\n{args.clients} clients, closed loop, {args.seconds:.0f} s per cell, 16 new tokens\n")
    print(
        "| engine | dispatch | req/s | p50 ms | p99 ms | TTFT p50 ms | TTFT p99 ms | "
        "engine padding | Triton requests | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['mode']} | {r['req_per_s']:.1f} | {r['latency_p50_ms']:.0f} | "
            f"{r['latency_p99_ms']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
            f"{r['engine_padding']:.1%} | {r['triton_requests']:.0f} of {r['requests']} | "
            f"{r['errors']} |"
        )
    out = ROOT / "results" / "dispatch_modes.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"params": vars(args), "rows": rows}, indent=1) + "\n")
    print(f"\nfigures: {out}")


if __name__ == "__main__":
    main()
