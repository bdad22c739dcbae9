"""A mirror of the backend's paged KV block pool, kept by reservations the policy makes.

A dispatched request reserves blocks for its prompt (less the leading tokens the engine is
expected to find cached: `Request.cached_tokens`, the policy's `need`) plus its predicted output
(paged mode) or for the model's maximum sequence length (contiguous mode, the source document's
"before"). The backend's own counts (`observe`) reconcile the mirror: blocks the backend uses
beyond what our requests hold are "external" (another client, the backend's own overhead, or
shared prefix blocks) and are not offered for admission.

Two ways of reading reservations:
- **Claims** (contiguous mode, or an engine that reserves prompt + max_tokens at admission,
  TensorRT-LLM's `guaranteed_no_evict`, or a static engine that frees a batch's blocks only when
  the whole batch ends): the engine holds every reservation's blocks from admission, so new
  ones must fit the blocks left free.
- **Forecasts** (`forecast`: paged KV on an in-flight engine that allocates as tokens come,
  `max_utilization`): a reservation is the size its request is predicted to reach. Rows grow one
  token a step and free everything when they end, so the pool's forecast peak is
  max over k of the blocks held by the rows still running when row k ends, each at its size
  then (`peak_blocks`), which is below the sum of the sizes whenever rows end at different
  times. Summing the final sizes instead would hold back work the engine could run.

Invariants (checked by tests/unit/core/test_policy_parts.py's state machine):
- claims: reserved + external + free == total + overcommit, where overcommit > 0 only if the
  backend reported a pool smaller than what is already reserved, and then free == 0;
- forecasts: peak_blocks <= reserved_blocks, and peak + external + free == total when the
  peak fits;
- every count is >= 0; a request holds at most one reservation; releasing twice frees nothing.

Admission (`admissible`): new reservations take at most the room left less the reserve
(`reserve_fraction` of the pool, paged mode) while others hold blocks, and nothing while blocks
are owed: a claim that outgrew into blocks not free, or a forecast peak past the pool. The mirror
then sees a pool that runs dry before the running requests end, and an engine that allocates as
tokens come (`max_utilization`) would pause one of them. With nothing held, the whole pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler_svc.core.config import KvConfig, KvMode


@dataclass
class _Reservation:
    blocks: int
    used_tokens: int  # prompt + output so far: what the request really occupies
    shortfall_blocks: int = 0  # wanted by a correction but not free at the time


class BlockMirror:
    """Reservations of KV blocks by request id, reconciled with the backend's counts."""

    def __init__(self, config: KvConfig, forecast: bool = False) -> None:
        self.configure(config, forecast)
        self.tokens_per_block = config.tokens_per_block
        self.total_blocks = config.total_blocks
        self.external_blocks = 0
        self.reserved_blocks = 0
        self._held: dict[str, _Reservation] = {}
        self.last_observed_at: float | None = None

    def configure(self, config: KvConfig, forecast: bool) -> None:
        """New settings; `forecast` where the engine batches continuously (it takes effect for
        paged KV on an engine that allocates as tokens come, unless `kv.forecast_peak` is
        off)."""
        self.config = config
        self.forecast = (
            forecast
            and config.forecast_peak
            and config.mode is KvMode.PAGED
            and not config.reserve_max_tokens
        )

    # -- sizes -------------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-max(tokens, 1) // self.tokens_per_block)

    def need(self, prompt_tokens: int, output_tokens: int) -> int:
        """Blocks a request reserves at dispatch."""
        if self.config.mode == KvMode.CONTIGUOUS:
            return self.blocks_for(self.config.max_seq_len)
        return self.blocks_for(prompt_tokens + output_tokens)

    @property
    def used_blocks(self) -> int:
        return self.reserved_blocks + self.external_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks no reservation claims (claims), or the room above the forecast peak."""
        if self.forecast:
            return max(0, self._room() - self.peak_blocks())
        return max(0, self.total_blocks - self.used_blocks)

    @property
    def reserve_blocks(self) -> int:
        """Blocks new admissions leave free while others are held (paged mode only)."""
        if self.config.mode != KvMode.PAGED:
            return 0
        return math.ceil(self.config.reserve_fraction * self.total_blocks)

    @property
    def owed_blocks(self) -> int:
        """Blocks the running requests are owed: claims outgrown into blocks that were not free
        (shortfalls not settled yet); forecasts, the peak's excess over the pool."""
        if self.forecast:
            return max(0, self.peak_blocks() - self._room())
        return sum(r.shortfall_blocks for r in self._held.values())

    def _room(self) -> int:
        return max(0, self.total_blocks - self.external_blocks)

    def _rows(self) -> list[tuple[int, int]]:
        return [(r.used_tokens, r.blocks) for r in self._held.values()]

    def peak_blocks(self, extra: list[tuple[int, int]] | None = None) -> int:
        """Forecast: the most blocks the held reservations (and `extra`, as (tokens used now,
        blocks reserved)) hold at once, if every row grows a token a step from what it uses
        now to its reservation's size and frees all when it gets there. Claims: their sum."""
        rows = self._rows() + (extra or [])
        if not self.forecast:
            return sum(blocks for _, blocks in rows)
        tpb = self.tokens_per_block
        # (tokens left to grow, tokens used now); the rows alive when row k ends are those with
        # at least its tokens left, each then at used + row k's tokens left.
        spans = sorted((max(0, blocks * tpb - used), used) for used, blocks in rows)
        peak = used_sum = 0
        for alive, (left, used) in enumerate(reversed(spans), start=1):
            used_sum += used
            # each row alive holds its tokens rounded up to a block: half a block each, on
            # average, never more than its reservation
            tokens = used_sum + alive * left
            peak = max(peak, -(-tokens // tpb) + alive // 2)
        return min(peak, sum(blocks for _, blocks in rows))

    def admissible(self, needs: list[int], prompts: list[int]) -> int:
        """How many of `needs` (blocks, in order; `prompts`, their prompt tokens) new
        reservations may take now: each within the room less the reserve while anything is held
        (already, or chosen before it in `needs`), and none while blocks are owed. Claims
        must fit the free blocks; forecasts, the pool at their forecast peak."""
        if self.owed_blocks:
            return 0
        held = self.reserved_blocks > 0
        if self.forecast:
            chosen: list[tuple[int, int]] = []
            for count, (need, prompt) in enumerate(zip(needs, prompts, strict=True)):
                keep = self.reserve_blocks if held or count else 0
                chosen.append((prompt, need))
                if self.peak_blocks(chosen) + keep > self._room():
                    return count
            return len(needs)
        free, taken = self.free_blocks, 0
        for count, need in enumerate(needs):
            keep = self.reserve_blocks if held or count else 0
            if taken + need + keep > free:
                return count
            taken += need
        return len(needs)

    @property
    def overcommit_blocks(self) -> int:
        return max(0, self.used_blocks - self.total_blocks)

    def held(self) -> dict[str, int]:
        """Blocks reserved per request id (a copy)."""
        return {rid: r.blocks for rid, r in self._held.items()}

    # -- changes -----------------------------------------------------------------------------

    def reserve(self, request_id: str, blocks: int, prompt_tokens: int) -> None:
        """Reserve `blocks` for a request that holds none yet: a claim must find them free; a
        forecast is checked by `admissible` first."""
        if request_id in self._held:
            raise ValueError(f"{request_id!r} already holds a reservation")
        if not self.forecast and blocks > self.free_blocks:
            raise ValueError(f"{blocks} blocks wanted, {self.free_blocks} free")
        self._held[request_id] = _Reservation(blocks, prompt_tokens)
        self.reserved_blocks += blocks

    def progress(self, request_id: str, used_tokens: int, grow_to_tokens: int = 0) -> bool:
        """Record tokens in use. If they outran the reservation, grow it to cover
        max(used, grow_to_tokens) tokens, as far as blocks are free. True if it outran."""
        held = self._held.get(request_id)
        if held is None:
            return False
        held.used_tokens = max(held.used_tokens, used_tokens)
        if self.blocks_for(held.used_tokens) <= held.blocks:
            return False
        self._grow(held, self.blocks_for(max(held.used_tokens, grow_to_tokens)) - held.blocks)
        return True

    def _grow(self, held: _Reservation, wanted: int) -> None:
        # A forecast just grows (the peak shows whether the pool can take it); a claim takes
        # what is free and records the rest as owed.
        got = wanted if self.forecast else min(wanted, self.free_blocks)
        held.blocks += got
        self.reserved_blocks += got
        held.shortfall_blocks = wanted - got

    def settle_shortfalls(self) -> int:
        """Give free blocks to reservations that outran their size; return blocks still owed."""
        owed = 0
        for held in self._held.values():
            if held.shortfall_blocks:
                self._grow(held, held.shortfall_blocks)
                owed += held.shortfall_blocks
        return owed

    def release(self, request_id: str) -> int:
        """Free a request's reservation; returns the blocks freed (0 if it held none)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return 0
        self.reserved_blocks -= held.blocks
        return held.blocks

    def observe(self, free_blocks: int, total_blocks: int, now: float) -> None:
        """Reconcile with the backend's own counts of its pool."""
        if total_blocks < 1 or not 0 <= free_blocks <= total_blocks:
            raise ValueError(f"impossible KV counts: free {free_blocks} of {total_blocks}")
        self.total_blocks = total_blocks
        backend_used = total_blocks - free_blocks
        # What our requests hold now: their claims, or (forecasts) the blocks their tokens fill.
        ours = self.reserved_blocks
        if self.forecast:
            ours = sum(min(r.blocks, self.blocks_for(r.used_tokens)) for r in self._held.values())
        self.external_blocks = max(0, backend_used - ours)
        self.last_observed_at = now

    def is_stale(self, now: float) -> bool:
        seen = self.last_observed_at
        return seen is None or now - seen > self.config.stale_after_s

    def forget_stale(self, now: float) -> bool:
        """Stop trusting an old observation (fall back to our own accounting); True if stale."""
        stale = self.is_stale(now)
        if stale and self.last_observed_at is not None:
            self.external_blocks = 0
        return stale

    def fragmentation(self) -> float:
        """Allocated-but-unused token slots over allocated slots, across live reservations."""
        slots = self.reserved_blocks * self.tokens_per_block
        if slots == 0:
            return 0.0
        used = sum(
            min(r.used_tokens, r.blocks * self.tokens_per_block) for r in self._held.values()
        )
        return 1.0 - used / slots
