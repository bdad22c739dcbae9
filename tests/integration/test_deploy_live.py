"""What the deployment manifests rely on, checked against the real sidecar and Triton: the
metrics endpoint the autoscaler and the alerts read, and the health command the probes run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.tools.triton.launcher import TritonServer, free_port
from tests.integration.sidecar import SidecarProcess, eventually
from tests.integration.tritonio import scrape

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\b((?:scheduler_svc|nv)_[a-z_]+)\b")


@pytest.fixture(scope="module")
def observed(
    triton: TritonServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SidecarProcess, str]]:
    port = free_port()
    workdir = tmp_path_factory.mktemp("sidecar-metrics")
    # Backend groups too (a second group on the same Triton, at 0 %; a gate with no result
    # yet), so the rollout's and the gate's metrics are on the page the alerts read.
    config = {
        "server": {"metrics_port": port},
        "groups": {"next": {"url": triton.grpc_url}},
        "rollout": {"candidate": "next", "weight": 0},
        "spec_gate": {"group": "next", "result_file": str(workdir / "no-gate-result.json")},
    }
    process = SidecarProcess(triton.grpc_url, workdir, config).start()
    yield process, f"http://127.0.0.1:{port}/metrics"
    process.stop()


def names(metrics_url: str) -> set[str]:
    """Sample names exactly as the page writes them (parsers rename counters)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)", text, re.M))


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_the_metrics_endpoint_counts_what_the_sidecar_admits(
    observed: tuple[SidecarProcess, str],
) -> None:
    sidecar, url = observed
    before = scrape(url)
    assert value(before, "scheduler_svc_queue_depth") == 0
    assert value(before, "scheduler_svc_in_flight_requests") == 0
    assert value(before, "scheduler_svc_queue_capacity") == 256
    sidecar.scheduler().Generate(pb.GenerateRequest(prompt="hello there", max_tokens=2))
    after = scrape(url)
    accepted = "scheduler_svc_admission_total"
    assert (
        value(after, accepted, verdict="accepted")
        == value(before, accepted, verdict="accepted") + 1
    )
    # The answer reaches the client before the runner reports the row's end to the core loop,
    # so the gauge can still read 1 at the first scrape (seen once in CI): it must come back.
    eventually(
        lambda: value(scrape(url), "scheduler_svc_in_flight_requests") == 0,
        "the finished request leaves the in-flight gauge",
        timeout_s=10.0,
    )


def test_every_metric_the_alerts_and_dashboard_use_is_exported(
    observed: tuple[SidecarProcess, str], triton: TritonServer
) -> None:
    _, url = observed
    exported = names(url) | names(triton.metrics_url)
    rules = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "scheduler-svc.json").read_text()
    )
    exprs = [rules] + [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for expr in exprs for m in METRIC.findall(expr)}
    hpa = (ROOT / "deploy" / "k8s" / "base" / "hpa.yaml").read_text()
    used |= set(METRIC.findall(hpa))
    assert len(used) >= 8
    assert used <= exported, f"not exported: {sorted(used - exported)}"


def health(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", "health", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


def test_the_health_command_the_probes_run(observed: tuple[SidecarProcess, str]) -> None:
    sidecar, _ = observed
    address = f"127.0.0.1:{sidecar.port}"
    ready = health("--address", address)
    assert ready.returncode == 0 and "SERVING" in ready.stdout
    alive = health("--address", address, "--service", "liveness")
    assert alive.returncode == 0
    unknown = health("--address", address, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    closed = health("--address", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert closed.returncode == 1 and "UNAVAILABLE" in closed.stderr
