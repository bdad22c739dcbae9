"""Real tritonserver fixtures: started once per session on free ports, never mocked."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduler_svc.tools.modelrepo import STATIC_ENGINE, copy_engine_variant
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.sidecar import SidecarProcess
from tests.integration.tritonio import engine_models, scrape, wait_engine_idle

ROOT = Path(__file__).resolve().parents[2]
CPU_REPO = ROOT / "model_repo" / "cpu"
EMULATED_ENGINE = ROOT / "model_repo" / "emulated" / "tensorrt_llm"
# The shipped emulated engine (h200-8b-bf16), slowed 20x so that this machine keeps its time.
EMULATED_SCALE = 20

# Engine variants served side by side by a second Triton: (model name, parameter overrides).
VARIANTS: dict[str, dict[str, str]] = {
    "engine_static": STATIC_ENGINE,
    "engine_noevict": {
        "batch_scheduler_policy": "guaranteed_no_evict",
        "max_tokens_in_paged_kv_cache": "512",
        "max_num_sequences": "8",
    },
    "engine_maxutil": {
        "batch_scheduler_policy": "max_utilization",
        "max_tokens_in_paged_kv_cache": "512",
        "max_num_sequences": "8",
    },
    "engine_queue": {"max_num_sequences": "1", "max_queue_size": "1"},
    "engine_eos": {"eos_model": "lognormal", "eos_mean_tokens": "12"},
    "engine_reuse": {"enable_kv_cache_reuse": "true"},
    # Backend groups: the CPU engine's twin (the same weights) and another version (new weights).
    "engine_twin": {},
    "engine_seed1": {},
}
# Lines appended to a variant's config (parameters the CPU engine's config leaves at default).
VARIANT_EXTRA: dict[str, str] = {
    "engine_seed1": 'parameters: { key: "model_seed" value: { string_value: "1" } }\n',
}

_started: list[TritonServer] = []


def render_engine(dst_repo: Path, name: str, overrides: dict[str, str], extra: str = "") -> None:
    """Copy the CPU engine model under a new name with some parameters changed."""
    copy_engine_variant(CPU_REPO / "tensorrt_llm", dst_repo, name, overrides, extra)


def _start(repo: Path, log_path: Path, extra_args: Sequence[str] = ()) -> TritonServer:
    log_file = log_path.open("w")
    server = TritonServer(
        repo,
        grpc_port=0,
        http_port=0,
        metrics_port=0,
        log=lambda line: print(line, file=log_file, flush=True),
        extra_args=extra_args,
    )
    server.start()
    _started.append(server)
    return server


@dataclass(frozen=True)
class ExternalTriton:
    """A Triton someone else started (deploy/gpu_check.sh: TensorRT-LLM on a GPU)."""

    grpc_url: str
    metrics_url: str


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer | ExternalTriton]:
    """The shipped `model_repo/cpu`, exactly as `make run` serves it; or, when
    SCHEDULER_SVC_TRITON="GRPC_HOST:PORT,METRICS_URL" is set, that server instead."""
    external = os.environ.get("SCHEDULER_SVC_TRITON")
    if external:
        grpc_url, _, metrics_url = external.partition(",")
        yield ExternalTriton(grpc_url, metrics_url)
        return
    server = _start(CPU_REPO, tmp_path_factory.mktemp("logs") / "triton-cpu.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def variants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """Engine variants (static batching, small pools, a tiny queue, emulated timing) in one
    more Triton."""
    repo = tmp_path_factory.mktemp("variants")
    for name, overrides in VARIANTS.items():
        render_engine(repo, name, overrides, VARIANT_EXTRA.get(name, ""))
    copy_engine_variant(
        EMULATED_ENGINE, repo, "engine_emulated", {"time_scale": str(EMULATED_SCALE)}
    )
    server = _start(repo, tmp_path_factory.mktemp("logs") / "triton-variants.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sidecar(
    triton: TritonServer | ExternalTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SidecarProcess]:
    """The real sidecar, default config, in front of the shipped CPU repository."""
    process = SidecarProcess(triton.grpc_url, tmp_path_factory.mktemp("sidecar")).start()
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def kv_pool_back_to_free() -> Iterator[None]:
    """After every test, every engine of every running Triton is idle with all blocks free."""
    yield
    for server in _started:
        if not server.running:
            continue
        for model in sorted(engine_models(scrape(server.metrics_url))):
            try:
                wait_engine_idle(server.metrics_url, model)
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}\nlast Triton log lines:\n{server.log_tail(60)}"
                ) from None
