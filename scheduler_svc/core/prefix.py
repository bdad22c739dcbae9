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

`PrefixRouter.cached_tokens` tells the KV mirror, before a request is routed, how many of its
leading tokens the replica the rule would choose now was sent (the mirror reserves the rest
where the engine reuses blocks); asking routes and remembers nothing.

Invariants (checked by tests/unit/core/test_prefix.py): every choice is a candidate with at most
`slack` more requests in flight than the least loaded candidate; the index never holds more
than `max_blocks` keys, nor the session map more than `max_sessions` sessions; a replica is
credited only with a leading run of blocks it was sent (never a later block alone).
Pure: the caller passes the time.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
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
    """One replica as the pool sees it now."""

    ready: bool
    in_flight: int
    free_blocks: int = 0


def choose(
    replicas: Sequence[ReplicaLoad],
    matched: dict[int, int],
    *,
    slack: int,
    min_blocks: int = 1,
    previous: int | None = None,
    turn: int = 0,
) -> tuple[int, str]:
    """The replica for one request, and why: `session` (its previous turn's replica),
    `prefix` (the longest cached run of its blocks) or `load` (the least loaded)."""
    if not replicas:
        raise ValueError("no replica to choose from")
    indices = [i for i, r in enumerate(replicas) if r.ready] or list(range(len(replicas)))
    least = min(replicas[i].in_flight for i in indices)
    eligible = [i for i in indices if replicas[i].in_flight <= least + slack]
    n = len(replicas)

    def lighter(i: int) -> tuple[int, int, int]:
        return (replicas[i].in_flight, -replicas[i].free_blocks, (i - turn) % n)

    if previous is not None and previous in eligible:
        return previous, "session"
    best = max((matched.get(i, 0) for i in eligible), default=0)
    if best >= min_blocks:
        holders = [i for i in eligible if matched.get(i, 0) == best]
        return min(holders, key=lighter), "prefix"
    return min(eligible, key=lighter), "load"


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
        self.reasons: dict[str, int] = {"session": 0, "prefix": 0, "load": 0}

    def cached_tokens(
        self, prompt: Sequence[int], session: str, replicas: Sequence[ReplicaLoad], now: float
    ) -> int:
        """The leading prompt tokens the replica `route` would choose now was sent lately
        (its matched run of blocks), for the KV mirror's reservation; nothing is remembered."""
        keys = block_keys(prompt, self.tokens_per_block)
        matched = self.index.matched(keys, now)
        if not matched:
            return 0
        replica, _ = choose(
            replicas,
            matched,
            slack=self.slack,
            min_blocks=self.min_blocks,
            previous=self._previous(session, now),
            turn=self._turn,
        )
        return matched.get(replica, 0) * self.tokens_per_block

    def _previous(self, session: str, now: float) -> int | None:
        """The session's last replica, while its entry is younger than the index's ttl."""
        last = self._sessions.get(session) if session else None
        return last[0] if last is not None and now - last[1] <= self.index.ttl_s else None

    def route(
        self, prompt: Sequence[int], session: str, replicas: Sequence[ReplicaLoad], now: float
    ) -> int:
        """Choose a replica for a prompt (and its session, "" for none); remember the choice."""
        keys = block_keys(prompt, self.tokens_per_block)
        replica, why = choose(
            replicas,
            self.index.matched(keys, now),
            slack=self.slack,
            min_blocks=self.min_blocks,
            previous=self._previous(session, now),
            turn=self._turn,
        )
        self._turn += 1
        self.reasons[why] += 1
        self.index.record(replica, keys, now)
        if session:
            self._sessions.pop(session, None)
            self._sessions[session] = (replica, now)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return replica

    @property
    def sessions(self) -> int:
        return len(self._sessions)
