"""Chunked context on the real model: the same tokens as a whole prefill, decoding in between;
and the log probabilities the runner reports."""

from __future__ import annotations

import math

import pytest

from reference_engine.batcher import Batcher
from reference_engine.config import EngineConfig, ModelSpec
from reference_engine.llama import ModelRunner
from reference_engine.request import RowSpec, Sampling


def generate(
    log_probs: dict[str, list[float]] | None = None, **overrides: object
) -> dict[str, list[int]]:
    cfg = EngineConfig(
        max_input_len=96,
        max_output_len=8,
        max_num_sequences=4,
        max_tokens_in_paged_kv_cache=1024,
        model=ModelSpec(vocab_size=1024, num_layers=2),
        **overrides,  # type: ignore[arg-type]
    )
    batcher, runner = Batcher(cfg), ModelRunner(cfg)
    prompts = {"short": tuple(range(100, 110)), "long": tuple(range(200, 290))}
    requests = {
        key: batcher.add(
            key,
            [RowSpec(prompt, 6, -1, 2, return_log_probs=log_probs is not None)],
            streaming=False,
            sampling=Sampling(),
            handle=None,
        )
        for key, prompt in prompts.items()
    }
    chunks = 0
    while not batcher.idle():
        plan = batcher.schedule()
        chunks += sum(1 for w in plan.works if w.is_context and not w.emits)
        tables = [batcher.pool.table(w.seq.seq_id) for w in plan.works]
        sampled = runner.step(plan.works, tables)
        batcher.commit(plan, sampled.tokens, sampled.log_probs)
    assert (chunks > 0) == bool(overrides.get("enable_chunked_context"))
    if log_probs is not None:
        log_probs.update({key: r.rows[0].log_probs for key, r in requests.items()})
    return {key: list(request.rows[0].generated) for key, request in requests.items()}


def test_chunked_context_generates_what_a_whole_prefill_does() -> None:
    whole = generate(max_num_tokens=128)
    for policy in ("first_come_first_served", "equal_progress"):
        chunked = generate(
            max_num_tokens=24, enable_chunked_context=True, context_chunking_policy=policy
        )
        assert chunked == whole and all(len(tokens) == 6 for tokens in whole.values())


def test_log_probs_are_the_greedy_tokens_and_do_not_depend_on_chunking() -> None:
    whole_probs: dict[str, list[float]] = {}
    chunked_probs: dict[str, list[float]] = {}
    plain = generate(max_num_tokens=128)
    whole = generate(whole_probs, max_num_tokens=128)
    chunked = generate(chunked_probs, max_num_tokens=24, enable_chunked_context=True)
    assert whole == plain == chunked  # asking for them changes no token
    floor = -math.log(1024)  # a greedy token is the likeliest: at least 1 / vocabulary
    for key, values in whole_probs.items():
        assert len(values) == len(whole[key]) == 6
        assert all(floor <= v <= 0.0 for v in values), values
        assert chunked_probs[key] == pytest.approx(values, abs=1e-4)
