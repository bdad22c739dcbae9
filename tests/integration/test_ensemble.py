"""The ensemble text contract (preprocessing -> tensorrt_llm -> postprocessing) on a real Triton."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio

from scheduler_svc.serving.tokenizer import load_tokenizer
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.prompts import MIXED, tokens
from tests.integration.tritonio import engine_request, infer, make_inputs, text_request


def test_text_round_trips_through_the_real_tokenizer(triton: TritonServer) -> None:
    tokenizer = load_tokenizer()
    ids = tokens(MIXED)
    assert tokenizer.decode(ids) == MIXED  # the real DeepSeek-V4 tokenizer is lossless here
    engine = infer(triton.grpc_url, "tensorrt_llm", engine_request(ids, 14))
    text = infer(triton.grpc_url, "ensemble", text_request(MIXED, 14))
    assert text.error is None and text.final
    assert text.texts() == [tokenizer.decode(engine.tokens(), skip_special_tokens=True).encode()]


def test_streaming_text_comes_one_token_at_a_time(triton: TritonServer) -> None:
    tokenizer = load_tokenizer()
    engine = infer(triton.grpc_url, "tensorrt_llm", engine_request(tokens(MIXED), 8))
    streamed = infer(triton.grpc_url, "ensemble", text_request(MIXED, 8, stream=True))
    assert streamed.error is None and streamed.final
    assert streamed.texts() == [
        tokenizer.decode([t], skip_special_tokens=True).encode() for t in engine.tokens()
    ]


def test_asyncio_tritonclient_streams_unchanged(triton: TritonServer) -> None:
    async def run() -> list[object]:
        client = grpcaio.InferenceServerClient(triton.grpc_url)

        async def requests() -> AsyncIterator[dict[str, object]]:
            inputs = make_inputs(text_request(MIXED, 6, stream=True))
            yield {"model_name": "ensemble", "inputs": inputs}

        chunks = []
        try:
            async for result, error in client.stream_infer(requests()):
                assert error is None
                chunks.append(result.as_numpy("text_output"))
                if len(chunks) == 6:
                    break
        finally:
            await client.close()
        return chunks

    assert len(asyncio.run(run())) == 6


def test_log_probs_pass_through_the_ensemble(triton: TritonServer) -> None:
    asked = {**text_request(MIXED, 6), "return_log_probs": np.array([[True]])}
    text = infer(triton.grpc_url, "ensemble", asked)
    engine = infer(
        triton.grpc_url,
        "tensorrt_llm",
        engine_request(tokens(MIXED), 6, return_log_probs=np.array([[True]])),
    )
    assert text.error is None and engine.error is None
    out, reference = text.outputs[0], engine.outputs[0]
    assert out["output_log_probs"].shape == (1, 1, 6)
    assert out["output_log_probs"] == pytest.approx(reference["output_log_probs"], abs=1e-4)
    assert out["cum_log_probs"] == pytest.approx(reference["cum_log_probs"], abs=1e-3)
    plain = infer(triton.grpc_url, "ensemble", text_request(MIXED, 6))
    assert plain.error is None and "output_log_probs" not in plain.outputs[0]
    assert plain.texts() == text.texts()


def test_empty_prompt_is_refused_clearly(triton: TritonServer) -> None:
    answer = infer(triton.grpc_url, "ensemble", text_request("", 4))
    assert answer.error is not None and "text_input" in answer.error
