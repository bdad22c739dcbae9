"""The reference engine with emulated timing (model_repo/emulated's engine) under real Triton:
what it streams, that a step lasts at least its modelled time, what it exports, and the sidecar
in front of it following its shape."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from reference_engine.emulated import FIRST_ORDINARY_ID, FIRST_SPECIAL_ABOVE
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.profiles import load_profile
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.conftest import EMULATED_SCALE
from tests.integration.prompts import tokens_of_length
from tests.integration.sidecar import SidecarProcess
from tests.integration.tritonio import (
    Answer,
    engine_metric,
    engine_request,
    infer,
    scrape,
    wait_engine_idle,
)

MODEL = "engine_emulated"
H200 = load_profile("h200-8b-bf16")


def _ttft(url: str, tensors: dict[str, np.ndarray]) -> tuple[Answer, float]:
    first: list[float] = []
    start = time.monotonic()

    def mark(answer: Answer, _client: object) -> bool:
        if not first and answer.tokens():
            first.append(time.monotonic() - start)
        return False

    answer = infer(url, MODEL, tensors, on_output=mark)
    return answer, first[0]


def test_the_emulated_engine_streams_ordinary_ids_that_repeat_for_a_prompt(
    variants: TritonServer,
) -> None:
    prompt = tokens_of_length(128)
    answers = [
        infer(variants.grpc_url, MODEL, engine_request(prompt, 8, streaming=True)) for _ in range(2)
    ]
    for answer in answers:
        assert answer.error is None and answer.final
        assert len(answer.tokens()) == 8
        assert all(FIRST_ORDINARY_ID <= t < FIRST_SPECIAL_ABOVE for t in answer.tokens())
    assert answers[0].tokens() == answers[1].tokens()  # greedy: the prompt decides
    other = infer(variants.grpc_url, MODEL, engine_request(tokens_of_length(129), 8))
    assert other.error is None and other.tokens() != answers[0].tokens()
    logged = infer(
        variants.grpc_url,
        MODEL,
        engine_request(prompt, 3, return_log_probs=np.array([[True]])),
    )
    probs = [float(v) for o in logged.outputs for v in o["output_log_probs"].reshape(-1)]
    uniform = -np.log(FIRST_SPECIAL_ABOVE - FIRST_ORDINARY_ID)
    assert probs == pytest.approx([uniform] * 3, rel=1e-5)


def test_a_step_lasts_at_least_its_modelled_time_and_the_engine_says_how_it_kept_up(
    variants: TritonServer,
) -> None:
    wait_engine_idle(variants.metrics_url, MODEL)
    before = scrape(variants.metrics_url)
    answer, ttft = _ttft(
        variants.grpc_url, engine_request(tokens_of_length(128), 4, streaming=True)
    )
    assert answer.error is None and len(answer.tokens()) == 4
    # The pacer holds every step to at least its modelled time x the scale: a lower bound.
    assert ttft >= H200.prefill_s(128) * EMULATED_SCALE
    wait_engine_idle(variants.metrics_url, MODEL)
    after = scrape(variants.metrics_url)

    def moved(name: str, **labels: str) -> float:
        return engine_metric(after, name, MODEL, **labels) - engine_metric(
            before, name, MODEL, **labels
        )

    steps = moved("nv_trt_llm_general_metrics", general_type="iteration_counter")
    assert steps == 4  # the prompt's step (it samples the first token), then three decodes
    assert moved("scheduler_svc_engine_step_rows_total") == 4
    paced = moved("scheduler_svc_engine_step_paced_seconds_total")
    modelled = H200.prefill_s(128) + sum(H200.step_s(1, 128 + i, 0) for i in range(3))
    assert paced == pytest.approx(modelled * EMULATED_SCALE, abs=0.004)
    work = moved("scheduler_svc_engine_step_work_seconds_total")
    overruns = moved("scheduler_svc_engine_step_overruns_total")
    assert 0 <= work <= paced + 0.004 and 0 <= overruns <= steps
    assert engine_metric(after, "nv_trt_llm_request_metrics", MODEL, request_type="max") == 256


@pytest.mark.parametrize("scheduler", ["fifo", "policy"])
def test_the_sidecar_runs_as_many_requests_as_the_engine_runs_sequences(
    variants: TritonServer, tmp_path: Path, scheduler: str
) -> None:
    config = {
        "triton": {"engine_model": MODEL, "metrics_url": variants.metrics_url},
        "queue": {"scheduler": scheduler},
    }
    sidecar = SidecarProcess(variants.grpc_url, tmp_path, config).start()
    try:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokens_of_length(64)), max_tokens=3)
        answer = sidecar.scheduler().Generate(request, timeout=60)
        assert answer.usage.completion_tokens == 3
        stats = sidecar.admin().GetStats(pb.GetStatsRequest())
        assert stats.backend_ready and stats.max_in_flight == 256  # not 16
    except grpc.RpcError as exc:
        raise AssertionError(f"{exc}\n" + "\n".join(sidecar.lines[-40:])) from None
    finally:
        sidecar.stop()
