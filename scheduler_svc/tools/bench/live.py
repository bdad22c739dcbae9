"""The live half of `scheduler-svc bench`: the stack it measures and the clients that load it.

The stack is one embedded Triton serving the CPU reference engine twice (in-flight and static
batching), each configured the way a careful user would configure Triton alone (dynamic batcher,
two priority levels, a queue policy with a timeout and a maximum size), and, per engine, two
sidecars in front of it: a pass-through FIFO and the full policy. Every client is open loop:
each request is sent at its scheduled time, whatever happened to the ones before it.

Over 500 lines: the live stack's start-up, clients and measurement for every plan; new code
of its kind goes into modules of its own (the emulated bench lives in tools/bench/emulated*.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2_grpc

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.codec import build_request, is_final, output_ids
from scheduler_svc.serving.tokenizer import load_tokenizer
from scheduler_svc.sim.workload import SimRequest
from scheduler_svc.testing.process import ready_ports, serve_command
from scheduler_svc.tools.bench.plan import (
    DEFAULTS_TARGET,
    LANES,
    SMART_BATCHING,
    SUMMED_TARGET,
    VARIANT_TARGETS,
    EngineDelta,
    Outcome,
    classify_error,
    lane_of,
)
from scheduler_svc.tools.modelrepo import STATIC_ENGINE, copy_engine_variant
from scheduler_svc.tools.triton.launcher import TritonServer

ROOT = Path(__file__).resolve().parents[3]
CPU_ENGINE = ROOT / "model_repo" / "cpu" / "tensorrt_llm"
# Each strategy's engine parameters over the CPU repository's.
# The KV-pressure engines (the `kv` plan): 2,560 KV tokens (160 blocks), so that reserving
# prompt + max_tokens (128 + 512 tokens, 40 blocks) runs 4 of the 16 sequences; outputs end by
# the synthetic end-of-sequence model (mean 40 tokens), as a trained model's do.
KV_PRESSURE = {
    "gpt_model_type": "inflight_fused_batching",
    "max_tokens_in_paged_kv_cache": "2560",
    "eos_model": "lognormal",
    "eos_mean_tokens": "40",
    "eos_sigma": "0.8",
}
ENGINES: dict[str, dict[str, str]] = {
    "inflight": {"gpt_model_type": "inflight_fused_batching"},
    "static": STATIC_ENGINE,
    "kv_noevict": {**KV_PRESSURE, "batch_scheduler_policy": "guaranteed_no_evict"},
    "kv_maxutil": {**KV_PRESSURE, "batch_scheduler_policy": "max_utilization"},
}
MAX_SEQUENCES = 16  # the shipped engine's max_num_sequences: the FIFO's in-flight cap too
END_ID, PAD_ID = 1, 2  # the sidecar's defaults, used for direct calls as well
# Triton alone, configured with care: interactive traffic at priority 1, the rest at 2; a queue
# that refuses past 64 waiting requests and times a request out after 30 s.
TRITON_PRIORITY = {0: 1, 1: 2, 2: 2}
DYNAMIC_BATCHING = """
dynamic_batching {
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 30000000
    allow_timeout_override: true
    max_queue_size: 64
  }
}
"""
SIDECAR_PRIORITY = {0: pb.PRIORITY_INTERACTIVE, 1: pb.PRIORITY_STANDARD, 2: pb.PRIORITY_BATCH}
SAMPLE_EVERY_S = 0.25

# Real text, English and Chinese, that prompts are cut from (written for this benchmark).
CORPUS = (
    "The on-call engineer opened the dashboard at three in the morning and found the queue "
    "of the interactive service growing by forty requests a second. Nothing had failed; a batch "
    "job had started summarising a week of support tickets, and each of its prompts was longer "
    "than a short story. The chat users waited behind those documents, and their answers "
    "arrived long after they had given up. She wrote down what a fix would need: know how long "
    "a prompt is before it runs, keep the short ones apart from the long ones, and never let "
    "the cache fill with requests that cannot finish.\n"
    "凌晨三点，值班工程师打开监控面板，发现交互服务的队列每秒增加四十个请求。没有任何组件出错；"
    "一个批处理任务开始总结一周的客服工单，每个提示都比一篇短篇小说还长。聊天用户排在这些文档"
    "后面，等到答案出现时，他们早已离开。她写下了解决办法需要做到的事：在请求运行之前知道它有"
    "多长，把短请求和长请求分开，并且不要让缓存被无法完成的请求占满。\n"
    "A good scheduler is mostly bookkeeping. It counts tokens, blocks and seconds, and it says "
    "no early, with a reason, instead of late, with a timeout. When the load falls again it "
    "gives the spare capacity back to whoever is waiting.\n"
    "好的调度器大部分工作是记账：它计算词元、显存块和秒数；它会尽早拒绝并给出理由，而不是等到"
    "超时才失败。负载回落时，它把空闲的算力还给正在等待的人。\n"
)


class Prompts:
    """Prompts of exact token lengths: windows of the corpus, tokenized by the real tokenizer,
    each starting at a seeded offset so no two prompts share a prefix by design."""

    def __init__(self) -> None:
        self._ids = list(load_tokenizer().encode(CORPUS, add_special_tokens=False).ids)

    def ids(self, n: int, offset: int) -> tuple[int, ...]:
        ring = self._ids
        start = offset % len(ring)
        out: list[int] = []
        while len(out) < n:
            out.extend(ring[start : start + n - len(out)])
            start = 0
        return tuple(out)


# -- the stack --------------------------------------------------------------------------------


def render_repository(dst: Path) -> Path:
    """The engine under each batching strategy, with Triton's own queueing configured."""
    dst.mkdir(parents=True, exist_ok=True)
    for strategy, parameters in ENGINES.items():
        copy_engine_variant(CPU_ENGINE, dst, engine_model(strategy), parameters, DYNAMIC_BATCHING)
    return dst


