"""Online prediction of how much of `max_tokens` a request really generates.

Per (tenant, lane), pooled per lane and pooled over every lane, the last `window` observed
ratios used/max_tokens are kept sorted; the prediction for a new request is the configured
quantile of the tenant's window (or the lane's, while the tenant has fewer than `min_samples`),
times its max_tokens, rounded up. With too few observations in its lane it predicts all of
max_tokens, which is always safe; only a guess at a running row's length (`quantile(...,
any_lane=True)`) borrows every lane's window.

Invariants: 1 <= predict(...) <= max_tokens; a window never holds more than `window` ratios,
each in [0, 1]; at most `max_windows` windows are kept (the least recently observed go first).
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from scheduler_svc.core.config import PredictConfig

_ANY_TENANT = "\x00*"  # the pooled key; cannot collide with a tenant name from the wire
_EVERY_LANE = (_ANY_TENANT, _ANY_TENANT)  # every tenant's and lane's ratios together


class _Window:
    def __init__(self, size: int) -> None:
        self.order: deque[float] = deque()
        self.sorted: list[float] = []
        self.size = size

    def add(self, ratio: float) -> None:
        if len(self.order) == self.size:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.order.append(ratio)
        bisect.insort(self.sorted, ratio)

    def quantile(self, q: float) -> float:
        # the smallest observation with at least q of the window at or below it
        index = max(0, math.ceil(q * len(self.sorted)) - 1)
        return self.sorted[index]


class OutputPredictor:
    """Quantile estimates of used/max_tokens per (tenant, lane)."""

    def __init__(self, config: PredictConfig) -> None:
        self.config = config
        self._windows: dict[tuple[str, str], _Window] = {}

    def predict(self, tenant: str, lane: str, max_tokens: int) -> int:
        """Output tokens to reserve for a request with this max_tokens."""
        known = self.quantile(tenant, lane, max_tokens, self.config.quantile)
        return max_tokens if known is None else known

    def quantile(
        self, tenant: str, lane: str, max_tokens: int, q: float, any_lane: bool = False
    ) -> int | None:
        """The output that a share `q` of requests like this one stay within; None while too
        few have been observed (where all of max_tokens is the safe reservation, but not the
        expected length). With `any_lane`, a lane not learned yet borrows every lane's ratios
        (a guess at a length, never a reservation)."""
        keys = [(tenant, lane), (_ANY_TENANT, lane)]
        if any_lane:
            keys.append(_EVERY_LANE)
        for key in keys:
            window = self._windows.get(key)
            if window is not None and len(window.sorted) >= self.config.min_samples:
                ratio = window.quantile(q)
                return min(max_tokens, max(1, math.ceil(ratio * max_tokens)))
        return None

    def observe(self, tenant: str, lane: str, max_tokens: int, output_tokens: int) -> None:
        """A request of this tenant and lane produced `output_tokens` of its `max_tokens`."""
        if max_tokens < 1:
            return
        ratio = min(1.0, max(0.0, output_tokens / max_tokens))
        for key in ((tenant, lane), (_ANY_TENANT, lane), _EVERY_LANE):
            window = self._windows.pop(key, None)  # re-inserted last: dict order is recency
            if window is None:
                window = _Window(self.config.window)
            window.add(ratio)
            self._windows[key] = window
        while len(self._windows) > self.config.max_windows:
            del self._windows[next(iter(self._windows))]  # the least recently observed

    def samples(self, tenant: str, lane: str) -> int:
        window = self._windows.get((tenant, lane))
        return 0 if window is None else len(window.sorted)
