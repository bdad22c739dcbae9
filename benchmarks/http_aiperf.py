"""AIPerf, the ecosystem's benchmark, against the sidecar's OpenAI-compatible /v1/completions:
FIFO against the policy, side by side on one Triton, in one run.

Starts the embedded Triton (CPU reference engine, `model_repo/cpu`, as `make run` does) and a
sidecar per target in front of it (TARGETS: FIFO, the policy with make run's defaults, the
policy with lane timers for this engine), each with its HTTP port. Then AIPerf profiles each in
turn, `--rounds` times, rotating which goes first: streaming completions, a mix of short and
long prompts (`--seq-dist`), closed loop at `--concurrency` (above the engine's 16 sequences, so
requests wait in the sidecar and the scheduler decides who goes first), `ignore_eos` so every
request produces its `--osl` tokens. AIPerf runs offline with the packaged DeepSeek-V4 tokenizer
and counts tokens from the server's `usage`.

Prints a Markdown table (AIPerf's own figures, plus the short prompts' TTFT from its per-request
records) and writes results/bench-http/results.json and each run's artifacts.

    make bench-http          # builds .venv-aiperf from benchmarks/aiperf-constraints.txt
    .venv/bin/python benchmarks/http_aiperf.py --aiperf .venv-aiperf/bin/aiperf [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from scheduler_svc.serving.tokenizer import tokenizer_path
from scheduler_svc.tools.bench.live import start_sidecar_process
from scheduler_svc.tools.triton.launcher import TritonServer

ROOT = Path(__file__).resolve().parents[1]
SHORT_MAX_TOKENS = 256  # prompts up to this long count as short (chat)
# Each target's sidecar config (over make run's defaults). `policy` keeps the document's A100
# lane timers (hot: 100 ms in the queue, then refused for want of a degrade target); on this
# CPU engine a long prefill alone takes longer than that, so `policy-cpu` stretches the lanes'
# timers 20x (hot 2 s, warm 10 s; aging 2 / 20 / 100 s).
TARGETS: dict[str, dict[str, Any]] = {
    "fifo": {"queue": {"scheduler": "fifo"}},
    "policy": {"queue": {"scheduler": "policy"}},
    "policy-cpu": {
        "queue": {"scheduler": "policy"},
        "policy": {
            "lanes": [
                {"name": "hot", "queue_timeout_s": 2.0, "max_wait_s": 2.0},
                {"name": "warm", "queue_timeout_s": 10.0, "max_wait_s": 20.0},
                {"name": "cold", "max_wait_s": 100.0},
            ]
        },
    },
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def profile(aiperf: str, url: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One AIPerf run; its summary figures and the short prompts' TTFT."""
    command = [
        aiperf,
        "profile",
        "--model",
        "ensemble",
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        str(tokenizer_path("deepseek-v4").parent),
        "--use-server-token-count",
        "--extra-inputs",
        "ignore_eos:true",
        "--seq-dist",
        args.seq_dist,
        "--concurrency",
        str(args.concurrency),
        "--request-count",
        str(args.requests),
        "--warmup-request-count",
        str(args.warmup),
        "--random-seed",
        str(args.seed),
        "--artifact-dir",
        str(out),
    ]
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
    with (out.parent / f"{out.name}.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    short_ttft: list[float] = []
    for line in (out / "profile_export.jsonl").read_text().splitlines():
        metrics = json.loads(line)["metrics"]
        isl = metrics.get("input_sequence_length", {}).get("value")
        ttft = metrics.get("time_to_first_token", {}).get("value")
        if isl is not None and ttft is not None and isl <= SHORT_MAX_TOKENS:
            short_ttft.append(ttft)

    def stat(name: str, key: str) -> float:
        return float(summary.get(name, {}).get(key, float("nan")))

    return {
        "requests": stat("request_count", "avg"),
        "errors": stat("error_request_count", "avg") if "error_request_count" in summary else 0,
        "error_codes": sorted(
            {e["error_details"].get("code") for e in summary.get("error_summary") or []}
        ),
        "request_throughput": stat("request_throughput", "avg"),
        "output_token_throughput": stat("output_token_throughput", "avg"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "latency_p99_ms": stat("request_latency", "p99"),
        "short_ttft_p50_ms": percentile(short_ttft, 50),
        "short_ttft_p99_ms": percentile(short_ttft, 99),
        "short_requests": len(short_ttft),
    }


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    columns = [
        ("requests", "requests", "{:.0f}"),
        ("errors", "errors", "{:.0f}"),
        ("req/s", "request_throughput", "{:.2f}"),
        ("out tok/s", "output_token_throughput", "{:.0f}"),
        ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
        ("short TTFT p50 ms", "short_ttft_p50_ms", "{:.0f}"),
        ("short TTFT p99 ms", "short_ttft_p99_ms", "{:.0f}"),
        ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
        ("latency p99 ms", "latency_p99_ms", "{:.0f}"),
    ]
    lines = [
        "| target | " + " | ".join(c[0] for c in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for target, runs in results.items():
        row = {key: statistics.median(r[key] for r in runs) for _, key, _ in columns}
        row["errors"] = sum(r["errors"] for r in runs)
        row["requests"] = sum(r["requests"] + r["errors"] for r in runs)
        cells = [fmt.format(row[key]) for _, key, fmt in columns]
        lines.append(f"| {target} | " + " | ".join(cells) + " |")

    def median(target: str, key: str) -> float:
        return statistics.median(r[key] for r in results[target])

    lines.append("")
    lines.append(
        "TTFT and latency are of the requests served; refused ones count as errors (429 with "
        "Retry-After), and AIPerf's closed loop sends the next request at once."
    )
    for target in results:
        if target == "fifo":
            continue
        short = median("fifo", "short_ttft_p99_ms") / median(target, "short_ttft_p99_ms")
        rate = median(target, "request_throughput") / median("fifo", "request_throughput")
        lines.append(
            f"- {target} against FIFO: short-prompt TTFT p99 {short:.2f}× lower, "
            f"served requests per second {rate:.2f}×."
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", default=str(ROOT / ".venv-aiperf" / "bin" / "aiperf"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seq-dist", default="64,32:80;1500,32:20")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "results" / "bench-http"))
    args = parser.parse_args()
    if not Path(args.aiperf).exists():
        print(f"no AIPerf at {args.aiperf}: run `make bench-http`", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="scheduler-svc-bench-http-"))
    triton_log = (out / "triton.log").open("w")
    triton = TritonServer(
        ROOT / "model_repo" / "cpu",
        grpc_port=0,
        http_port=0,
        metrics_port=0,
        log=lambda line: print(line, file=triton_log, flush=True),
    )
    triton.start()
    processes = []
    urls: dict[str, str] = {}
    try:
        for target, overrides in TARGETS.items():
            config = workdir / f"{target}.yaml"
            settings = {**overrides, "triton": {"metrics_url": triton.metrics_url}}
            config.write_text(yaml.safe_dump(settings))
            proc, ready = start_sidecar_process(
                triton.grpc_url, out / f"sidecar-{target}.log", config, http=True
            )
            processes.append(proc)
            urls[target] = f"http://127.0.0.1:{ready['http_port']}"
        results: dict[str, list[dict[str, Any]]] = {target: [] for target in TARGETS}
        for round_ in range(args.rounds):
            names = list(TARGETS)
            shift = round_ % len(names)  # who goes first rotates, so drift falls on all alike
            for target in names[shift:] + names[:shift]:
                run = profile(args.aiperf, urls[target], out / f"{target}-{round_}", args)
                results[target].append(run)
                print(f"round {round_} {target}: {run}", flush=True)
        text = table(results)
        print(text)
        (out / "results.json").write_text(
            json.dumps({"args": vars(args), "results": results}, indent=2)
        )
        (out / "results.md").write_text(text + "\n")
    finally:
        for proc in processes:
            proc.terminate()
            proc.wait(30)
        triton.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
