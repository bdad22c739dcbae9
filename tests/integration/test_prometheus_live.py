"""A real Prometheus scrapes a real sidecar during a run; what it stores matches the traffic."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.tools.triton.launcher import TritonServer, free_port
from tests.integration.sidecar import SidecarProcess

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 6


@pytest.fixture
def prometheus_and_sidecar(
    triton: TritonServer, tmp_path: Path
) -> Iterator[tuple[str, SidecarProcess]]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is installed by `make test` (Debian package prometheus)"
    metrics_port, web_port = free_port(), free_port()
    sidecar = SidecarProcess(
        triton.grpc_url,
        tmp_path,
        {"server": {"metrics_port": metrics_port}, "triton": {"metrics_url": triton.metrics_url}},
    ).start()
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "alerts.yml")],
        "scrape_configs": [
            {
                "job_name": "scheduler-svc",
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    try:
        yield f"http://127.0.0.1:{web_port}", sidecar
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        sidecar.stop()


def api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, expr: str) -> float | None:
    result = api(base, "query", query=expr)["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for(base: str, expr: str, expected: float, timeout_s: float = 40) -> None:
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        try:
            seen = query(base, expr)
        except OSError:
            seen = None  # Prometheus still starting
        if seen == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"{expr} = {seen}, expected {expected}")


def test_prometheus_sees_the_traffic_that_was_sent(
    prometheus_and_sidecar: tuple[str, SidecarProcess],
) -> None:
    base, sidecar = prometheus_and_sidecar
    wait_for(base, 'up{job="scheduler-svc"}', 1.0)
    stub = sidecar.scheduler()
    for i in range(REQUESTS):
        answer = stub.Generate(pb.GenerateRequest(prompt=f"Count to {i}.", max_tokens=2))
        assert answer.lane == "hot"
    n = float(REQUESTS)
    wait_for(base, 'sum(scheduler_svc_requests_total{lane="hot",outcome="ok"})', n)
    wait_for(base, 'sum(scheduler_svc_queue_wait_seconds_count{lane="hot"})', n)
    wait_for(base, 'sum(scheduler_svc_time_to_first_token_seconds_count{lane="hot"})', n)
    wait_for(base, 'scheduler_svc_admission_total{verdict="accepted"}', n)
    wait_for(base, "scheduler_svc_queue_depth", 0.0)
    wait_for(base, 'scheduler_svc_kv_blocks{state="reserved"}', 0.0)
    wait_for(base, "scheduler_svc_kv_mirror_stale", 0.0)
    batches = query(base, 'scheduler_svc_policy_events_total{event="batches"}')
    assert batches is not None and 1 <= batches <= n
    padding_count = query(base, 'sum(scheduler_svc_batch_padding_ratio_count{lane="hot"})')
    assert padding_count == batches  # one padding observation per released batch
    # The alert rules load and evaluate without errors in a real Prometheus.
    groups = api(base, "rules")["groups"]
    assert {g["name"] for g in groups} == {
        "scheduler-svc",
        "scheduler-svc-policy",
        "scheduler-svc-rollout",
        "scheduler-svc-tenants",
        "triton",
    }
    assert all(rule["health"] in ("ok", "unknown") for g in groups for rule in g["rules"])
    deadline = time.monotonic() + 20
    while any(r["health"] == "unknown" for g in api(base, "rules")["groups"] for r in g["rules"]):
        assert time.monotonic() < deadline, "rules were never evaluated"
        time.sleep(0.5)
    failing = [
        r["name"] for g in api(base, "rules")["groups"] for r in g["rules"] if r["health"] != "ok"
    ]
    assert failing == []
