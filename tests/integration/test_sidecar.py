"""The sidecar's request path, end to end: real sidecar, real Triton, real engine."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import service_pb2 as kserve_pb
from tritonclient.grpc import service_pb2_grpc

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.serving.tokenizer import load_tokenizer
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.prompts import MIXED, STORY, tokens, tokens_of_length
from tests.integration.sidecar import SidecarProcess, eventually
from tests.integration.tritonio import (
    engine_metric,
    engine_request,
    infer,
    make_inputs,
    scrape,
    text_request,
    wait_engine_idle,
)

ENGINE = "tensorrt_llm"
USEFUL = "scheduler_svc_engine_tokens_total"


def ended_early(triton: TritonServer, how: str) -> float:
    return engine_metric(
        scrape(triton.metrics_url),
        "scheduler_svc_engine_requests_ended_early_total",
        ENGINE,
        how=how,
    )


def useful_tokens(triton: TritonServer) -> float:
    return engine_metric(
        scrape(triton.metrics_url), USEFUL, ENGINE, phase="generation", kind="useful"
    )


def test_generate_unary_and_stream_agree_with_the_engine(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    stub = sidecar.scheduler()
    request = pb.GenerateRequest(prompt=MIXED, max_tokens=12, tenant="acme")
    whole = stub.Generate(request)
    direct = infer(triton.grpc_url, ENGINE, engine_request(tokens(MIXED), 12)).tokens()
    assert list(whole.token_ids) == direct  # the sidecar tokenized exactly as the model does
    assert whole.text == load_tokenizer().decode(direct, skip_special_tokens=True)
    assert whole.finish_reason == pb.FINISH_REASON_LENGTH
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(tokens(MIXED)), 12)
    assert whole.lane == "hot"  # a short prompt, by the policy's default lanes
    assert (
        0 <= whole.timing.queue_ms <= whole.timing.time_to_first_token_ms <= whole.timing.total_ms
    )
    chunks = list(stub.GenerateStream(request))
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == direct
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert len(chunks) >= 12  # one message per generated token, then the final one
    assert not whole.log_probs  # none unless asked
    asked = pb.GenerateRequest(prompt=MIXED, max_tokens=12, return_log_probs=True)
    scored = infer(
        triton.grpc_url,
        ENGINE,
        engine_request(tokens(MIXED), 12, return_log_probs=np.array([[True]])),
    ).outputs[0]["output_log_probs"]
    answered = stub.Generate(asked)
    assert list(answered.log_probs) == pytest.approx(scored.reshape(-1).tolist(), abs=1e-3)
    streamed = [v for c in stub.GenerateStream(asked) for v in c.log_probs]
    assert streamed == pytest.approx(list(answered.log_probs), abs=1e-3)


def test_token_ids_in_and_stop_strings(sidecar: SidecarProcess) -> None:
    stub = sidecar.scheduler()
    ids = tokens_of_length(30)
    full = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=16))
    assert full.usage.prompt_tokens == 30
    cut_at = full.text[len(full.text) // 2 :][:2]
    stopped = stub.Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=16, stop=[cut_at])
    )
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.text == full.text[: full.text.index(cut_at)]
    assert stopped.usage.completion_tokens < 16


def test_kserve_front_serves_stock_tritonclient_sync_and_streaming(sidecar: SidecarProcess) -> None:
    expected = sidecar.scheduler().Generate(pb.GenerateRequest(prompt=MIXED, max_tokens=10)).text
    client = grpcclient.InferenceServerClient(sidecar.url)
    assert (
        client.is_server_live() and client.is_server_ready() and client.is_model_ready("ensemble")
    )
    assert client.get_model_metadata("ensemble").name == "ensemble"
    assert [i.name for i in client.get_model_config("ensemble").config.input][:2] == [
        "text_input",
        "max_tokens",
    ]
    unary = client.infer("ensemble", make_inputs(text_request(MIXED, 10)))
    assert unary.as_numpy("text_output")[0][0].decode() == expected
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer(
        "ensemble", make_inputs(text_request(MIXED, 10, stream=True)), request_id="s1"
    )
    parts = []
    while True:
        result, error = answers.get(timeout=60)
        assert error is None, error
        parts.append(result.as_numpy("text_output")[0][0].decode())  # type: ignore[attr-defined]
        if result.get_response().parameters["triton_final_response"].bool_param:  # type: ignore[attr-defined]
            break
    client.stop_stream()
    assert "".join(parts) == expected and len(parts) > 1


def test_kserve_front_serves_the_asyncio_client(sidecar: SidecarProcess) -> None:
    async def run() -> tuple[str, str]:
        client = grpcaio.InferenceServerClient(sidecar.url)
        try:
            unary = await client.infer("ensemble", make_inputs(text_request(STORY, 8)))

            async def requests() -> AsyncIterator[dict[str, object]]:
                yield {
                    "model_name": "ensemble",
                    "inputs": make_inputs(text_request(STORY, 8, stream=True)),
                }

            parts = []
            async for result, error in client.stream_infer(requests()):
                assert error is None
                parts.append(result.as_numpy("text_output")[0][0].decode())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            return unary.as_numpy("text_output")[0][0].decode(), "".join(parts)
        finally:
            await client.close()

    unary, streamed = asyncio.run(run())
    assert unary == streamed


def test_client_cancellation_mid_stream_frees_engine_blocks(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    before = useful_tokens(triton)
    ended_before = {how: ended_early(triton, how) for how in ("stopped", "cancelled")}
    call = sidecar.scheduler().GenerateStream(pb.GenerateRequest(prompt=STORY, max_tokens=800))
    for received, _chunk in enumerate(call, start=1):
        if received == 3:
            call.cancel()
            break
    wait_engine_idle(triton.metrics_url, ENGINE)
    assert useful_tokens(triton) - before < 100  # stopped long before its 800 tokens
    # The sidecar ended it with TensorRT-LLM's `stop`, not by cancelling the Triton stream.
    eventually(
        lambda: ended_early(triton, "stopped") == ended_before["stopped"] + 1,
        "the engine counts one stopped request",
    )
    assert ended_early(triton, "cancelled") == ended_before["cancelled"]
    sidecar.wait_for_events(
        "request end", lambda ends: any(e["outcome"] == "cancelled" for e in ends)
    )


def test_deadline_is_propagated_to_triton(sidecar: SidecarProcess, triton: TritonServer) -> None:
    before = useful_tokens(triton)
    with pytest.raises(grpc.RpcError) as caught:
        sidecar.scheduler().Generate(pb.GenerateRequest(prompt=STORY, max_tokens=800), timeout=0.6)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_engine_idle(triton.metrics_url, ENGINE)
    assert useful_tokens(triton) - before < 200


def _code_and_details(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    raise AssertionError("the call succeeded")


@pytest.mark.parametrize(
    ("request_", "code", "needle"),
    [
        (
            pb.GenerateRequest(prompt="", max_tokens=4),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt: empty",
        ),
        (
            pb.GenerateRequest(prompt="hi", max_tokens=5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens: 5000",
        ),
        (
            pb.GenerateRequest(prompt="hi", max_tokens=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens: 0",
        ),
        (
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 4097), max_tokens=4),
            grpc.StatusCode.INVALID_ARGUMENT,
            "4097 tokens, the model accepts at most 4096",
        ),
        (
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 10**7]), max_tokens=4),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids: 10000000",
        ),
        (
            pb.GenerateRequest(prompt="hi", max_tokens=4, sampling=pb.SamplingParams(top_p=2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            pb.GenerateRequest(prompt="hi", max_tokens=4, stop=[""]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop",
        ),
        (
            pb.GenerateRequest(prompt="x" * 5_000_000, max_tokens=4),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
    ],
    ids=[
        "empty",
        "max-tokens",
        "zero-tokens",
        "too-long",
        "bad-token",
        "top-p",
        "empty-stop",
        "oversized",
    ],
)
def test_bad_scheduler_requests(
    sidecar: SidecarProcess, request_: pb.GenerateRequest, code: grpc.StatusCode, needle: str
) -> None:
    stub = sidecar.scheduler()
    got_code, details = _code_and_details(lambda: stub.Generate(request_))
    assert got_code == code and needle in details
    assert (
        stub.Generate(
            pb.GenerateRequest(prompt="still serving", max_tokens=2)
        ).usage.completion_tokens
        == 2
    )


def test_invalid_utf8_and_bad_kserve_tensors_are_invalid_argument(sidecar: SidecarProcess) -> None:
    channel = sidecar.channel()
    raw = (
        pb.GenerateRequest(prompt="ab", max_tokens=3)
        .SerializeToString()
        .replace(b"ab", b"\xff\xfe")
    )
    code, details = _code_and_details(
        lambda: channel.unary_unary("/scheduler.v1.Scheduler/Generate")(raw)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details
    client = grpcclient.InferenceServerClient(sidecar.url)
    bad = [
        (
            {**text_request("hi", 3), "colour": np.array([[1]], dtype=np.int32)},
            "unknown input 'colour'",
        ),
        (
            {**text_request("hi", 3), "max_tokens": np.array([[3]], dtype=np.float32)},
            "has data type FP32",
        ),
        (
            {**text_request("hi", 3), "text_input": np.array([[b"\xff"]], dtype=np.object_)},
            "not valid UTF-8",
        ),
        ({**text_request("hi", 3), "max_tokens": np.array([[0]], dtype=np.int32)}, "max_tokens: 0"),
    ]
    for tensors, needle in bad:
        with pytest.raises(Exception, match=needle) as caught:
            client.infer("ensemble", make_inputs(tensors))
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="not served here"):
        client.infer("llama", make_inputs(text_request("hi", 3)))
    # Shapes numpy cannot take, on the engine contract: INVALID_ARGUMENT, not INTERNAL.
    stub = service_pb2_grpc.GRPCInferenceServiceStub(sidecar.channel())
    for shape, needle in (([-2, -3], "none negative"), ([2**32, 2**32], "too large")):
        message = kserve_pb.ModelInferRequest(model_name=ENGINE, id="shape")
        for name in ("input_ids", "input_lengths", "request_output_len"):
            tensor = message.inputs.add()
            tensor.name, tensor.datatype = name, "INT32"
            tensor.shape.extend(shape if name == "input_ids" else [1, 1])
            count = (6 if shape[0] < 0 else 0) if name == "input_ids" else 1
            message.raw_input_contents.append(np.ones(count, dtype="<i4").tobytes())
        code, details = _code_and_details(lambda m=message: stub.ModelInfer(m))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details


def test_health_reflection_and_stats(sidecar: SidecarProcess) -> None:
    channel = sidecar.channel()
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "scheduler.v1.Scheduler", "inference.GRPCInferenceService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(
        stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {
        "scheduler.v1.Scheduler",
        "scheduler.v1.Admin",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
    } <= names
    stats = sidecar.admin().GetStats(pb.GetStatsRequest())
    assert stats.backend_ready and stats.scheduler == "policy"
    assert stats.accepted_total >= stats.finished_total["ok"] > 0
    assert stats.queued == 0 and stats.max_in_flight == 16


def test_one_log_line_per_request_end(sidecar: SidecarProcess) -> None:
    stub = sidecar.scheduler()
    ids = [f"log-{i}" for i in range(3)]
    for rid in ids:
        stub.Generate(pb.GenerateRequest(request_id=rid, prompt="hello", max_tokens=2, tenant="t1"))
    sidecar.wait_for_events("request end", lambda ends: {e["request_id"] for e in ends} >= set(ids))
    ends = [e for e in sidecar.events("request end") if e["request_id"] in ids]
    assert sorted(e["request_id"] for e in ends) == ids
    for e in ends:
        assert e["tenant"] == "t1" and e["outcome"] == "ok" and e["completion_tokens"] == 2
        assert {"lane", "prompt_tokens", "queue_ms", "ttft_ms", "total_ms"} <= set(e)
