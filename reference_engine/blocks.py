"""The engine's paged KV block pool, with reuse of cached prompt blocks across requests.

A fixed number of blocks, each holding `tokens_per_block` tokens of keys and values. Blocks are
handed to owners (sequence ids) and returned whole.

Reuse (TensorRT-LLM's `enable_kv_cache_reuse`): a full block of prompt tokens is identified by
a key chained over the whole prefix up to its end (`block_keys`, scheduler_svc/core/prefix.py:
the sidecar's prefix routing hashes prompts the same way), so equal keys mean equal
tokens at equal positions and therefore equal keys and values. An owner registers a block under
its key once the block's tokens are computed; a later owner whose prompt starts with the same
blocks shares them (`match`, `share`) and skips their prefill. A block many owners hold is
freed when the last one lets go; a registered block nobody holds stays cached (idle) and is
evicted least recently used when the pool needs a blank block. Without reuse nothing is ever
registered and the pool behaves as a plain allocator.

Invariants (checked by `check()`, exercised by a hypothesis state machine in the tests):
- every block is exactly one of: free, idle (registered, nobody holds it), held (by >= 1 owner);
- a held block's reference count is the number of owners whose table holds it;
- num_free (free + idle: what an allocation can take) + num_used (held) == num_blocks;
- keys and registered blocks map one to one; a free block has no key;
- freeing returns exactly the blocks an owner holds; nothing is freed twice;
- no count is ever negative.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from scheduler_svc.core.prefix import block_keys

__all__ = ["BlockPool", "PoolExhaustedError", "block_keys"]


class PoolExhaustedError(Exception):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """A fixed pool of KV blocks with per-owner block tables and a cache of prompt blocks."""

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError("a pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}  # held block -> owners holding it
        self._key_of: dict[int, bytes] = {}  # registered block -> its prefix key
        self._by_key: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, unheld: LRU first
        # Cumulative, as TensorRT-LLM's KV cache statistics count them: blocks handed out
        # (new or shared), of them blank ones, and shared cached ones; cached blocks evicted.
        self.alloc_total = 0
        self.alloc_new = 0
        self.reused = 0
        self.evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: blank ones and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Blocks some owner holds."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Registered blocks, held or idle: what a later prompt can reuse."""
        return len(self._key_of)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-max(num_tokens, 0) // self.tokens_per_block)

    def table(self, owner: int) -> list[int]:
        """The owner's blocks in allocation order (its block table); empty if none."""
        return self._tables.get(owner, [])

    def allocate(self, owner: int, count: int) -> list[int]:
        """Append `count` blank blocks to the owner's table and return them; cached blocks
        nobody holds are evicted, least recently used first, once no blank one is left."""
        if count < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if count > self.num_free:
            raise PoolExhaustedError(f"asked for {count} blocks, {self.num_free} free")
        if count == 0:
            return []
        got = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._idle.popitem(last=False)
                del self._by_key[self._key_of.pop(block)]
                self.evicted += 1
            self._refs[block] = 1
            got.append(block)
        self._tables.setdefault(owner, []).extend(got)
        self.alloc_total += count
        self.alloc_new += count
        return got

    def ensure(self, owner: int, num_tokens: int) -> int:
        """Grow the owner's table to hold `num_tokens`; return how many blocks were added."""
        missing = self.blocks_for(num_tokens) - len(self.table(owner))
        if missing > 0:
            self.allocate(owner, missing)
            return missing
        return 0

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys`, from the first, that is cached."""
        found = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def idle_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` nobody holds (sharing them takes them off `num_free`)."""
        return sum(1 for block in blocks if block in self._idle)

    def share(self, owner: int, blocks: Sequence[int]) -> None:
        """Put cached `blocks` (from `match`) at the head of a new owner's table."""
        if self._tables.get(owner):
            raise ValueError("cached blocks go at the head of an empty table")
        for block in blocks:
            if block not in self._key_of:
                raise ValueError(f"block {block} is not cached")
            if block in self._idle:
                del self._idle[block]
            self._refs[block] = self._refs.get(block, 0) + 1
        if blocks:
            self._tables[owner] = list(blocks)
            self.alloc_total += len(blocks)
            self.reused += len(blocks)

    def register(self, owner: int, index: int, key: bytes) -> bool:
        """Cache the owner's `index`-th block under `key` (its tokens are computed); False if
        the key or the block is cached already (another owner computed the same prefix)."""
        block = self._tables[owner][index]
        if key in self._by_key or block in self._key_of:
            return False
        self._key_of[block] = key
        self._by_key[key] = block
        return True

    def free(self, owner: int) -> int:
        """Let go of all of the owner's blocks; return how many. A block still held by another
        owner stays; a cached one nobody holds becomes idle (the most recently used); the rest
        become blank."""
        blocks = self._tables.pop(owner, [])
        for block in blocks:
            left = self._refs[block] - 1
            if left:
                self._refs[block] = left
                continue
            del self._refs[block]
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)
        return len(blocks)

    def owners(self) -> list[int]:
        return list(self._tables)

    def check(self) -> None:
        """Assert the pool's invariants; raises AssertionError naming the broken one."""
        held: dict[int, int] = {}
        for blocks in self._tables.values():
            if not blocks:
                raise AssertionError("an owner holds an empty table")
            if len(set(blocks)) != len(blocks):
                raise AssertionError("an owner holds a block twice")
            for block in blocks:
                held[block] = held.get(block, 0) + 1
        if held != self._refs:
            raise AssertionError("reference counts differ from the owners' tables")
        free, idle = set(self._free), set(self._idle)
        if len(free) != len(self._free):
            raise AssertionError("a block is free twice")
        if free & idle or free & held.keys() or idle & held.keys():
            raise AssertionError("a block is in two of free, idle and held")
        if len(free) + len(idle) + len(held) != self.num_blocks:
            raise AssertionError(
                f"free {len(free)} + idle {len(idle)} + held {len(held)} != {self.num_blocks}"
            )
        if any(block in free for block in self._key_of):
            raise AssertionError("a blank block has a key")
        if not idle <= self._key_of.keys():
            raise AssertionError("an idle block has no key")
        if {k: b for b, k in self._key_of.items()} != self._by_key:
            raise AssertionError("keys and cached blocks do not map one to one")
