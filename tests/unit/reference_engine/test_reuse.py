"""KV cache reuse: prefix keys, the pool's cache of blocks, the batcher skipping cached prefill,
greedy outputs unchanged on the real model, and emulated timing charging only fed tokens."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reference_engine.batcher import Batcher
from reference_engine.blocks import BlockPool, PoolExhaustedError, block_keys
from reference_engine.config import EngineConfig, ModelSpec
from reference_engine.emulated import step_shape
from reference_engine.request import RowSpec, Sampling


def test_a_key_names_the_whole_prefix_up_to_its_block() -> None:
    base = list(range(1, 11))  # two full blocks of 4, and 2 tokens left over
    keys = block_keys(base, 4)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert block_keys(base[:8], 4) == keys  # the tail of a partial block has no key
    assert block_keys([*base[:8], 99, 98, 97, 96], 4)[:2] == keys  # what follows does not count
    changed = block_keys([5, *base[1:]], 4)  # one token of the first block differs
    assert changed[0] != keys[0] and changed[1] != keys[1]  # every later key differs too
    assert block_keys(base[4:8], 4)[0] != keys[1]  # the same tokens at another place differ


def test_cached_blocks_are_shared_then_evicted_least_recently_used() -> None:
    pool = BlockPool(num_blocks=4, tokens_per_block=2)
    a, b = pool.allocate(1, 2)
    assert pool.register(1, 0, b"k0") and pool.register(1, 1, b"k1")
    assert not pool.register(1, 1, b"k9")  # a block is cached under one key
    assert pool.match([b"k0", b"k1", b"k2"]) == [a, b]
    assert pool.match([b"k1"]) == [b] and pool.match([b"kx", b"k1"]) == []
    pool.share(2, [a, b])  # held by two owners now
    assert pool.num_used == 2 and pool.reused == 2 and pool.alloc_new == 2
    assert pool.free(1) == 2 and pool.num_used == 2  # still held by owner 2
    assert pool.free(2) == 2
    assert pool.num_used == 0 and pool.num_free == 4 and pool.num_cached == 2  # idle, cached
    pool.share(3, [b])
    pool.free(3)  # b was used last: a is evicted first
    pool.allocate(4, 3)  # 2 blank blocks, then the least recently used cached one
    assert pool.match([b"k0"]) == [] and pool.evicted == 1
    assert pool.num_cached == 1 and pool.match([b"k0", b"k1"]) == []
    with pytest.raises(PoolExhaustedError):
        pool.allocate(5, 2)
    pool.check()


class ReusePoolMachine(RuleBasedStateMachine):
    """Allocate, register, share and free at random: the pool's invariants hold, a cached key
    always names the block registered under it, and nothing held is ever evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=8, tokens_per_block=4)
        self.owners = 0
        self.keys = 0
        self.registered: dict[bytes, int] = {}

    @rule(count=st.integers(1, 4))
    def allocate(self, count: int) -> None:
        held = {b for owner in self.pool.owners() for b in self.pool.table(owner)}
        if count > self.pool.num_free:
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(self.owners, count)
            return
        got = self.pool.allocate(self.owners, count)
        self.owners += 1
        assert not set(got) & held  # nothing another owner holds
        for key in [k for k, block in self.registered.items() if block in got]:
            del self.registered[key]  # evicted: its key is gone
            assert self.pool.match([key]) == []

    @precondition(lambda self: bool(self.pool.owners()))
    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(self.pool.owners()))
        index = data.draw(st.integers(0, len(self.pool.table(owner)) - 1))
        key = str(self.keys).encode()
        self.keys += 1
        if self.pool.register(owner, index, key):
            self.registered[key] = self.pool.table(owner)[index]

    @precondition(lambda self: bool(self.registered))
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        keys = data.draw(
            st.lists(st.sampled_from(sorted(self.registered)), max_size=3, unique=True)
        )
        blocks = self.pool.match(keys)
        assert blocks == [self.registered[k] for k in keys]  # all of them are cached
        self.pool.share(self.owners, blocks)
        self.owners += 1

    @precondition(lambda self: bool(self.pool.owners()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(self.pool.owners()))
        assert self.pool.free(owner) > 0
        assert self.pool.free(owner) == 0

    @invariant()
    def consistent(self) -> None:
        self.pool.check()
        for key, block in self.registered.items():
            assert self.pool.match([key]) == [block]


TestReusePoolMachine = ReusePoolMachine.TestCase


def _cfg(**overrides: object) -> EngineConfig:
    base: dict[str, object] = {
        "tokens_per_block": 8,
        "max_tokens_in_paged_kv_cache": 2048,
        "max_input_len": 96,
        "max_output_len": 8,
        "max_num_sequences": 4,
        "model": ModelSpec(vocab_size=1024, num_layers=2),
    }
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


HEADER = tuple(range(300, 340))  # 40 tokens: five full blocks of 8


def _turns(reuse: bool, **overrides: object) -> tuple[list[list[int]], Batcher]:
    """Three prompts sharing a 40-token header, one after the other, on the real model."""
    from reference_engine.llama import ModelRunner  # noqa: PLC0415 (torch: only here)

    cfg = _cfg(enable_kv_cache_reuse=reuse, **overrides)
    batcher, runner = Batcher(cfg), ModelRunner(cfg)
    outputs = []
    for turn, tail in enumerate(((1, 2, 3), (4, 5, 6, 7, 8, 9, 10, 11, 12), (1, 2, 3))):
        request = batcher.add(
            f"t{turn}",
            [RowSpec(HEADER + tail, 6, -1, 2)],
            streaming=False,
            sampling=Sampling(),
            handle=None,
        )
        while not batcher.idle():
            plan = batcher.schedule()
            tables = [batcher.pool.table(w.seq.seq_id) for w in plan.works]
            sampled = runner.step(plan.works, tables)
            batcher.commit(plan, sampled.tokens, sampled.log_probs)
            batcher.pool.check()
        outputs.append(list(request.rows[0].generated))
    return outputs, batcher


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_outputs_are_the_same_with_and_without_reuse(chunked: bool) -> None:
    overrides: dict[str, object] = (
        {"enable_chunked_context": True, "max_num_tokens": 16} if chunked else {}
    )
    plain, without = _turns(False, **overrides)
    reused, batcher = _turns(True, **overrides)
    assert reused == plain and all(len(tokens) == 6 for tokens in plain)
    # The first turn computes the header; the later two start after its five blocks (the
    # third turn repeats the first prompt whole: six blocks, its last token still fed).
    counts = batcher.counts
    assert counts.prompt_tokens_reused == 40 + 40
    assert counts.context_processed == without.counts.context_processed - 80
    assert batcher.pool.reused == 10 and without.pool.reused == 0


def _admit(batcher: Batcher, key: str, prompt: tuple[int, ...]) -> None:
    batcher.add(key, [RowSpec(prompt, 4, -1, 0)], streaming=False, sampling=Sampling(), handle=None)


def _finish(batcher: Batcher) -> None:
    while not batcher.idle():
        plan = batcher.schedule()
        batcher.commit(plan, [7] * sum(1 for w in plan.works if w.emits))


def test_a_cached_prefix_is_not_fed_again_and_emulated_timing_charges_only_what_is() -> None:
    batcher = Batcher(_cfg(enable_kv_cache_reuse=True))
    _admit(batcher, "first", (*HEADER, 1))
    first = batcher.schedule()
    assert step_shape(first.works).prompt_tokens == 41
    batcher.commit(first, [7])
    _finish(batcher)
    _admit(batcher, "second", (*HEADER, 2, 3))
    plan = batcher.schedule()
    [work] = plan.works
    assert (work.start, work.tokens) == (40, (2, 3))  # it starts after the cached header
    shape = step_shape(plan.works)
    assert (shape.prompt_tokens, shape.context_tokens) == (2, 40)  # reads 40, feeds 2


def test_without_reuse_and_on_static_batches_nothing_is_cached() -> None:
    batcher = Batcher(_cfg())
    _admit(batcher, "first", HEADER)
    _finish(batcher)
    assert batcher.pool.num_cached == 0
    _admit(batcher, "second", HEADER)
    assert batcher.schedule().works[0].start == 0
    with pytest.raises(ValueError, match="enable_kv_cache_reuse needs in-flight batching"):
        _cfg(enable_kv_cache_reuse=True, batching_strategy="static")
