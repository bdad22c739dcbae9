"""The engine's iteration scheduler, driven with hand-made model outputs (no torch)."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reference_engine.batcher import Batcher, Plan
from reference_engine.config import EngineConfig
from reference_engine.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NeverFitsError,
    QueueFullError,
)
from reference_engine.request import FinishReason, RowSpec, RunningSequence, Sampling

NO_END = -1


def model_token(seq: RunningSequence) -> int:
    """A stand-in for the model: depends only on what the sequence has seen, like greedy."""
    data = repr((seq.prompt, tuple(seq.generated))).encode()
    return 10 + zlib.crc32(data) % 1000


def cfg(**overrides: object) -> EngineConfig:
    base: dict[str, object] = {
        "tokens_per_block": 4,
        "max_tokens_in_paged_kv_cache": 64,
        "max_input_len": 64,
        "max_num_tokens": 128,
        "max_output_len": 64,
    }
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def add(b: Batcher, key: str, *rows: tuple[int, int], end_id: int = NO_END) -> None:
    specs = [RowSpec(tuple(range(1, n + 1)), out, end_id, 0) for n, out in rows]
    b.add(key, specs, streaming=True, sampling=Sampling(), handle=None)


def step(b: Batcher) -> tuple[Plan, list[int]]:
    plan = b.schedule()
    tokens = [model_token(w.seq) for w in plan.works if w.emits]
    b.commit(plan, tokens)
    b.pool.check()
    return plan, tokens


def run_to_end(b: Batcher, limit: int = 10_000) -> int:
    steps = 0
    while not b.idle():
        step(b)
        steps += 1
        assert steps < limit, "the batcher stopped making progress"
    return steps


def outputs_alone(rows: list[tuple[int, int]], **overrides: object) -> list[list[int]]:
    """What each row produces when it runs alone in a roomy engine."""
    out = []
    for n, m in rows:
        b = Batcher(cfg(**overrides))
        add(b, "solo", (n, m))
        seq = b.requests[0].rows[0]
        run_to_end(b)
        out.append(list(seq.generated))
    return out


def test_inflight_admits_first_come_first_served_within_the_sequence_cap() -> None:
    b = Batcher(cfg(max_num_sequences=2))
    for key in "abc":
        add(b, key, (5, 3))
    plan, _ = step(b)
    assert [w.seq.request.key for w in plan.works] == ["a", "b"]
    assert b.num_waiting == 1
    plan, _ = step(b)
    assert all(not w.is_context for w in plan.works)  # c waits for a free slot


def test_token_budget_limits_context_per_iteration() -> None:
    b = Batcher(cfg(max_num_tokens=64, max_input_len=40, max_tokens_in_paged_kv_cache=256))
    add(b, "a", (40, 2))
    add(b, "b", (40, 2))
    plan, _ = step(b)
    assert [w.seq.request.key for w in plan.works] == ["a"]
    plan, _ = step(b)
    assert {w.seq.request.key for w in plan.works} == {"a", "b"}


def test_guaranteed_no_evict_reserves_prompt_plus_max_output() -> None:
    b = Batcher(cfg(max_tokens_in_paged_kv_cache=32))  # 8 blocks of 4
    add(b, "a", (10, 10))  # 20 tokens -> 5 blocks
    add(b, "b", (10, 10))
    step(b)
    assert b.pool.num_used == 5
    assert b.num_running == 1 and b.num_waiting == 1  # 5 + 5 > 8: b waits
    run_to_end(b)
    assert b.pool.num_used == 0
    assert b.counts.paused_total == 0


def test_max_utilization_pauses_then_recomputes_without_changing_outputs() -> None:
    rows = [(10, 12), (10, 12)]
    b = Batcher(cfg(max_tokens_in_paged_kv_cache=32, batch_scheduler_policy="max_utilization"))
    add(b, "a", rows[0])
    add(b, "b", rows[1])
    seqs = [r.rows[0] for r in b.requests]
    step(b)
    assert b.num_running == 2  # both admitted on their prompts alone
    run_to_end(b)
    assert b.counts.paused_total >= 1
    assert b.counts.context_processed > 20  # the paused one was recomputed
    assert [list(s.generated) for s in seqs] == outputs_alone(rows)
    assert b.pool.num_used == 0


def test_static_batch_pads_prompts_and_rides_finished_rows_along() -> None:
    b = Batcher(cfg(batching_strategy="static"))
    add(b, "a", (3, 2))
    add(b, "b", (9, 5))
    plan, _ = step(b)
    assert [len(w.tokens) for w in plan.works] == [9, 9]
    add(b, "late", (2, 2))
    steps = run_to_end(b)
    counts = b.counts
    # Batch 1: 2 rows x 9 padded context; 4 decode steps for both rows.
    # Then "late" runs alone: 2 context tokens, 1 decode step.
    assert counts.context_processed == 18 + 2
    assert counts.context_useful == 12 + 2
    assert counts.generation_processed == 2 * 4 + 1
    assert counts.generation_useful == 1 + 4 + 1
    assert steps == 4 + 2  # the first step ran before "late" arrived


def test_static_waits_for_the_batch_to_finish_before_admitting() -> None:
    b = Batcher(cfg(batching_strategy="static"))
    add(b, "a", (4, 6))
    step(b)
    add(b, "b", (4, 1))
    plan, _ = step(b)
    assert {w.seq.request.key for w in plan.works} == {"a"}
    assert b.num_waiting == 1


def test_static_and_inflight_produce_the_same_tokens() -> None:
    rows = [(3, 4), (7, 6), (5, 2)]
    results = {}
    for strategy in ("inflight", "static"):
        b = Batcher(cfg(batching_strategy=strategy))
        add(b, "multi", *rows)
        seqs = b.requests[0].rows
        run_to_end(b)
        results[strategy] = [list(s.generated) for s in seqs]
    assert results["inflight"] == results["static"] == outputs_alone(rows)


def test_end_id_ends_a_row_without_emitting_it() -> None:
    b = Batcher(cfg())
    add(b, "probe", (5, 6))
    seq = b.requests[0].rows[0]
    run_to_end(b)
    third = seq.generated[2]
    b2 = Batcher(cfg())
    add(b2, "stop", (5, 6), end_id=third)
    seq2 = b2.requests[0].rows[0]
    run_to_end(b2)
    assert seq2.generated == seq.generated[:2]
    assert seq2.finish == FinishReason.END_ID


def test_rejections_say_why() -> None:
    b = Batcher(cfg(max_queue_size=1, max_num_sequences=1))
    add(b, "a", (4, 4))
    with pytest.raises(QueueFullError, match="Exceeds maximum queue size"):
        add(b, "b", (4, 4))
    with pytest.raises(DuplicateRequestError):
        add(b, "a", (4, 4))
    b = Batcher(cfg())
    with pytest.raises(NeverFitsError, match="can never run"):
        add(b, "huge", (60, 60))
    with pytest.raises(InvalidRequestError, match="max_input_len"):
        add(b, "long", (65, 1))
    s = Batcher(cfg(batching_strategy="static", max_num_sequences=2))
    with pytest.raises(NeverFitsError, match="max_num_sequences"):
        add(s, "wide", (2, 2), (2, 2), (2, 2))


def test_cancel_frees_blocks_of_running_and_waiting_rows() -> None:
    b = Batcher(cfg(max_num_sequences=1))
    add(b, "run", (8, 30))
    add(b, "wait", (8, 30))
    step(b)
    assert b.pool.num_used > 0
    b.cancel("run", FinishReason.CANCELLED)
    b.cancel("wait", FinishReason.CANCELLED)
    assert b.pool.num_used == 0
    assert b.idle()
    assert b.requests == []


class BatcherMachine(RuleBasedStateMachine):
    """Random arrivals, cancellations and steps: blocks stay consistent, every request ends."""

    def __init__(self) -> None:
        super().__init__()
        self.batcher: Batcher | None = None
        self.keys = 0
        self.open: set[str] = set()

    @precondition(lambda self: self.batcher is None)
    @rule(
        strategy=st.sampled_from(["inflight", "static"]),
        policy=st.sampled_from(["guaranteed_no_evict", "max_utilization"]),
        blocks=st.integers(6, 24),
        seqs=st.integers(1, 4),
        chunking=st.sampled_from([None, "first_come_first_served", "equal_progress"]),
        reuse=st.booleans(),
    )
    def configure(
        self,
        strategy: str,
        policy: str,
        blocks: int,
        seqs: int,
        chunking: str | None,
        reuse: bool,
    ) -> None:
        chunked = chunking is not None and strategy == "inflight"
        self.batcher = Batcher(
            cfg(
                batching_strategy=strategy,
                batch_scheduler_policy=policy,
                max_tokens_in_paged_kv_cache=blocks * 4,
                max_num_sequences=seqs,
                max_input_len=24,
                max_num_tokens=7 if chunked else 48,  # chunks of prompts up to 12 tokens
                max_queue_size=6,
                enable_chunked_context=chunked,
                context_chunking_policy=chunking or "first_come_first_served",
                # Every prompt here is 1..n: they share their leading blocks.
                enable_kv_cache_reuse=reuse and strategy == "inflight",
            )
        )

    @precondition(lambda self: self.batcher is not None)
    @rule(rows=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10)), min_size=1, max_size=3))
    def arrive(self, rows: list[tuple[int, int]]) -> None:
        assert self.batcher is not None
        key = f"r{self.keys}"
        self.keys += 1
        try:
            add(self.batcher, key, *rows)
        except (QueueFullError, NeverFitsError):
            return
        self.open.add(key)

    @precondition(lambda self: self.batcher is not None and bool(self.open))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        assert self.batcher is not None
        key = data.draw(st.sampled_from(sorted(self.open)))
        self.batcher.cancel(key, FinishReason.CANCELLED)

    @precondition(lambda self: self.batcher is not None)
    @rule()
    def iterate(self) -> None:
        assert self.batcher is not None
        step(self.batcher)

    @invariant()
    def blocks_consistent(self) -> None:
        if self.batcher is None:
            return
        b = self.batcher
        b.pool.check()
        # Exactly the running sequences hold blocks: nothing finished or cancelled leaks.
        assert set(b.pool.owners()) == b.running_ids
        live = {seq.seq_id for r in b.requests for seq in r.rows}
        if b.cfg.batching_strategy == "inflight":
            assert b.running_ids <= live
        self.open &= {r.key for r in b.requests}

    def teardown(self) -> None:
        if self.batcher is not None:
            run_to_end(self.batcher)
            assert self.batcher.pool.num_used == 0
            assert self.batcher.requests == []


TestBatcherMachine = BatcherMachine.TestCase
TestBatcherMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_stop_words_end_a_row_with_the_word_emitted() -> None:
    b = Batcher(cfg())
    add(b, "probe", (5, 8))
    seq = b.requests[0].rows[0]
    run_to_end(b)
    word = tuple(seq.generated[2:4])
    b2 = Batcher(cfg())
    specs = [RowSpec(tuple(range(1, 6)), 8, NO_END, 0, stop_words=((999_999,), word))]
    b2.add("stop", specs, streaming=True, sampling=Sampling(), handle=None)
    seq2 = b2.requests[0].rows[0]
    run_to_end(b2)
    assert seq2.generated == seq.generated[:4]  # the stop word's tokens are output
    assert seq2.finish == FinishReason.STOP_WORDS


def test_chunked_context_feeds_a_long_prompt_in_chunks_while_others_decode() -> None:
    b = Batcher(
        cfg(
            max_num_tokens=16,
            max_num_sequences=4,
            enable_chunked_context=True,
            max_tokens_in_paged_kv_cache=256,
        )
    )
    add(b, "short", (4, 8))
    step(b)  # "short" prefills and samples its first token
    add(b, "long", (40, 2))
    plans = [step(b)[0] for _ in range(3)]
    # Each step: one decode for "short" (1 token), and 15, 15, then 10 of the long prompt.
    for plan in plans:
        assert [len(w.tokens) for w in plan.works if not w.is_context] == [1]
        assert sum(len(w.tokens) for w in plan.works) <= 16
    chunks = [[len(w.tokens) for w in plan.works if w.is_context] for plan in plans]
    assert chunks == [[15], [15], [10]]
    emitting = [[w.seq.request.key for w in plan.works if w.emits] for plan in plans]
    assert emitting == [["short"], ["short"], ["short", "long"]]  # only the last chunk samples
    assert b.counts.context_processed == b.counts.context_useful == 4 + 40


def test_without_chunked_context_a_prompt_must_fit_one_step() -> None:
    with pytest.raises(ValueError, match="max_num_tokens"):
        cfg(max_num_tokens=16, max_input_len=64)
    with pytest.raises(ValueError, match="in-flight batching"):
        cfg(batching_strategy="static", enable_chunked_context=True)


def test_equal_progress_lets_a_short_prompt_through_beside_a_long_one() -> None:
    def first_token_step(policy: str) -> int:
        b = Batcher(
            cfg(
                max_num_tokens=16,
                max_num_sequences=4,
                enable_chunked_context=True,
                context_chunking_policy=policy,
                max_tokens_in_paged_kv_cache=256,
            )
        )
        add(b, "long", (60, 2))
        step(b)
        add(b, "short", (6, 2))
        for n in range(1, 20):
            plan, _ = step(b)
            if any(w.emits and w.seq.request.key == "short" for w in plan.works):
                return n
        raise AssertionError("the short prompt never sampled")

    # First come, first served: the short prompt waits for the long one's 44 remaining
    # tokens (three steps); in equal chunks it takes half of the next step and is done.
    assert first_token_step("first_come_first_served") == 4
    assert first_token_step("equal_progress") == 1
