"""Predictive admission: how long a request would wait, from the rate its lane really drains.

Each lane learns its drain rate online: tokens (prompt, less what the engine was expected to
find cached, + output: a request's work, `Entry.cost_tokens`) of the lane's requests that
completed, per second of the lane's *busy* time, that is time when the lane had requests
waiting in the sidecar while the engine ran others (the engine, not the arrivals, set the pace
then; an idle lane's completions say nothing of what it could drain). Both sums decay with
busy time (half-life `half_life_s`), so the rate follows a changing engine or mix, and idle
spells forget nothing. The rate is trusted after `min_busy_s` of busy time and
`min_completions` completions; before that the lane makes no prediction and admission falls
back to the lane caps and timers.

The policy predicts the wait ahead of a new request as the queued work of its lane (tokens:
prompt + predicted output) over that rate. Measured per lane, the rate already carries the
lane's share of the engine, the other lanes' pressure and the engine's speed on this mix, so no
model of the engine is needed. A lane not yet learned borrows the rate of the whole engine
(every lane's completions over time when any lane waited), which no single lane can beat, so
the borrowed prediction errs short, towards admitting.

Each lane also learns how long its requests take from their start in the engine to their first
token (`RecentMedian`: the median of its last RECENT_WINDOW starts). A request must start
that much before its TTFT target to meet it, so on an in-flight engine the policy orders,
times out and admits by the target less that time (`PolicyScheduler.start_budget`). The
engine's time per output token of a running row is learned the same way, from the rows'
progress reports; with each row's predicted output left, it says when the engine's rows free
(`PolicyScheduler.row_wait`: what a first-lane arrival waits while every row is taken).

Invariants: rates are finite and > 0 once trusted; sums are >= 0; a recent median is the
median of at most RECENT_WINDOW non-negative samples.
"""

from __future__ import annotations

from collections import deque

from scheduler_svc.core.config import AdmissionConfig

# How often a running row reports its output so far to the core, in tokens (after its first
# token, which always reports): KV growth and the row's time left (`PolicyScheduler.row_wait`)
# follow it. Every 16 tokens, a hot row of under 16 reported only its first token, and its time
# left was counted from there at the engine's median pace: a row a little slower than the
# median was predicted to free well before it did (live, mixed at 1.2x: refusals at arrival
# missed rows freeing 185-529 ms away against a 120 ms budget).
PROGRESS_EVERY_TOKENS = 4
RECENT_WINDOW = 64  # samples a recent median is taken over (a lane's starts, the rows' steps)
RECENT_MIN = 8  # samples seen before a recent median is trusted


class DrainRate:
    """One lane's tokens per busy second, exponentially weighted by busy time."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.tokens = 0.0
        self.busy_s = 0.0
        self.completions = 0
        self._last: float | None = None
        self._busy = False

    def advance(self, now: float, busy: bool) -> bool:
        """Time passes to `now`; `busy` is the lane's state from now on. Returns whether the
        interval that just ended was busy."""
        was = self._busy
        if self._last is not None and was and now > self._last:
            dt = now - self._last
            decay = 0.5 ** (dt / self.config.half_life_s)
            self.tokens *= decay
            self.busy_s = self.busy_s * decay + dt
        self._last, self._busy = now, busy
        return was

    def observe(self, tokens: int) -> None:
        """A request of this lane completed while the lane was busy, having used `tokens`."""
        self.tokens += max(0, tokens)
        self.completions += 1

    def rate(self) -> float | None:
        """Tokens per second, or None while too little has been seen to say."""
        cfg = self.config
        if self.completions < cfg.min_completions or self.busy_s < cfg.min_busy_s:
            return None
        if self.tokens <= 0:
            return None
        return self.tokens / self.busy_s


class RecentMedian:
    """The median of recent durations: a lane's seconds from a request's start in the engine
    to its first token, or the engine's seconds per output token of a running row."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=RECENT_WINDOW)
        # Worked out when read and kept until the next sample: a lane's first-token time is
        # read at every arrival, the rows' pace is written at every progress report.
        self._median: float | None = None
        self._stale = False

    def observe(self, seconds: float) -> None:
        self.samples.append(max(0.0, seconds))
        self._stale = True

    def median(self) -> float | None:
        """The median of the recent samples, or None while fewer than RECENT_MIN."""
        if self._stale:
            self._stale = False
            if len(self.samples) >= RECENT_MIN:
                self._median = sorted(self.samples)[len(self.samples) // 2]
        return self._median
