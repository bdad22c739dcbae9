"""Operating the sidecar: overload, priorities, queue timeouts, Triton outages, draining."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.tools.triton.launcher import TritonServer, free_port
from tests.integration.conftest import CPU_REPO
from tests.integration.prompts import STORY
from tests.integration.sidecar import SidecarProcess, eventually
from tests.integration.tritonio import engine_metric, make_inputs, scrape, text_request

WAIT_S = 60.0


@pytest.fixture
def narrow(triton: TritonServer, tmp_path: Path) -> Iterator[SidecarProcess]:
    """A pass-through FIFO sidecar that dispatches one request at a time and lets two wait
    (the policy's own behaviour under load is tested in test_policy_live.py)."""
    config = {
        "queue": {"scheduler": "fifo", "max_in_flight": 1, "max_queued": 2, "retry_after_s": 0.25}
    }
    process = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    yield process
    process.stop()


def occupy(sidecar: SidecarProcess) -> tuple[grpc.Future, threading.Event]:  # type: ignore[type-arg]
    """Start a long streaming request; return its call and an event set at its first token."""
    call = sidecar.scheduler().GenerateStream(pb.GenerateRequest(prompt=STORY, max_tokens=600))
    started = threading.Event()

    def drain() -> None:
        try:
            for _ in call:
                started.set()
        except grpc.RpcError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    assert started.wait(WAIT_S)
    return call, started


def queued(sidecar: SidecarProcess) -> int:
    return int(sidecar.admin().GetStats(pb.GetStatsRequest()).queued)


def test_overload_is_refused_fast_and_priority_is_served_first(narrow: SidecarProcess) -> None:
    blocker, _ = occupy(narrow)
    finished: list[str] = []
    stub = narrow.scheduler()

    def ask(name: str, priority: int) -> None:
        stub.Generate(pb.GenerateRequest(prompt=name, max_tokens=3, priority=priority))
        finished.append(name)

    batch = threading.Thread(target=ask, args=("batch", pb.PRIORITY_BATCH))
    batch.start()
    eventually(lambda: queued(narrow) == 1, "the batch request waits")
    urgent = threading.Thread(target=ask, args=("interactive", pb.PRIORITY_INTERACTIVE))
    urgent.start()
    eventually(lambda: queued(narrow) == 2, "the interactive request waits")
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(pb.GenerateRequest(prompt="one too many", max_tokens=3))
    refused_after_s = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in caught.value.details()
    assert ("retry-after-ms", "250") in caught.value.trailing_metadata()
    assert refused_after_s < 5  # answered at once, not after the queue drained
    blocker.cancel()
    batch.join(WAIT_S)
    urgent.join(WAIT_S)
    assert finished == ["interactive", "batch"]


def test_kserve_timeout_parameter_bounds_the_queue_wait(narrow: SidecarProcess) -> None:
    blocker, _ = occupy(narrow)
    client = grpcclient.InferenceServerClient(narrow.url)
    with pytest.raises(Exception, match="queue") as caught:
        client.infer("ensemble", make_inputs(text_request("patience", 3)), timeout=300_000)
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"  # type: ignore[attr-defined]
    blocker.cancel()
    narrow.wait_for_events(
        "request end", lambda ends: any(e["outcome"] == "queue_timeout" for e in ends)
    )


def health_status(sidecar: SidecarProcess) -> int:
    stub = health_pb2_grpc.HealthStub(sidecar.channel())
    return int(stub.Check(health_pb2.HealthCheckRequest(service="")).status)


def test_triton_outage_is_unavailable_then_recovers(tmp_path: Path) -> None:
    ports = {"grpc_port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
    triton = TritonServer(CPU_REPO, **ports).start()
    config = {"triton": {"health_interval_s": 0.2}}
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    stub = sidecar.scheduler()
    try:
        eventually(
            lambda: health_status(sidecar) == health_pb2.HealthCheckResponse.SERVING, "serving"
        )
        assert (
            stub.Generate(pb.GenerateRequest(prompt="before", max_tokens=2)).usage.completion_tokens
            == 2
        )
        triton.stop()
        eventually(
            lambda: health_status(sidecar) == health_pb2.HealthCheckResponse.NOT_SERVING,
            "not serving",
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(pb.GenerateRequest(prompt="during", max_tokens=2))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        triton = TritonServer(CPU_REPO, **ports).start()
        eventually(
            lambda: health_status(sidecar) == health_pb2.HealthCheckResponse.SERVING,
            "serving again",
        )
        assert (
            stub.Generate(pb.GenerateRequest(prompt="after", max_tokens=2)).usage.completion_tokens
            == 2
        )
    finally:
        sidecar.stop()
        triton.stop()


def test_sigterm_drains_without_losing_in_flight_requests(
    triton: TritonServer, tmp_path: Path
) -> None:
    sidecar = SidecarProcess(triton.grpc_url, tmp_path).start()
    stream = sidecar.scheduler().GenerateStream(pb.GenerateRequest(prompt=STORY, max_tokens=40))
    chunks = [next(stream)]
    sidecar.terminate()
    chunks.extend(stream)  # the in-flight request runs to its end
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 40
    eventually(lambda: bool(sidecar.events("draining")), "the sidecar drains")
    with pytest.raises(grpc.RpcError) as caught:
        sidecar.scheduler().Generate(pb.GenerateRequest(prompt="late", max_tokens=2), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sidecar.wait() == 0
    assert sidecar.events("stopped")[0]["finished"] == {"ok": 1}


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


@pytest.mark.parametrize("replicas", [1, 2])
def test_run_starts_triton_and_the_sidecar_and_stops_on_ctrl_c(
    tmp_path: Path, replicas: int
) -> None:
    """`make run`; and with two Tritons (`--replicas 2 --kv-cache-reuse`): both start, the
    sidecar routes between them, a conversation's second turn finds its prefix cached."""
    extra = ["--replicas", "2", "--kv-cache-reuse"] if replicas == 2 else []
    cli = [
        sys.executable,
        "-m",
        "scheduler_svc.cli",
        "run",
        "--model-repo",
        str(CPU_REPO),
        "--triton-grpc-port",
        "0",
        "--triton-http-port",
        "0",
        "--triton-metrics-port",
        "0",
        "--port",
        "0",
        "--admin-port",
        "0",
        "--metrics-port",
        "0",
        "--triton-log",
        str(tmp_path / "triton.log"),
        *extra,
    ]
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("sidecar"):
                break
        sidecar_url = lines[-1].split()[2]
        metrics_url = lines[-1].split("metrics ")[1].strip()
        assert "scheduler_svc_queue_depth" in scrape_text(metrics_url)
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(sidecar_url))
        eventually(
            lambda: (
                health_pb2_grpc.HealthStub(grpc.insecure_channel(sidecar_url))
                .Check(health_pb2.HealthCheckRequest())
                .status
                == health_pb2.HealthCheckResponse.SERVING
            ),
            "the embedded stack serves",
        )
        assert (
            stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=3)).usage.completion_tokens
            == 3
        )
        if replicas == 2:
            tritons = [
                line.split("metrics ")[1].strip()
                for line in lines
                if line.startswith("tritonserver")
            ]
            assert len(tritons) == 2 and "replicas      2 Tritons" in "".join(lines)
            for turn in (STORY[:200], STORY[:260]):  # the second resends the first, and more
                stub.Generate(pb.GenerateRequest(prompt=turn, max_tokens=2, session_id="c1"))

            def reused() -> list[float]:
                return sorted(
                    engine_metric(
                        scrape(url),
                        "scheduler_svc_engine_prompt_tokens_total",
                        "tensorrt_llm",
                        kind="reused",
                    )
                    for url in tritons
                )

            # The engine publishes its counters once idle, after the answer went out: poll.
            eventually(lambda: reused()[1] > 0, "a replica serves the second turn from cache")
            assert reused()[0] == 0  # the other replica never saw the conversation
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sum(line.startswith("tritonserver") for line in lines) == replicas
    assert (tmp_path / "triton-2.log").exists() == (replicas == 2)


def test_a_full_engine_queue_is_resource_exhausted(variants: TritonServer, tmp_path: Path) -> None:
    # The engine runs one sequence and queues one; the sidecar itself would take many more.
    config = {"triton": {"engine_model": "engine_queue"}, "queue": {"max_in_flight": 8}}
    sidecar = SidecarProcess(variants.grpc_url, tmp_path, config).start()
    try:
        running, _ = occupy(sidecar)
        queued_call = sidecar.scheduler().GenerateStream(
            pb.GenerateRequest(prompt=STORY, max_tokens=600)
        )
        eventually(
            lambda: (
                engine_metric(
                    scrape(variants.metrics_url),
                    "nv_trt_llm_request_metrics",
                    "engine_queue",
                    request_type="waiting",
                )
                == 1
            ),
            "the engine queues the second request",
        )
        with pytest.raises(grpc.RpcError) as caught:
            sidecar.scheduler().Generate(pb.GenerateRequest(prompt="third", max_tokens=2))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Exceeds maximum queue size" in caught.value.details()
        running.cancel()
        queued_call.cancel()
    finally:
        sidecar.stop()
