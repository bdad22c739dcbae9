"""The CPU reference engine through TensorRT-LLM's `tensorrt_llm` contract on a real Triton."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.prompts import MIXED, tokens, tokens_of_length
from tests.integration.tritonio import (
    Answer,
    engine_metric,
    engine_request,
    infer,
    scrape,
    wait_engine_idle,
)

MODEL = "tensorrt_llm"
KV = "nv_trt_llm_kv_cache_block_metrics"
REQ = "nv_trt_llm_request_metrics"
TOKENS = "scheduler_svc_engine_tokens_total"


def generate(server: TritonServer, prompt: list[int], n: int, **kw: object) -> Answer:
    answer = infer(server.grpc_url, MODEL, engine_request(prompt, n, **kw))  # type: ignore[arg-type]
    assert answer.error is None, answer.error
    assert answer.final
    return answer


def test_non_streaming_returns_all_tokens_at_once(triton: TritonServer) -> None:
    answer = generate(triton, tokens(MIXED), 12)
    assert len(answer.outputs) == 1
    out = answer.outputs[0]
    assert out["output_ids"].shape == (1, 1, 12)
    assert out["sequence_length"].tolist() == [[12]]
    assert out["batch_index"].tolist() == [[0]]


def test_streaming_sends_each_token_and_matches_non_streaming(triton: TritonServer) -> None:
    prompt = tokens(MIXED)
    streamed = generate(triton, prompt, 10, streaming=True)
    assert [o["output_ids"].shape for o in streamed.outputs] == [(1, 1, 1)] * 10
    assert streamed.tokens() == generate(triton, prompt, 10).tokens()


def test_identical_greedy_requests_give_identical_outputs(triton: TritonServer) -> None:
    prompt = tokens_of_length(40)
    first = generate(triton, prompt, 16).tokens()
    assert generate(triton, prompt, 16).tokens() == first
    with ThreadPoolExecutor(4) as pool:  # the same request, batched with itself
        together = list(pool.map(lambda _: generate(triton, prompt, 16).tokens(), range(4)))
    assert together == [first] * 4
    assert len(set(first)) > 1  # the model says something, not one token forever


def test_several_rows_answer_per_row_with_batch_index(triton: TritonServer) -> None:
    a, b = tokens_of_length(7), tokens(MIXED)
    ids = np.full((2, max(len(a), len(b))), 2, dtype=np.int32)
    ids[0, : len(a)], ids[1, : len(b)] = a, b
    answer = infer(
        triton.grpc_url,
        MODEL,
        {
            "input_ids": ids,
            "input_lengths": np.array([[len(a)], [len(b)]], dtype=np.int32),
            "request_output_len": np.array([[5], [9]], dtype=np.int32),
        },
    )
    assert answer.error is None and answer.final
    assert sorted(int(o["batch_index"][0, 0]) for o in answer.outputs) == [0, 1]
    assert answer.tokens(0) == generate(triton, a, 5).tokens()
    assert answer.tokens(1) == generate(triton, b, 9).tokens()


def test_end_id_stops_generation_before_that_token(triton: TritonServer) -> None:
    prompt = tokens_of_length(20)
    full = generate(triton, prompt, 12).tokens()
    end = full[4]
    expected = full[: full.index(end)]
    got = generate(triton, prompt, 12, end_id=np.array([[end]], dtype=np.int32)).tokens()
    assert got == expected
    assert len(got) < 12


def test_sampling_is_seeded(triton: TritonServer) -> None:
    prompt = tokens(MIXED)

    def sample(seed: int) -> list[int]:
        return generate(
            triton,
            prompt,
            12,
            temperature=np.array([[1.0]], dtype=np.float32),
            runtime_top_k=np.array([[50]], dtype=np.int32),
            random_seed=np.array([[seed]], dtype=np.uint64),
        ).tokens()

    assert sample(7) == sample(7)
    assert sample(7) != generate(triton, prompt, 12).tokens()
    # random_seed is a uint64: the largest one samples too (it used to fail the engine step).
    top = 2**64 - 1
    assert sample(top) == sample(top) and len(sample(top)) == 12


def test_log_probs_come_per_token_and_streamed_as_whole(triton: TritonServer) -> None:
    prompt, asked = tokens(MIXED), {"return_log_probs": np.array([[True]])}
    whole = generate(triton, prompt, 10, **asked)
    out = whole.outputs[0]
    values = out["output_log_probs"]
    assert values.dtype == np.float32 and values.shape == (1, 1, 10)
    assert np.all(values <= 0) and np.all(np.isfinite(values))
    assert out["cum_log_probs"].shape == (1, 1)
    assert float(out["cum_log_probs"][0, 0]) == pytest.approx(float(values.sum()), rel=1e-5)
    assert out["sequence_index"].tolist() == [[0]]
    streamed = generate(triton, prompt, 10, streaming=True, **asked)
    assert streamed.tokens() == whole.tokens() == generate(triton, prompt, 10).tokens()
    pieces = np.concatenate([o["output_log_probs"].reshape(-1) for o in streamed.outputs])
    assert pieces == pytest.approx(values.reshape(-1), abs=1e-4)
    running = [float(o["cum_log_probs"][0, 0]) for o in streamed.outputs]
    assert running == pytest.approx(np.cumsum(pieces).tolist(), abs=1e-3)
    # Sampled tokens are scored under the distribution they were drawn from; unasked, no log
    # probabilities come back.
    sampled = generate(
        triton,
        prompt,
        6,
        temperature=np.array([[0.5]], dtype=np.float32),
        runtime_top_k=np.array([[8]], dtype=np.int32),
        random_seed=np.array([[3]], dtype=np.uint64),
        **asked,
    )
    drawn = sampled.outputs[0]["output_log_probs"]
    assert drawn.shape == (1, 1, 6) and np.all(drawn <= 0) and np.all(np.isfinite(drawn))
    assert "output_log_probs" not in generate(triton, prompt, 4).outputs[0]


@pytest.mark.parametrize(
    ("tensors", "needle"),
    [
        (
            engine_request([5, 6, 7], 4, input_lengths=np.array([[9]], dtype=np.int32)),
            "input_lengths: row 0 claims 9 tokens",
        ),
        (
            engine_request([5, 6, 7], 4, input_lengths=np.array([[-3]], dtype=np.int32)),
            "input_lengths: row 0 has length -3",
        ),
        (engine_request([5, 6, 7], 0), "request_output_len: row 0 asks for 0"),
        (engine_request([5, 6, 7], 5000), "request_output_len: row 0 asks for 5000"),
        (engine_request([5, 999_999, 7], 4), "input_ids: row 0 holds token id 999999"),
        (engine_request(list(range(10, 5000)), 4), "above max_input_len"),
        (
            {**engine_request([5, 6], 4), "input_ids": np.array([[5, 6]], dtype=np.int64)},
            "input 'input_ids' data-type is 'INT64'",
        ),
        (
            {k: v for k, v in engine_request([5, 6], 4).items() if k != "request_output_len"},
            "request_output_len",
        ),
    ],
    ids=[
        "length-beyond-row",
        "negative-length",
        "zero-output",
        "output-above-limit",
        "token-outside-vocab",
        "prompt-too-long",
        "wrong-dtype",
        "missing-tensor",
    ],
)
def test_bad_input_is_a_clear_error_and_the_next_request_is_served(
    triton: TritonServer, tensors: dict[str, np.ndarray], needle: str
) -> None:
    answer = infer(triton.grpc_url, MODEL, tensors)
    assert answer.error is not None and needle in answer.error
    assert len(generate(triton, [5, 6, 7], 3).tokens()) == 3


def test_stop_request_ends_the_request_with_the_same_id(triton: TritonServer) -> None:
    stopper: list[Answer] = []

    def stop_after_three(answer: Answer, client: grpcclient.InferenceServerClient) -> bool:
        if len(answer.tokens()) == 3 and not stopper:
            stop = engine_request([1], 1, stop=np.array([[True]]))
            threading.Thread(
                target=lambda: stopper.append(
                    infer(triton.grpc_url, MODEL, stop, request_id="stop-me")
                )
            ).start()
        return False

    answer = infer(
        triton.grpc_url,
        MODEL,
        engine_request(tokens(MIXED), 400, streaming=True),
        request_id="stop-me",
        on_output=stop_after_three,
    )
    assert answer.final and answer.error is None
    assert 3 <= len(answer.tokens()) < 400


def test_cancelled_request_frees_its_blocks_promptly(triton: TritonServer) -> None:
    before = scrape(triton.metrics_url)
    seen: dict[str, float] = {}

    def cancel_after_three(answer: Answer, client: grpcclient.InferenceServerClient) -> bool:
        if len(answer.tokens()) == 3:
            # The engine publishes its gauges after a step, not with each token: look a few
            # times while the request is still running (it has ~800 tokens to go).
            for _ in range(20):
                samples = scrape(triton.metrics_url)
                seen["used"] = engine_metric(samples, KV, MODEL, kv_cache_block_type="used")
                if seen["used"] > 0:
                    break
            return True
        return False

    answer = infer(
        triton.grpc_url,
        MODEL,
        engine_request(tokens_of_length(300), 800, streaming=True),
        on_output=cancel_after_three,
    )
    assert not answer.final
    assert seen["used"] > 0  # the request held blocks while it ran
    wait_engine_idle(triton.metrics_url, MODEL)
    after = scrape(triton.metrics_url)
    produced = engine_metric(
        after, TOKENS, MODEL, phase="generation", kind="useful"
    ) - engine_metric(before, TOKENS, MODEL, phase="generation", kind="useful")
    assert produced < 100  # it stopped long before its 800 tokens


def test_metrics_have_trtllm_names_labels_and_move(triton: TritonServer) -> None:
    idle = scrape(triton.metrics_url)
    blocks = engine_metric(idle, KV, MODEL, kv_cache_block_type="max")
    assert blocks == 16384 / 16
    assert engine_metric(idle, KV, MODEL, kv_cache_block_type="tokens_per") == 16
    assert engine_metric(idle, REQ, MODEL, request_type="max") == 16
    for label in ("paused_requests", "total_context_tokens", "generation_requests"):
        engine_metric(
            idle,
            "nv_trt_llm_inflight_batcher_metrics",
            MODEL,
            inflight_batcher_specific_metric=label,
        )
    seen: list[tuple[float, float, float]] = []

    def look(answer: Answer, client: grpcclient.InferenceServerClient) -> bool:
        samples = scrape(triton.metrics_url)
        seen.append(
            (
                engine_metric(samples, KV, MODEL, kv_cache_block_type="used"),
                engine_metric(samples, REQ, MODEL, request_type="active"),
                engine_metric(samples, KV, MODEL, kv_cache_block_type="fraction"),
            )
        )
        return False

    generate_len = 60
    prompt = tokens_of_length(100)
    answer = infer(
        triton.grpc_url, MODEL, engine_request(prompt, generate_len, streaming=True), on_output=look
    )
    assert answer.final
    # guaranteed_no_evict reserves prompt + maximum output at once: ceil(160 / 16) = 10 blocks.
    assert {used for used, _, _ in seen} <= {0, 10}
    assert (10, 1, 10 / blocks) in seen
    wait_engine_idle(triton.metrics_url, MODEL)  # the idle state has been published
    done = scrape(triton.metrics_url)
    iterations = "nv_trt_llm_general_metrics"
    assert (
        engine_metric(done, iterations, MODEL, general_type="iteration_counter")
        >= engine_metric(idle, iterations, MODEL, general_type="iteration_counter") + generate_len
    )