def engine_model(strategy: str) -> str:
    return f"engine_{strategy}"


def start_sidecar(
    triton_url: str, log_path: Path, config: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """Start `scheduler-svc serve` on a free port; return the process and its gRPC address."""
    proc, ready = start_sidecar_process(triton_url, log_path, config)
    return proc, f"127.0.0.1:{ready['port']}"


def start_sidecar_process(
    triton_url: str, log_path: Path, config: Path | None = None, http: bool = False
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start `scheduler-svc serve` on free ports (and an HTTP one when asked); return the
    process and its "sidecar ready" log event (the ports). Its JSON log (one line per request)
    goes to `log_path`."""
    proc = subprocess.Popen(
        serve_command(triton_url, config, http), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    stdout = proc.stdout
    for line in stdout:
        event = json.loads(line)
        if ready_ports(event) is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)

            def copy() -> None:  # keep the pipe drained so the sidecar never blocks on its log
                with log_path.open("w") as out:
                    for rest in stdout:
                        out.write(rest)

            threading.Thread(target=copy, daemon=True).start()
            return proc, event
    raise RuntimeError(f"the sidecar did not start (exit code {proc.wait()})")


def sidecar_config(
    strategy: str, target: str, metrics_url: str, slo: dict[str, float]
) -> dict[str, Any]:
    """One sidecar's config (`target`: fifo, or a policy with one of the document's SmartBatching
    settings). The policy's lane timers are the document's, rescaled to this engine: a lane's
    queue timeout and aging bound are its SLO, not an A100's milliseconds; `policy_defaults`
    keeps make run's (the A100 timers)."""
    scheduler = "fifo" if target == "fifo" else "policy"
    config: dict[str, Any] = {
        "triton": {"engine_model": engine_model(strategy), "metrics_url": metrics_url},
        "queue": {"scheduler": scheduler, "max_in_flight": MAX_SEQUENCES},
    }
    if target == DEFAULTS_TARGET:  # make run's: the core's defaults, A100 timers
        return config
    if target in VARIANT_TARGETS:  # make run's with one setting changed
        config["policy"] = VARIANT_TARGETS[target]
        return config
    if scheduler == "policy":
        ratio, timeout = SMART_BATCHING[target]
        batching = {"max_ratio": ratio, "batch_timeout_s": timeout}
        config["policy"] = {
            "lanes": [
                {"name": "hot", "queue_timeout_s": slo["hot"], "max_wait_s": slo["hot"]},
                {"name": "warm", "queue_timeout_s": slo["warm"], "max_wait_s": slo["warm"]},
                {"name": "cold", "max_wait_s": slo["cold"]},
            ]
        }
        for lane in config["policy"]["lanes"]:
            lane.update(batching)
        if target == SUMMED_TARGET:
            config["policy"]["kv"] = {"forecast_peak": False}
    return config


@dataclass
class Stack:
    triton: TritonServer
    workdir: Path
    sidecars: dict[tuple[str, str], str]  # (engine strategy, scheduler) -> address
    processes: list[subprocess.Popen[str]]

    def add_sidecars(self, strategy: str, slo: dict[str, float], targets: Sequence[str]) -> None:
        for target in targets:
            path = self.workdir / f"sidecar-{strategy}-{target}.yaml"
            config = sidecar_config(strategy, target, self.triton.metrics_url, slo)
            path.write_text(yaml.safe_dump(config))
            proc, address = start_sidecar(
                self.triton.grpc_url, self.workdir / f"sidecar-{strategy}-{target}.log", path
            )
            self.processes.append(proc)
            self.sidecars[(strategy, target)] = address


@contextmanager
def stack(log: Callable[[str], None] | None = None) -> Iterator[Stack]:
    """Triton with both engines; sidecars are added once calibration has set the SLOs."""
    workdir = Path(tempfile.mkdtemp(prefix="scheduler-svc-bench-"))
    repo = render_repository(workdir / "repo")
    triton = TritonServer(repo, grpc_port=0, http_port=0, metrics_port=0, log=log)
    triton.start()
    built = Stack(triton, workdir, {}, [])
    try:
        yield built
    finally:
        for proc in built.processes:
            proc.terminate()
        for proc in built.processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        triton.stop()


# -- the engine's own view ------------------------------------------------------------------


def scrape(metrics_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as page:
        text = page.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def engine_value(samples: dict[Any, float], name: str, model: str, **labels: str) -> float:
    return samples.get((name, frozenset({"model": model, "version": "1", **labels}.items())), 0.0)


def token_counts(metrics_url: str, model: str) -> dict[tuple[str, str], float]:
    """Tokens so far by (phase, kind): context or generation, processed or useful; under
    ("paused", ""), the sequences the engine has paused to free KV blocks; under ("steps", ""),
    ("rows", "") and ("overruns", ""), its iterations, the rows they ran and the emulated steps
    that overran their modelled time."""
    samples = scrape(metrics_url)
    name = "scheduler_svc_engine_tokens_total"
    counts = {
        (phase, kind): engine_value(samples, name, model, phase=phase, kind=kind)
        for phase in ("context", "generation")
        for kind in ("processed", "useful")
    }
    paused = "scheduler_svc_engine_paused_requests_total"
    counts["paused", ""] = engine_value(samples, paused, model)
    general = "nv_trt_llm_general_metrics"
    counts["steps", ""] = engine_value(samples, general, model, general_type="iteration_counter")
    counts["rows", ""] = engine_value(samples, "scheduler_svc_engine_step_rows_total", model)
    overruns = "scheduler_svc_engine_step_overruns_total"
    counts["overruns", ""] = engine_value(samples, overruns, model)
    for key in ("paced", "work"):
        name = f"scheduler_svc_engine_step_{key}_seconds_total"
        counts[key, ""] = engine_value(samples, name, model)
    return counts


class EngineSampler:
    """Samples the engine's occupancy, KV use and fragmentation while a run goes on, and counts
    the sequences it paused."""

    def __init__(self, metrics_url: str, model: str) -> None:
        self.metrics_url, self.model = metrics_url, model
        self.delta = EngineDelta()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EngineSampler:
        self._start = token_counts(self.metrics_url, self.model)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        end = token_counts(self.metrics_url, self.model)
        moved = {key: end[key] - self._start[key] for key in end}
        self.delta.processed_tokens = moved["context", "processed"]
        self.delta.useful_tokens = moved["context", "useful"]
        self.delta.generation_processed = moved["generation", "processed"]
        self.delta.generation_useful = moved["generation", "useful"]
        self.delta.paused = moved["paused", ""]
        self.delta.steps = moved["steps", ""]
        self.delta.rows = moved["rows", ""]
        self.delta.overruns = moved["overruns", ""]
        self.delta.paced_s = moved["paced", ""]
        self.delta.work_s = moved["work", ""]

    def _run(self) -> None:
        kv, req = "nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics"
        while not self._stop.wait(SAMPLE_EVERY_S):
            s = scrape(self.metrics_url)
            m = self.model
            active = engine_value(s, req, m, request_type="active")
            most = engine_value(s, req, m, request_type="max") or MAX_SEQUENCES
            used = engine_value(s, kv, m, kv_cache_block_type="used")
            per = engine_value(s, kv, m, kv_cache_block_type="tokens_per")
            cached = engine_value(s, "scheduler_svc_engine_kv_cached_tokens", m)
            total = engine_value(s, kv, m, kv_cache_block_type="max")
            self.delta.occupancy.append(active / most)
            if total > 0:
                self.delta.kv_used.append(used / total)
            if used > 0 and per > 0:
                self.delta.fragmentation.append(max(0.0, 1 - cached / (used * per)))


# -- clients ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    at_s: float  # send time, from the run's start
    prompt: tuple[int, ...]
    max_tokens: int
    urgency: int
    tenant: str
    session: str = ""  # a conversation's id (prefix and session affinity across replicas)

    @property
    def lane(self) -> str:
        return lane_of(len(self.prompt))


def materialize(
    requests: list[SimRequest], prompts: Prompts, tag: str, generous: bool = False
) -> list[BenchRequest]:
    """Bench requests with real prompts; `max_tokens` is each request's drawn output length,
    or (`generous`, for an engine that ends outputs itself) its class's max_tokens."""
    return [
        BenchRequest(
            f"{tag}-{r.request_id}",
            r.arrival_s,
            prompts.ids(r.prompt_tokens, offset=i * 7919),
            r.max_tokens if generous else r.output_tokens,
            r.urgency,
            r.tenant,
        )
        for i, r in enumerate(requests)
    ]


_TRITON_REFUSALS = ("maximum queue size", "queue is full", "timeout expired")


class TritonClient:
    """Triton's own streaming protocol, straight to the engine model; with `priority`, each
    request carries its urgency as Triton's priority (for a model with priority levels)."""

    def __init__(self, url: str, model: str, priority: bool = True) -> None:
        self.channel = grpc.aio.insecure_channel(url)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.model = model
        self.priority = priority

    async def send(self, r: BenchRequest, deadline_s: float) -> Outcome:
        message = build_request(
            self.model,
            GenerationInput(r.request_id, r.prompt, r.max_tokens, end_id=END_ID, pad_id=PAD_ID),
        )
        if self.priority:
            message.parameters["priority"].uint64_param = TRITON_PRIORITY[r.urgency]
        out = Outcome(r.lane, len(r.prompt))
        start = time.monotonic()

        async def one() -> Any:
            yield message

        try:
            # Our side is closed after the one request, so Triton ends the stream after the
            # final response: it is read to its end, never cancelled.
            async for response in self.stub.ModelStreamInfer(one(), timeout=deadline_s):
                now = time.monotonic() - start
                if out.state != "pending":
                    continue
                if response.error_message:
                    text = response.error_message.lower()
                    refusal = any(key in text for key in _TRITON_REFUSALS)
                    out.state = classify_error(now, out.tokens > 0, refusal)
                    out.error = response.error_message[:200]
                    continue
                ids = output_ids(response.infer_response)
                if ids and out.ttft_s is None:
                    out.ttft_s = now
                out.tokens += len(ids)
                if is_final(response.infer_response):
                    out.state, out.e2e_s = "ok", now
            if out.state == "pending":
                out.state, out.error = "failed", "the stream ended before the final response"
        except grpc.aio.AioRpcError as exc:
            if out.state == "pending":
                out.state = "failed"
                out.error = f"{exc.code().name}: {exc.details()}"[:200]
        return out

    async def close(self) -> None:
        await self.channel.close()


class SidecarClient:
    """scheduler.v1 `GenerateStream`, token ids in, so no target pays for tokenizing."""

    def __init__(self, url: str) -> None:
        self.channel = grpc.aio.insecure_channel(url)
        self.stub = pb_grpc.SchedulerStub(self.channel)  # type: ignore[no-untyped-call]

    async def send(self, r: BenchRequest, deadline_s: float) -> Outcome:
        request = pb.GenerateRequest(
            request_id=r.request_id,
            token_ids=pb.TokenIds(ids=list(r.prompt)),
            max_tokens=r.max_tokens,
            priority=SIDECAR_PRIORITY[r.urgency],
            tenant=r.tenant,
            session_id=r.session,
        )
        out = Outcome(r.lane, len(r.prompt))
        start = time.monotonic()
        try:
            async for chunk in self.stub.GenerateStream(request, timeout=deadline_s):
                now = time.monotonic() - start
                if chunk.token_ids:
                    out.ttft_s = now if out.ttft_s is None else out.ttft_s
                    out.tokens += len(chunk.token_ids)
                if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    out.state, out.e2e_s = "ok", now
                    out.tokens = chunk.usage.completion_tokens or out.tokens
            if out.state != "ok":
                out.state, out.error = "failed", "the stream ended without a final message"
        except grpc.aio.AioRpcError as exc:
            now = time.monotonic() - start
            code, details = exc.code(), exc.details() or ""
            refusal = code == grpc.StatusCode.RESOURCE_EXHAUSTED or (
                code == grpc.StatusCode.DEADLINE_EXCEEDED and "queue" in details
            )
            out.state = classify_error(now, out.tokens > 0, refusal)
            out.error = f"{code.name}: {details}"[:200]
        return out

    async def close(self) -> None:
        await self.channel.close()


Client = TritonClient | SidecarClient


class Sender(Protocol):
    """Anything that sends one bench request and says what it got."""

    async def send(self, r: BenchRequest, deadline_s: float) -> Outcome: ...


async def open_loop(
    client: Sender, requests: list[BenchRequest], deadline_s: float
) -> list[Outcome]:
    """Send every request at its scheduled time, whatever the server does; wait for them all."""
    start = time.monotonic()

    async def fire(r: BenchRequest) -> Outcome:
        delay = r.at_s - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(0.0, (time.monotonic() - start) - r.at_s)
        outcome = await client.send(r, deadline_s)
        outcome.send_lag_s = lag
        return outcome

    return list(await asyncio.gather(*(fire(r) for r in requests)))


async def closed_loop(
    client: Client,
    requests: list[BenchRequest],
    concurrency: int,
    seconds: float,
    deadline_s: float,
) -> list[float]:
    """Keep `concurrency` requests in flight for `seconds`; return when each one that succeeded
    finished (seconds from the start)."""
    start = time.monotonic()
    finished: list[float] = []
    index = 0

    async def worker() -> None:
        nonlocal index
        while time.monotonic() - start < seconds:
            r = requests[index % len(requests)]
            index += 1
            if (await client.send(r, deadline_s)).state == "ok":
                finished.append(time.monotonic() - start)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return finished


async def each_once(
    client: Client, requests: list[BenchRequest], concurrency: int, deadline_s: float
) -> int:
    """Send every request once, `concurrency` at a time; return how many were served."""
    pending = list(reversed(requests))
    served = 0

    async def worker() -> None:
        nonlocal served
        while pending:
            if (await client.send(pending.pop(), deadline_s)).state == "ok":
                served += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return served


async def unloaded_ttft(
    client: Client, requests: list[BenchRequest], deadline_s: float
) -> dict[str, float]:
    """Median time to first token per lane, one request at a time."""
    by_lane: dict[str, list[float]] = {}
    for r in requests:
        outcome = await client.send(r, deadline_s)
        if outcome.state == "ok" and outcome.ttft_s is not None:
            by_lane.setdefault(r.lane, []).append(outcome.ttft_s)
    return {lane: sorted(v)[len(v) // 2] for lane, v in by_lane.items() if lane in LANES and v}
