"""Work-conserving weighted sharing of a token budget between lanes: deficit round robin.

Each round, every lane with work gets `quantum x share` tokens of credit; a lane may send its
head batch once its credit covers the batch's cost (prompt + predicted output tokens). Instead
of simulating rounds one by one, `choose` computes how many rounds each lane would need and
picks the lane needing fewest (ties: round-robin order from the last lane served), crediting
every waiting lane with that many rounds. A lane with nothing ready banks nothing, so an idle
lane's share flows to the busy ones.

Invariants: credit >= 0 after `charge`; credit never exceeds one round plus the lane's head cost
(no lane hoards credit while it is blocked).
"""

from __future__ import annotations

import math
from collections.abc import Mapping


class DeficitRoundRobin:
    def __init__(self, shares: Mapping[str, float], quantum_tokens: int) -> None:
        self.order = list(shares)
        self.shares = dict(shares)
        self.quantum_tokens = quantum_tokens
        self.credit = dict.fromkeys(self.order, 0.0)
        self._next = 0

    def reconfigure(self, shares: Mapping[str, float], quantum_tokens: int) -> None:
        self.shares = dict(shares)
        self.quantum_tokens = quantum_tokens

    def idle(self, lane: str) -> None:
        """The lane has nothing ready: it banks nothing."""
        self.credit[lane] = 0.0

    def choose(self, costs: Mapping[str, int]) -> str:
        """Among lanes with a ready batch of the given cost, the one to serve next."""

        def quantum(lane: str) -> float:
            return self.quantum_tokens * self.shares[lane]

        def need(lane: str) -> tuple[int, int]:
            rounds = max(0, math.ceil((costs[lane] - self.credit[lane]) / quantum(lane)))
            distance = (self.order.index(lane) - self._next) % len(self.order)
            return rounds, distance

        lane = min(costs, key=need)
        rounds = need(lane)[0]
        for other, cost in costs.items():
            step = quantum(other)
            self.credit[other] = min(self.credit[other] + rounds * step, step + cost)
        return lane

    def charge(self, lane: str, tokens: int) -> None:
        """The lane sent a batch of `tokens`; the next turn starts after it."""
        self.credit[lane] -= tokens
        self._next = (self.order.index(lane) + 1) % len(self.order)
