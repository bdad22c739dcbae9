"""The circuit breaker: while one lane's backlog is too deep, demote part of another's arrivals.

It opens when the watched backlog exceeds `open_above`, or when an arrival in the watched lane
is predicted to wait past that lane's queue timeout (`late`: the lane's learned drain rate says
so, whatever the count), and closes only once the backlog is below `close_below`, nothing is
predicted late, and it has been open `min_open_s` (hysteresis, so it does not flap). While open,
a running credit demotes exactly `demote_fraction` of the demoted lane's arrivals, spread evenly.

Invariant: 0 <= credit < 1 between calls; opens and closes alternate.
"""

from __future__ import annotations

from scheduler_svc.core.config import BreakerConfig


class Breaker:
    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self.is_open = False
        self.opened_at = 0.0
        self._credit = 0.0

    def update(self, backlog: int, now: float, late: bool = False) -> bool:
        """Feed the watched lane's backlog (and whether its arrivals are predicted to start past
        its timeout); True if the breaker changed state."""
        cfg = self.config
        if not self.is_open and (backlog > cfg.open_above or late):
            self.is_open, self.opened_at, self._credit = True, now, 0.0
            return True
        settled = backlog < cfg.close_below and not late
        if self.is_open and settled and now - self.opened_at >= cfg.min_open_s:
            self.is_open = False
            return True
        return False

    def demote(self) -> bool:
        """For one arrival in the demoted lane: move it to the lower lane?"""
        if not self.is_open:
            return False
        self._credit += self.config.demote_fraction
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False

    def next_check(self, now: float) -> float | None:
        """When an open breaker may first close (the end of its minimum open time)."""
        if self.is_open:
            until = self.opened_at + self.config.min_open_s
            return until if until > now else None
        return None
