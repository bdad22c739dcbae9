"""Prefix affinity across a pool of Tritons: send a request where its prompt's prefix is most
likely cached, without letting one hot prefix overload a replica.

Block keys (`block_keys`): a prompt's full blocks of `tokens_per_block` tokens, each key hashing
its own tokens and the key before it, so one key names the whole prefix up to its block's end.
The reference engine caches its KV blocks under the same keys (reference_engine/blocks.py).

The sidecar keeps its own index of the blocks it routed (`PrefixIndex`): for each key, the
replicas it sent it to and when. It is bounded (`max_blocks` keys, the least recently routed
dropped first) and expiring (a replica's entry older than `ttl_s` no longer counts: its engine
has likely evicted the blocks by then).

The rule (`choose`), for one request over the pool's replicas:
1. Candidates are the ready replicas (all of them if none is).
2. Balance first: a replica is eligible only while its requests in flight are at most `slack`
   above the least loaded candidate's. So a hot prefix, or a long session, spreads to another
   replica once its own is `slack` requests ahead.
3. Of the eligible ones, the session's previous replica, if any; else the one holding the
   longest run of the prompt's leading blocks (at least `min_blocks`); else, as without prefix
   routing, the fewest requests in flight, then the most free KV blocks, then round robin.
4. KV room decides between replicas that hold the prompt's prefix: the session's replica, or
   a longest-prefix holder, counts only if its KV pool can hold the request beside what the
   sidecar has running there (`HeldBlocks`; a pool of unknown size always can), while another
   holder of the prefix can. If no holder can, the rule goes on as if all could: a request is
   not sent to a replica that would have to prefill its prefix again for want of room where
   its prefix is (a second copy of a shared prefix takes as many blocks as it would wait for).
   Without a holder, a replica with room goes before one without.

Why step 4: an engine that reserves a request's blocks at admission (TensorRT-LLM's
guaranteed_no_evict) starts its waiting requests in arrival order, so one request its pool
cannot hold stalls every request behind it, cached hits included. With four emulated H200
replicas of 768 blocks each, sessions sharing sixteen 2,000-token system prompts at 190-205
requests/s held a replica's pool full at times (free 3-13 blocks, 4-6 requests waiting in the
engine) while the sidecar's own queue was empty: its later turns took up to 458 ms to a first
token, 1-6 ms of it in the sidecar, where another replica holding the same system prompt could
start them at once. Sending them to any replica with room instead copied system prompts into
more pools and made the tail worse (P99 367/438 against 316/342 ms); between holders, 244/211
ms (docs/benchmarks.md, "Shared prefixes").

`HeldBlocks` is the sidecar's count of one replica's KV blocks in use by the requests it sent
there and that have not ended: the distinct full prompt blocks (a shared prefix counts once,
as the engine shares it) plus each request's own partial block and output. A request fits
where that count plus the blocks it would add (its prompt blocks not already held there, its
own) is within the replica's pool. Cached blocks nobody holds are free to take, as in the
engine. Other clients of the same Triton are not counted.

`PrefixRouter.cached_tokens` tells the KV mirror, before a request is routed, how many of its
leading tokens the replica the rule would choose now was sent (the mirror reserves the rest
where the engine reuses blocks); asking routes and remembers nothing.

Invariants (checked by tests/unit/core/test_prefix.py): every choice is a candidate with at most
`slack` more requests in flight than the least loaded candidate; a choice overfills a replica's
known KV pool only when none of the replicas step 4 weighs (the prefix's holders and the
session's replica within the slack, or all within it where none holds the prefix) could hold
the request; the index never holds more
than `max_blocks` keys, nor the session map more than `max_sessions` sessions; a replica is
credited only with a leading run of blocks it was sent (never a later block alone); the held
blocks return to zero when every routed request is released.
Pure: the caller passes the time.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass


def block_keys(tokens: Sequence[int], tokens_per_block: int) -> list[bytes]:
    """The key of every full block of `tokens`: each hashes its own tokens and the key before
    it, so a key names the whole prefix up to the block's end (128-bit BLAKE2b)."""
    keys: list[bytes] = []
    previous = b""
    for end in range(tokens_per_block, len(tokens) + 1, tokens_per_block):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("q", tokens[end - tokens_per_block : end]).tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


