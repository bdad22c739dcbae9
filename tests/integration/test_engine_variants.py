"""Batching strategies and KV policies, each on its own engine in one real Triton."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.grpc as grpcclient

from reference_engine.eos import natural_length
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.prompts import tokens_of_length
from tests.integration.tritonio import (
    Answer,
    engine_metric,
    engine_request,
    infer,
    scrape,
    wait_engine_idle,
)

TOKENS = "scheduler_svc_engine_tokens_total"
KV = "nv_trt_llm_kv_cache_block_metrics"
REQ = "nv_trt_llm_request_metrics"


def two_rows(short: list[int], long: list[int], out: int) -> dict[str, np.ndarray]:
    ids = np.full((2, len(long)), 2, dtype=np.int32)
    ids[0, : len(short)], ids[1] = short, long
    return {
        "input_ids": ids,
        "input_lengths": np.array([[len(short)], [len(long)]], dtype=np.int32),
        "request_output_len": np.array([[out], [out]], dtype=np.int32),
    }


def token_counts(server: TritonServer, model: str) -> dict[str, float]:
    samples = scrape(server.metrics_url)
    return {
        f"{phase}_{kind}": engine_metric(samples, TOKENS, model, phase=phase, kind=kind)
        for phase in ("context", "generation")
        for kind in ("processed", "useful")
    }


def run_padded_batch(server: TritonServer, model: str) -> tuple[dict[str, float], Answer]:
    before = token_counts(server, model)
    answer = infer(server.grpc_url, model, two_rows(tokens_of_length(10), tokens_of_length(80), 4))
    assert answer.error is None and answer.final
    wait_engine_idle(server.metrics_url, model)
    after = token_counts(server, model)
    return {k: after[k] - before[k] for k in after}, answer


def test_static_batching_computes_the_padding(variants: TritonServer, triton: TritonServer) -> None:
    static, static_answer = run_padded_batch(variants, "engine_static")
    assert static["context_useful"] == 10 + 80
    assert static["context_processed"] == 2 * 80  # both rows prefilled at the longest length
    inflight, inflight_answer = run_padded_batch(triton, "tensorrt_llm")
    assert inflight["context_processed"] == inflight["context_useful"] == 90
    # Same weights, same greedy tokens: padding changes the cost, not the answer.
    for row in (0, 1):
        assert static_answer.tokens(row) == inflight_answer.tokens(row)


def test_static_rows_that_finish_early_keep_computing(variants: TritonServer) -> None:
    before = token_counts(variants, "engine_static")
    ids = np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int32)
    answer = infer(
        variants.grpc_url,
        "engine_static",
        {
            "input_ids": ids,
            "input_lengths": np.array([[3], [3]], dtype=np.int32),
            "request_output_len": np.array([[2], [10]], dtype=np.int32),
        },
    )
    assert answer.error is None and len(answer.tokens(0)) == 2 and len(answer.tokens(1)) == 10
    wait_engine_idle(variants.metrics_url, "engine_static")
    after = token_counts(variants, "engine_static")
    # 9 lockstep decode steps for 2 rows; the short row contributes only 1 useful one.
    assert after["generation_processed"] - before["generation_processed"] == 18
    assert after["generation_useful"] - before["generation_useful"] == 1 + 9


def _flood(server: TritonServer, model: str, n: int) -> tuple[list[Answer], list[dict[str, float]]]:
    """n concurrent requests of 100 + 60 tokens while the metrics are sampled."""
    samples: list[dict[str, float]] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            s = scrape(server.metrics_url)
            samples.append(
                {
                    "used": engine_metric(s, KV, model, kv_cache_block_type="used"),
                    "max": engine_metric(s, KV, model, kv_cache_block_type="max"),
                    "active": engine_metric(s, REQ, model, request_type="active"),
                    "waiting": engine_metric(s, REQ, model, request_type="waiting"),
                }
            )
            stop.wait(0.02)

    watcher = threading.Thread(target=sampler)
    watcher.start()
    prompts = [tokens_of_length(100 + i) for i in range(n)]
    try:
        with ThreadPoolExecutor(n) as pool:
            answers = list(
                pool.map(lambda p: infer(server.grpc_url, model, engine_request(p, 60)), prompts)
            )
    finally:
        stop.set()
        watcher.join()
    return answers, samples


def paused_total(server: TritonServer, model: str) -> float:
    samples = scrape(server.metrics_url)
    return engine_metric(samples, "scheduler_svc_engine_paused_requests_total", model)


def test_guaranteed_no_evict_never_oversubscribes(variants: TritonServer) -> None:
    # 32 blocks of 16; each request reserves ceil(160 / 16) = 10 or 11, so at most 3 run at once.
    answers, samples = _flood(variants, "engine_noevict", 6)
    assert all(a.error is None and len(a.tokens()) == 60 for a in answers)
    assert max(s["active"] for s in samples) <= 3
    assert max(s["used"] for s in samples) <= samples[0]["max"]
    assert max(s["waiting"] for s in samples) > 0  # the reservation really held requests back
    assert paused_total(variants, "engine_noevict") == 0


def test_max_utilization_pauses_and_recomputes_correctly(variants: TritonServer) -> None:
    noevict, _ = _flood(variants, "engine_noevict", 6)
    maxutil, samples = _flood(variants, "engine_maxutil", 6)
    assert all(a.error is None and len(a.tokens()) == 60 for a in maxutil)
    assert max(s["active"] for s in samples) > 3  # admitted on prompts alone
    assert paused_total(variants, "engine_maxutil") > 0
    # Recomputed requests produce exactly what reserved ones produce.
    assert [a.tokens() for a in maxutil] == [a.tokens() for a in noevict]


def test_full_queue_answers_with_trtllm_wording(variants: TritonServer) -> None:
    model = "engine_queue"  # one sequence at a time, one waiting
    started = threading.Event()

    def first_token(answer: Answer, client: grpcclient.InferenceServerClient) -> bool:
        started.set()
        return False

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(
            infer,
            variants.grpc_url,
            model,
            engine_request(tokens_of_length(20), 300, streaming=True),
            request_id="runner",
            on_output=first_token,
        )
        assert started.wait(60)
        waiting = pool.submit(
            infer,
            variants.grpc_url,
            model,
            engine_request(tokens_of_length(20), 300),
            request_id="waiter",
        )
        s = scrape(variants.metrics_url)
        while engine_metric(s, REQ, model, request_type="waiting") < 1:
            s = scrape(variants.metrics_url)
        rejected = infer(variants.grpc_url, model, engine_request(tokens_of_length(20), 5))
        assert rejected.error is not None and "Exceeds maximum queue size" in rejected.error
        for rid in ("waiter", "runner"):
            stop = engine_request([1], 1, stop=np.array([[True]]))
            assert infer(variants.grpc_url, model, stop, request_id=rid).error is None
        assert running.result().final and waiting.result().final


def test_request_that_can_never_fit_fails_at_once(variants: TritonServer) -> None:
    answer = infer(variants.grpc_url, "engine_noevict", engine_request(tokens_of_length(300), 300))
    assert answer.error is not None
    assert "needs 38 KV blocks" in answer.error and "can never run" in answer.error


def test_the_synthetic_end_of_sequence_model_ends_rows_at_their_drawn_lengths(
    variants: TritonServer,
) -> None:
    """With `eos_model: lognormal` the real engine stops each row where the draw for its prompt
    says, well short of a generous max tokens, and the same prompt stops at the same place."""
    lengths = []
    for n in (5, 9, 17, 33, 65):
        prompt = tokens_of_length(n)
        answer = infer(variants.grpc_url, "engine_eos", engine_request(prompt, 400))
        assert answer.error is None and answer.final
        drawn = natural_length(prompt, 12.0, 0.8, 0)
        assert len(answer.tokens()) == min(drawn, 400)
        again = infer(variants.grpc_url, "engine_eos", engine_request(prompt, 400))
        assert again.tokens() == answer.tokens()
        lengths.append(len(answer.tokens()))
    assert len(set(lengths)) > 1 and max(lengths) < 400


def test_kv_cache_reuse_skips_a_cached_prefix_and_answers_the_same(
    variants: TritonServer, triton: TritonServer
) -> None:
    """The same 80-token prompt twice on an engine with enable_kv_cache_reuse: the second
    prefills only the last of its five 16-token blocks (at least one token is fed), exports the
    reuse, and generates the tokens the engine without reuse does."""
    model, prompt = "engine_reuse", tokens_of_length(80)

    def counts() -> dict[str, float]:
        s = scrape(variants.metrics_url)
        found = {
            kind: engine_metric(s, "scheduler_svc_engine_prompt_tokens_total", model, kind=kind)
            for kind in ("admitted", "reused")
        }
        found["context"] = engine_metric(s, TOKENS, model, phase="context", kind="processed")
        found["reused_blocks"] = engine_metric(s, KV, model, kv_cache_block_type="reused")
        found["reusable"] = engine_metric(s, "scheduler_svc_engine_kv_reusable_blocks", model)
        return found

    before = counts()
    answers = []
    for _ in range(2):
        answers.append(infer(variants.grpc_url, model, engine_request(prompt, 6)))
        wait_engine_idle(variants.metrics_url, model)  # cached blocks count as free
    after = counts()
    delta = {key: after[key] - before[key] for key in after}
    assert delta["admitted"] == 160 and delta["reused"] == 64
    assert delta["context"] == 80 + 16
    assert delta["reused_blocks"] == 4 and after["reusable"] >= 5
    plain = infer(triton.grpc_url, "tensorrt_llm", engine_request(prompt, 6))
    assert all(a.error is None for a in (*answers, plain))
    assert answers[0].tokens() == answers[1].tokens() == plain.tokens()
    assert len(plain.tokens()) == 6
