"""Chunked context on the real model: the same tokens as a whole prefill, decoding in between."""

from __future__ import annotations

from scheduler_svc.engine.batcher import Batcher
from scheduler_svc.engine.config import EngineConfig, ModelSpec
from scheduler_svc.engine.request import RowSpec, Sampling
from scheduler_svc.engine.runner import ModelRunner


def generate(**overrides: object) -> dict[str, list[int]]:
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
            key, [RowSpec(prompt, 6, -1, 2)], streaming=False, sampling=Sampling(), handle=None
        )
        for key, prompt in prompts.items()
    }
    chunks = 0
    while not batcher.idle():
        plan = batcher.schedule()
        chunks += sum(1 for w in plan.works if w.is_context and not w.emits)
        tables = [batcher.pool.table(w.seq.seq_id) for w in plan.works]
        batcher.commit(plan, runner.step(plan.works, tables))
    assert (chunks > 0) == bool(overrides.get("enable_chunked_context"))
    return {key: list(request.rows[0].generated) for key, request in requests.items()}


def test_chunked_context_generates_what_a_whole_prefill_does() -> None:
    whole = generate(max_num_tokens=128)
    for policy in ("first_come_first_served", "equal_progress"):
        chunked = generate(
            max_num_tokens=24, enable_chunked_context=True, context_chunking_policy=policy
        )
        assert chunked == whole and all(len(tokens) == 6 for tokens in whole.values())