class PrefixIndex:
    """Which replicas were sent which prompt blocks, and when (bounded, expiring)."""

    def __init__(self, max_blocks: int, ttl_s: float) -> None:
        if max_blocks < 1 or ttl_s <= 0:
            raise ValueError("a prefix index needs room for a block and a positive lifetime")
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._keys: OrderedDict[bytes, dict[int, float]] = OrderedDict()  # oldest routed first

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, replica: int, keys: Sequence[bytes], now: float) -> None:
        """`replica` was sent a prompt with these leading blocks now."""
        for key in keys:
            self._keys.setdefault(key, {})[replica] = now
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_blocks:
            self._keys.popitem(last=False)
        # Drop what has expired everywhere, from the oldest routed on.
        while self._keys:
            key, seen = next(iter(self._keys.items()))
            if max(seen.values()) >= now - self.ttl_s:
                break
            del self._keys[key]

    def matched(self, keys: Sequence[bytes], now: float) -> dict[int, int]:
        """For each replica, how many of `keys` from the first it holds in an unbroken run
        (entries younger than `ttl_s` only); replicas holding none are left out."""
        counts: dict[int, int] = {}
        running: set[int] | None = None
        for depth, key in enumerate(keys, start=1):
            seen = self._keys.get(key)
            if seen is None:
                break
            alive = {r for r, when in seen.items() if now - when <= self.ttl_s}
            running = alive if running is None else running & alive
            if not running:
                break
            for replica in running:
                counts[replica] = depth
        return counts

    def forget(self, replica: int) -> None:
        """A replica restarted or left: nothing it was sent is cached there any more."""
        for key in list(self._keys):
            seen = self._keys[key]
            seen.pop(replica, None)
            if not seen:
                del self._keys[key]


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the pool sees it now (`total_blocks` 0: its KV pool's size unknown)."""

    ready: bool
    in_flight: int
    free_blocks: int = 0
    total_blocks: int = 0


class HeldBlocks:
    """The KV blocks of one replica that the requests routed there and not yet released hold:
    each distinct full prompt block once, plus every request's own blocks (`extra`)."""

    def __init__(self) -> None:
        self._keys: Counter[bytes] = Counter()
        self._extra = 0

    @property
    def used(self) -> int:
        return len(self._keys) + self._extra

    def need(self, keys: Sequence[bytes], extra: int) -> int:
        """The blocks a request with these prompt blocks and `extra` of its own would add."""
        return sum(1 for key in keys if key not in self._keys) + extra

    def hold(self, keys: Sequence[bytes], extra: int) -> None:
        self._keys.update(keys)
        self._extra += extra

    def release(self, keys: Sequence[bytes], extra: int) -> None:
        self._keys.subtract(keys)
        for key in keys:
            if self._keys[key] <= 0:
                del self._keys[key]
        self._extra -= extra


@dataclass(frozen=True)
class Routed:
    """Where `PrefixRouter.route` sent a request, and the blocks it holds there until
    `PrefixRouter.release`."""

    replica: int
    keys: tuple[bytes, ...]
    extra_blocks: int


def choose(
    replicas: Sequence[ReplicaLoad],
    matched: dict[int, int],
    *,
    slack: int,
    min_blocks: int = 1,
    previous: int | None = None,
    turn: int = 0,
    fits: Collection[int] | None = None,
) -> tuple[int, str]:
    """The replica for one request, and why: `session` (its previous turn's replica),
    `prefix` (the longest cached run of its blocks) or `load` (the least loaded). `fits`: the
    replicas whose KV pool can hold it now (None: no check)."""
    if not replicas:
        raise ValueError("no replica to choose from")
    indices = [i for i, r in enumerate(replicas) if r.ready] or list(range(len(replicas)))
    least = min(replicas[i].in_flight for i in indices)
    eligible = [i for i in indices if replicas[i].in_flight <= least + slack]
    n = len(replicas)

    def lighter(i: int) -> tuple[int, int, int]:
        return (replicas[i].in_flight, -replicas[i].free_blocks, (i - turn) % n)

    def roomy(among: list[int]) -> list[int]:
        """Those of `among` with KV room; all of them if none has (or nothing is known)."""
        if fits is None:
            return among
        return [i for i in among if i in fits] or among

    holders = [i for i in eligible if matched.get(i, 0) >= min_blocks]
    if previous is not None and previous in eligible and previous in roomy([*holders, previous]):
        return previous, "session"
    if holders:
        holders = roomy(holders)
        best = max(matched[i] for i in holders)
        return min((i for i in holders if matched[i] == best), key=lighter), "prefix"
    return min(roomy(eligible), key=lighter), "load"


class PrefixRouter:
    """The index, the sessions' last replicas, and the rule, for one pool."""

    def __init__(
        self,
        *,
        tokens_per_block: int,
        max_blocks: int,
        ttl_s: float,
        slack: int,
        min_blocks: int = 1,
        max_sessions: int = 65_536,
    ) -> None:
        if tokens_per_block < 1 or slack < 0 or min_blocks < 1 or max_sessions < 1:
            raise ValueError("invalid prefix routing settings")
        self.tokens_per_block = tokens_per_block
        self.index = PrefixIndex(max_blocks, ttl_s)
        self.slack = slack
        self.min_blocks = min_blocks
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._turn = 0
        self._held: dict[int, HeldBlocks] = {}
        self.reasons: dict[str, int] = {"session": 0, "prefix": 0, "load": 0}

    def cached_tokens(
        self,
        prompt: Sequence[int],
        session: str,
        replicas: Sequence[ReplicaLoad],
        now: float,
        *,
        max_tokens: int = 0,
    ) -> int:
        """The leading prompt tokens the replica `route` would choose now was sent lately
        (its matched run of blocks), for the KV mirror's reservation; nothing is remembered."""
        keys = block_keys(prompt, self.tokens_per_block)
        matched = self.index.matched(keys, now)
        if not matched:
            return 0
        extra = self._extra_blocks(len(prompt) + max_tokens, len(keys))
        replica, _ = self._choose(keys, matched, extra, session, replicas, now)
        return matched.get(replica, 0) * self.tokens_per_block

    def previous(self, session: str, now: float) -> int | None:
        """The session's last replica, while its entry is younger than the index's ttl."""
        last = self._sessions.get(session) if session else None
        return last[0] if last is not None and now - last[1] <= self.index.ttl_s else None

    def _extra_blocks(self, tokens: int, full: int) -> int:
        """A request's own blocks: those of its prompt and output past its full prompt blocks."""
        return -(-tokens // self.tokens_per_block) - full

    def _choose(
        self,
        keys: Sequence[bytes],
        matched: dict[int, int],
        extra: int,
        session: str,
        replicas: Sequence[ReplicaLoad],
        now: float,
    ) -> tuple[int, str]:
        fits = [
            i
            for i, r in enumerate(replicas)
            if r.total_blocks <= 0
            or self.held(i).used + self.held(i).need(keys, extra) <= r.total_blocks
        ]
        return choose(
            replicas,
            matched,
            slack=self.slack,
            min_blocks=self.min_blocks,
            previous=self.previous(session, now),
            turn=self._turn,
            fits=fits,
        )

    def held(self, replica: int) -> HeldBlocks:
        """The blocks the requests routed to `replica` and not yet released hold there."""
        return self._held.setdefault(replica, HeldBlocks())

    def route(
        self,
        prompt: Sequence[int],
        session: str,
        replicas: Sequence[ReplicaLoad],
        now: float,
        *,
        max_tokens: int = 0,
    ) -> Routed:
        """Choose a replica for a prompt (and its session, "" for none) that asks for up to
        `max_tokens`; remember the choice, and hold its blocks there until `release`."""
        keys = block_keys(prompt, self.tokens_per_block)
        extra = self._extra_blocks(len(prompt) + max_tokens, len(keys))
        matched = self.index.matched(keys, now)
        replica, why = self._choose(keys, matched, extra, session, replicas, now)
        self._turn += 1
        self.reasons[why] += 1
        self.index.record(replica, keys, now)
        if session:
            self._sessions.pop(session, None)
            self._sessions[session] = (replica, now)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self.held(replica).hold(keys, extra)
        return Routed(replica, tuple(keys), extra)

    def release(self, routed: Routed) -> None:
        """A routed request ended: its blocks on its replica are no longer held."""
        self.held(routed.replica).release(routed.keys, routed.extra_blocks)

    @property
    def sessions(self) -> int:
        return len(self._sessions)
