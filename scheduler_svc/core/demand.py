"""Each root tenant's recent demand: the work it offered, decayed by a half-life.

The policy keeps an engine's last free row for a *light* tenant, one offering well under its
fair share of the work (core/policy.py, `rows_kept_for_light`). Fair order alone cannot serve such
a tenant on time when another one holds every row: its request heads fair order at once but
waits for a row to free, and on an engine of few rows those free seconds apart in the tail
(live, the CPU engine's 16 rows under a flood: gaps between ends P99 165 ms, max 254 ms). What
marks a tenant as light is the work it offered lately against its share of the work the engine
took in the same time, not the rows it holds now (tenants of like demand hold unequal rows at any
instant by chance), nor its share of what all tenants offered (a backlogged tenant of small
requests offers little beside tenants of large ones, yet more than its share).

Pure: time is passed in; at most `max_tenants` tenants are remembered (the least recent demand
is forgotten first).
"""

from __future__ import annotations

MAX_TENANTS = 1024


class RecentDemand:
    """Work offered per tenant and work dispatched in all, each unit worth half as much
    `half_life_s` later: both in tokens, so the two compare as rates."""

    def __init__(self, half_life_s: float, max_tenants: int = MAX_TENANTS) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        if max_tenants < 1:
            raise ValueError("max_tenants must be >= 1")
        self.half_life_s = half_life_s
        self.max_tenants = max_tenants
        self._work: dict[str, tuple[float, float]] = {}  # tenant -> (decayed work, as of)
        self._served = (0.0, 0.0)  # (decayed work dispatched, as of)

    def __len__(self) -> int:
        """Tenants tracked (seen lately or not yet dropped): at least those `offered` lists."""
        return len(self._work)

    def _decayed(self, value: float, since: float, now: float) -> float:
        factor: float = 0.5 ** (max(0.0, now - since) / self.half_life_s)
        return value * factor

    def add(self, tenant: str, work: float, now: float) -> None:
        """`tenant` offered `work` (tokens) at `now`."""
        value, since = self._work.get(tenant, (0.0, now))
        self._work[tenant] = (self._decayed(value, since, now) + max(0.0, work), now)
        if len(self._work) > self.max_tenants:
            oldest = min(self._work, key=lambda t: self._work[t][1])
            del self._work[oldest]

    def serve(self, work: float, now: float) -> None:
        """`work` (tokens) went to the engine at `now`."""
        value, since = self._served
        self._served = (self._decayed(value, since, now) + max(0.0, work), now)

    def served(self, now: float) -> float:
        """The work dispatched lately (decayed)."""
        return self._decayed(*self._served, now)

    def offered(self, now: float) -> dict[str, float]:
        """Each tenant seen within one half-life: the work it offered lately (decayed)."""
        return {
            tenant: self._decayed(value, since, now)
            for tenant, (value, since) in self._work.items()
            if now - since < self.half_life_s
        }
