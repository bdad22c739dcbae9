"""Backend groups on two real Tritons: a canary rollout (sticky shares, automatic rollback),
precision routing, and the speculative-decoding gate.

The shipped CPU repository's `tensorrt_llm` (weights seed 0) is the main group; the variants
Triton serves its twin (`engine_twin`, the same weights), another version (`engine_seed1`, new
weights) and an engine with a one-request queue (`engine_queue`). Greedy outputs tell the
engines apart: each routed answer is compared with what its engine answers directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
import tritonclient.grpc as grpcclient

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.core.routing import share_of
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.prompts import tokens
from tests.integration.sidecar import SidecarProcess, eventually
from tests.integration.tritonio import engine_request, infer, make_inputs, scrape

PROMPT = "Route this request to the right engine, please."
MAX_TOKENS = 8
ROOT = Path(__file__).resolve().parents[2]


def direct(url: str, model: str, prompt: str = PROMPT) -> list[int]:
    answer = infer(url, model, engine_request(tokens(prompt), MAX_TOKENS))
    assert answer.error is None, answer.error
    return answer.tokens()


def generate(sidecar: SidecarProcess, **fields: object) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokens(PROMPT)), max_tokens=MAX_TOKENS)
    for key, value in fields.items():
        setattr(request, key, value)
    return list(sidecar.scheduler().Generate(request, timeout=60).token_ids)


def sessions(below: int, count: int, prefix: str) -> tuple[list[str], list[str]]:
    """Session ids whose rollout share falls below `below` (candidate) and at or above (main)."""
    names = [f"{prefix}{i}" for i in range(400)]
    low = [n for n in names if share_of(f"s:{n}") < below][:count]
    high = [n for n in names if share_of(f"s:{n}") >= below][:count]
    return low, high


def metric(sidecar: SidecarProcess, name: str, **labels: str) -> float | None:
    samples = scrape(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    value = samples.get((name, frozenset(labels.items())))
    return None if value is None else float(value)


def group_config(**sections: object) -> dict[str, object]:
    return {"server": {"metrics_port": 0}, **sections}


def test_rollout_shares_are_sticky_and_reach_both_versions(
    triton: TritonServer, variants: TritonServer, tmp_path: Path
) -> None:
    main_out = direct(triton.grpc_url, "tensorrt_llm")
    new_out = direct(variants.grpc_url, "engine_seed1")
    assert main_out != new_out  # new weights: the two versions answer differently
    config = group_config(
        groups={"candidate": {"url": variants.grpc_url, "engine_model": "engine_seed1"}},
        rollout={"candidate": "candidate", "weight": 0},
    )
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    try:
        low, high = sessions(50, 3, "conv-")
        # At 0 % every session is on the current version.
        assert all(generate(sidecar, session_id=s) == main_out for s in low + high)
        reply = sidecar.admin().SetRollout(pb.SetRolloutRequest(weight=50), timeout=10)
        assert (reply.phase, reply.weight) == ("canary", 50)
        for _ in range(2):  # the same session stays on its side, request after request
            assert all(generate(sidecar, session_id=s) == new_out for s in low)
            assert all(generate(sidecar, session_id=s) == main_out for s in high)
        # The KServe front routes by its session_id parameter the same way.
        client = grpcclient.InferenceServerClient(sidecar.url)
        inputs = engine_request(tokens(PROMPT), MAX_TOKENS)
        answer = client.infer(
            "tensorrt_llm", make_inputs(inputs), parameters={"session_id": low[0]}
        )
        assert answer.as_numpy("output_ids").reshape(-1).tolist() == new_out
        # The next configured step, then the whole of the traffic.
        advanced = sidecar.admin().SetRollout(pb.SetRolloutRequest(advance=True), timeout=10)
        assert (advanced.phase, advanced.weight) == ("hold", 100)
        assert all(generate(sidecar, session_id=s) == new_out for s in high)
        status = sidecar.admin().GetRollout(pb.GetRolloutRequest(), timeout=10)
        groups = {g.group: g for g in status.groups}
        assert groups["main"].ready and groups["candidate"].ready  # the old version is warm
        assert groups["candidate"].requests >= len(low) * 2 + len(high) + 1
        assert status.hold_left_s > 3000
        eventually(
            lambda: metric(sidecar, "scheduler_svc_group_share_percent", group="candidate") == 100,
            "the share metric follows the rollout",
            timeout_s=10,
        )
        assert metric(sidecar, "scheduler_svc_rollout_events_total", kind="step") == 2
        steps = sidecar.events("rollout step")
        assert [e["weight"] for e in steps] == [50, 100]
        # Out of range: refused by name, nothing changes.
        with pytest.raises(grpc.RpcError) as caught:
            sidecar.admin().SetRollout(pb.SetRolloutRequest(weight=150), timeout=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "0..100" in caught.value.details()
    finally:
        sidecar.stop()


def test_a_failing_candidate_is_rolled_back_automatically(
    triton: TritonServer, variants: TritonServer, tmp_path: Path
) -> None:
    # The candidate runs one sequence and queues one: under load it refuses the rest, as an
    # engine built with too small a queue would.
    config = group_config(
        groups={"candidate": {"url": variants.grpc_url, "engine_model": "engine_queue"}},
        rollout={"candidate": "candidate", "weight": 50, "min_requests": 4, "window_s": 120},
        queue={"max_in_flight": 32},
    )
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    try:
        low, high = sessions(50, 8, "load-")

        def one(session: str) -> grpc.StatusCode:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=tokens(PROMPT)), max_tokens=64, session_id=session
            )
            try:
                sidecar.scheduler().Generate(request, timeout=120)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        with ThreadPoolExecutor(16) as pool:
            codes = dict(zip(low + high, pool.map(one, low + high), strict=True))
        assert all(codes[s] == grpc.StatusCode.OK for s in high)
        refused = [s for s in low if codes[s] == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(refused) >= 4, codes
        events = sidecar.wait_for_events("rollout rolled back", bool, timeout_s=30)
        assert "error rate" in events[0]["reason"] or "SLO" in events[0]["reason"]
        status = sidecar.admin().GetRollout(pb.GetRolloutRequest(), timeout=10)
        assert (status.phase, status.weight) == ("rolled_back", 0)
        # Every session is back on the current version at once.
        main_out = direct(triton.grpc_url, "tensorrt_llm")
        assert all(generate(sidecar, session_id=s) == main_out for s in low)
        eventually(
            lambda: metric(sidecar, "scheduler_svc_rollout_events_total", kind="rollback") == 1,
            "the rollback is counted",
            timeout_s=10,
        )
        assert (
            metric(
                sidecar, "scheduler_svc_group_requests_total", group="candidate", outcome="error"
            )
            or 0
        ) >= 4
    finally:
        sidecar.stop()


def test_precision_routes_by_field_and_by_lane(
    triton: TritonServer, variants: TritonServer, tmp_path: Path
) -> None:
    fp16_out = direct(triton.grpc_url, "tensorrt_llm")
    awq_out = direct(variants.grpc_url, "engine_seed1")
    config = group_config(
        groups={"awq": {"url": variants.grpc_url, "engine_model": "engine_seed1"}},
        routes=[
            {"precision": "fp16", "group": "main"},
            {"precision": "awq", "group": "awq"},
            {"lane": "cold", "group": "awq"},
        ],
        queue={"priority_lanes": {"batch": "cold"}},
    )
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    try:
        assert generate(sidecar) == fp16_out  # the hot lane, no precision asked: main
        assert generate(sidecar, precision="awq") == awq_out
        assert generate(sidecar, precision="fp16") == fp16_out
        assert generate(sidecar, priority=pb.PRIORITY_BATCH) == awq_out  # the cold lane
        with pytest.raises(grpc.RpcError) as caught:
            generate(sidecar, precision="int8")
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "awq, fp16" in caught.value.details()

        # The HTTP fronts take it from a header: the same text as the field gives.
        def text(precision: str) -> str:
            request = pb.GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, precision=precision)
            return sidecar.scheduler().Generate(request, timeout=60).text

        def http_text(headers: dict[str, str]) -> str:
            reply = httpx.post(
                f"{sidecar.http_url}/v2/models/ensemble/generate",
                json={"text_input": PROMPT, "max_tokens": MAX_TOKENS},
                headers=headers,
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            return str(reply.json()["text_output"])

        assert text("awq") != text("fp16")
        assert http_text({"x-precision": "awq"}) == text("awq")
        assert http_text({}) == text("fp16")
        health = sidecar.admin().GetStats(pb.GetStatsRequest(), timeout=10).backends
        assert {b.role for b in health} == {"primary:main", "primary:awq"}
    finally:
        sidecar.stop()


def gate(draft: str, target: str, prompts: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_svc.cli",
            "spec-gate",
            "--draft",
            draft,
            "--target",
            target,
            "--prompts",
            str(prompts),
            "--max-tokens",
            "16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_spec_gate_measures_overlap_and_gates_the_cold_lane(
    triton: TritonServer, variants: TritonServer, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "\n".join(
            [PROMPT, "Summarise the quarterly report.", "写一首关于秋天的诗", "def add(a, b):"]
        )
    )
    target = f"{triton.grpc_url}/tensorrt_llm"
    same, other = tmp_path / "same.json", tmp_path / "other.json"
    twin = gate(f"{variants.grpc_url}/engine_twin", target, prompts, same)
    assert twin.returncode == 0, twin.stdout + twin.stderr
    assert "PASS" in twin.stdout
    assert json.loads(same.read_text())["overlap"] == {"1": 1.0, "2": 1.0, "3": 1.0, "4": 1.0}
    new = gate(f"{variants.grpc_url}/engine_seed1", target, prompts, other)
    assert new.returncode == 1, new.stdout + new.stderr
    assert "FAIL" in new.stdout
    shares = json.loads(other.read_text())["overlap"]
    assert shares["4"] < 0.2 and shares["1"] < 0.5  # different weights agree on little

    # A sidecar sends its cold lane to the speculative group only while the result passed.
    result = tmp_path / "gate.json"
    result.write_text(same.read_text())
    config = group_config(
        groups={"spec": {"url": variants.grpc_url, "engine_model": "engine_seed1"}},
        spec_gate={"group": "spec", "result_file": str(result), "check_interval_s": 0.2},
        queue={"priority_lanes": {"batch": "cold"}},
    )
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    try:
        spec_out = direct(variants.grpc_url, "engine_seed1")
        main_out = direct(triton.grpc_url, "tensorrt_llm")
        assert generate(sidecar, priority=pb.PRIORITY_BATCH) == spec_out
        assert generate(sidecar) == main_out  # other lanes never go there
        assert metric(sidecar, "scheduler_svc_spec_gate_passed") == 1
        result.write_text(other.read_text())  # the latest result fails
        eventually(
            lambda: metric(sidecar, "scheduler_svc_spec_gate_passed") == 0,
            "the sidecar reads the failed result",
            timeout_s=15,
        )
        assert generate(sidecar, priority=pb.PRIORITY_BATCH) == main_out
        overlap = metric(sidecar, "scheduler_svc_spec_gate_overlap_ratio", n="4")
        assert overlap is not None and overlap < 0.2
    finally:
        sidecar.stop()


def test_spec_gate_refuses_a_bad_address(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    done = gate("no-port/model", "127.0.0.1:1/m", prompts, tmp_path / "x.json")
    assert done.returncode == 2 and "HOST:PORT/MODEL" in done.stderr
