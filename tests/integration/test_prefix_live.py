"""Prefix and session affinity on two real Tritons behind one sidecar: a session's turns land
on the replica that holds its prefix, and that replica serves the prefix from its KV cache.

Both Tritons serve a copy of the CPU engine with `enable_kv_cache_reuse` on. Each session is
three turns, each resending the conversation so far; the sessions share nothing, so the first
turns go by load (round robin over idle replicas) and the later ones by affinity. Which
replica served a turn is read from the engines' own prompt-token counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.conftest import _start, render_engine
from tests.integration.prompts import tokens_of_length
from tests.integration.sidecar import SidecarProcess
from tests.integration.tritonio import engine_metric, scrape, wait_engine_idle

MODEL = "tensorrt_llm"
PROMPTS = "scheduler_svc_engine_prompt_tokens_total"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TritonServer]]:
    repo = tmp_path_factory.mktemp("reuse-repo")
    render_engine(repo, MODEL, {"enable_kv_cache_reuse": "true"})
    logs = tmp_path_factory.mktemp("logs")
    servers = [_start(repo, logs / f"triton-reuse-{i}.log") for i in range(2)]
    yield servers
    for server in servers:
        server.stop()


def prompt_counts(server: TritonServer) -> tuple[float, float]:
    samples = scrape(server.metrics_url)
    return (
        engine_metric(samples, PROMPTS, MODEL, kind="admitted"),
        engine_metric(samples, PROMPTS, MODEL, kind="reused"),
    )


def test_a_sessions_turns_land_on_the_replica_holding_its_prefix(
    pair: list[TritonServer], tmp_path: Path
) -> None:
    first, second = pair
    config = {
        "server": {"metrics_port": 0},
        "triton": {
            "metrics_url": first.metrics_url,
            "replicas": [{"url": second.grpc_url, "metrics_url": second.metrics_url}],
        },
    }
    text = tokens_of_length(400)
    sidecar = SidecarProcess(first.grpc_url, tmp_path, config).start()
    placed: dict[str, list[int]] = {}
    reused: dict[str, list[float]] = {}
    try:
        stub = sidecar.scheduler()
        for turn in range(3):
            for s in range(4):
                session = f"chat-{s}"
                # Each session its own 48-token opening, then 32 more tokens a turn.
                prompt = text[s * 100 : s * 100 + 48 + 32 * turn]
                before = [prompt_counts(server) for server in pair]
                reply = stub.Generate(
                    pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=prompt), max_tokens=4, session_id=session
                    ),
                    timeout=60,
                )
                assert len(reply.token_ids) == 4
                for server in pair:
                    wait_engine_idle(server.metrics_url, MODEL)
                after = [prompt_counts(server) for server in pair]
                [where] = [i for i in (0, 1) if after[i][0] > before[i][0]]
                placed.setdefault(session, []).append(where)
                reused.setdefault(session, []).append(after[where][1] - before[where][1])
    finally:
        sidecar.stop()
    # The first turns spread over both replicas; every later turn follows its session.
    assert {turns[0] for turns in placed.values()} == {0, 1}
    for session, turns in placed.items():
        assert turns == [turns[0]] * 3, (session, turns)
        # The later turns find the conversation so far cached: its full 16-token blocks.
        assert reused[session] == [0, 48, 80], (session, reused[session])
