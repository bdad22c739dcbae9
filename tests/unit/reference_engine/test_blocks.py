"""The KV block pool keeps its invariants under any sequence of operations."""

from __future__ import annotations

import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reference_engine.blocks import BlockPool, PoolExhaustedError


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=12, tokens_per_block=4)
        self.model: dict[int, int] = {}  # owner -> blocks held, kept independently

    @rule(owner=st.integers(0, 5), count=st.integers(0, 6))
    def allocate(self, owner: int, count: int) -> None:
        free_before = self.pool.num_free
        if count > free_before:
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(owner, count)
            assert self.pool.num_free == free_before
            return
        got = self.pool.allocate(owner, count)
        assert len(got) == count
        if count:
            self.model[owner] = self.model.get(owner, 0) + count

    @rule(owner=st.integers(0, 5), tokens=st.integers(0, 30))
    def ensure(self, owner: int, tokens: int) -> None:
        need = max(0, -(-tokens // 4) - self.model.get(owner, 0))
        if need > self.pool.num_free:
            with pytest.raises(PoolExhaustedError):
                self.pool.ensure(owner, tokens)
            return
        assert self.pool.ensure(owner, tokens) == need
        if need:
            self.model[owner] = self.model.get(owner, 0) + need
        assert len(self.pool.table(owner)) * 4 >= tokens

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.model)))
        assert self.pool.free(owner) == self.model.pop(owner)
        assert self.pool.free(owner) == 0  # a second free returns nothing

    @invariant()
    def consistent(self) -> None:
        self.pool.check()
        assert self.pool.num_used == sum(self.model.values())
        assert self.pool.num_free + self.pool.num_used == self.pool.num_blocks
        assert self.pool.num_free >= 0


TestPoolMachine = PoolMachine.TestCase


def test_seeded_random_walk_keeps_invariants() -> None:
    rng = random.Random(1234)
    pool = BlockPool(num_blocks=64, tokens_per_block=16)
    held: dict[int, int] = {}
    for _ in range(100_000):
        owner = rng.randrange(16)
        if rng.random() < 0.6:
            count = rng.randrange(4)
            if count <= pool.num_free:
                pool.allocate(owner, count)
                if count:
                    held[owner] = held.get(owner, 0) + count
        else:
            assert pool.free(owner) == held.pop(owner, 0)
        assert pool.num_used == sum(held.values())
    pool.check()


def test_blocks_for_rounds_up() -> None:
    pool = BlockPool(num_blocks=4, tokens_per_block=16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
