"""The engine's paged KV block pool.

A fixed number of blocks, each holding `tokens_per_block` tokens of keys and values. Blocks are
handed to owners (sequence ids) and returned whole.

Invariants (checked by `check()`, exercised by a hypothesis state machine in the tests):
- num_free + num_used == num_blocks;
- every block is either free or owned by exactly one owner, never both;
- freeing returns exactly the blocks an owner holds; nothing is freed twice;
- no count is ever negative.
"""

from __future__ import annotations

from collections import deque


class PoolExhaustedError(Exception):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """A fixed pool of KV blocks with per-owner block tables."""

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError("a pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-max(num_tokens, 0) // self.tokens_per_block)

    def table(self, owner: int) -> list[int]:
        """The owner's blocks in allocation order (its block table); empty if none."""
        return self._tables.get(owner, [])

    def allocate(self, owner: int, count: int) -> list[int]:
        """Append `count` blocks to the owner's table and return them."""
        if count < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if count > len(self._free):
            raise PoolExhaustedError(f"asked for {count} blocks, {len(self._free)} free")
        if count == 0:
            return []
        got = [self._free.popleft() for _ in range(count)]
        self._tables.setdefault(owner, []).extend(got)
        return got

    def ensure(self, owner: int, num_tokens: int) -> int:
        """Grow the owner's table to hold `num_tokens`; return how many blocks were added."""
        missing = self.blocks_for(num_tokens) - len(self.table(owner))
        if missing > 0:
            self.allocate(owner, missing)
            return missing
        return 0

    def free(self, owner: int) -> int:
        """Return all of the owner's blocks to the pool; return how many."""
        blocks = self._tables.pop(owner, [])
        self._free.extend(blocks)
        return len(blocks)

    def owners(self) -> list[int]:
        return list(self._tables)

    def check(self) -> None:
        """Assert the pool's invariants; raises AssertionError naming the broken one."""
        owned = [b for blocks in self._tables.values() for b in blocks]
        free = list(self._free)
        if len(owned) + len(free) != self.num_blocks:
            raise AssertionError(f"used {len(owned)} + free {len(free)} != total {self.num_blocks}")
        if len(set(owned) | set(free)) != self.num_blocks:
            raise AssertionError("a block is both free and owned, or owned twice")
        if any(not blocks for blocks in self._tables.values()):
            raise AssertionError("an owner holds an empty table")
