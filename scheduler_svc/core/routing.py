"""Backend groups: which named group of Tritons serves a request, and the canary rollout.

A request's class (its lane, tenant, session and an explicit `precision` field) is routed in
three steps:
1. precision routes, first match wins: e.g. the hot lane to an FP16 engine, the cold lane to
   an AWQ one, `precision: fp16` to the FP16 engine (the source document's per-request
   precision switch). Nothing matched: the default group.
2. the speculative-decoding gate: a request of the gated lane (cold) goes to the speculative
   group only while its latest gate result passed (draft/target n-gram overlap above the
   threshold, 92 % in the source document).
3. the rollout: a request bound for the rollout's `current` group goes to `candidate` when
   its sticky key falls in the candidate's share (10 / 50 / 100 %). The key is the session,
   else the tenant, else the request: one conversation stays on one version, and every
   sidecar replica maps a key to the same side.

The rollout watches both sides over a sliding window: a request attains the SLO when it ends
without error and its first token came within `ttft_slo_s` of reaching the backend. When the
candidate's attainment falls more than `attainment_margin` below the current group's, or its
error rate rises more than `error_margin` above it (each side with at least `min_requests` in
the window), the candidate's share goes back to 0 at once. At 100 % the current group takes no
traffic, so the comparison is with its last window before promotion; it stays warm (health
checked) for `hold_s`, ready to take everything back, then drains: from then on the candidate
is the version. Pure: the caller passes the time and records what each event says.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

DEFAULT_GROUP = "main"  # the `triton` section's endpoints
MAX_WINDOW_BUCKETS = 3600  # one-second buckets kept per group (bounds any window)


@dataclass(frozen=True)
class RouteClass:
    """What routing knows of a request (the lane is set when the core dispatches it)."""

    request_id: str = ""
    lane: str = ""
    tenant: str = ""
    session: str = ""
    precision: str = ""  # an explicit request field; "" leaves it to the routes

    def sticky_key(self, sticky: str) -> str:
        if sticky == "session" and self.session:
            return f"s:{self.session}"
        if sticky in ("session", "tenant") and self.tenant:
            return f"t:{self.tenant}"
        return f"r:{self.request_id}"


@dataclass(frozen=True)
class RouteRule:
    """Requests matching every field given here go to `group`."""

    group: str
    lane: str | None = None
    tenant: str | None = None
    precision: str | None = None

    def matches(self, cls: RouteClass) -> bool:
        return (
            (self.lane is None or self.lane == cls.lane)
            and (self.tenant is None or self.tenant == cls.tenant)
            and (self.precision is None or self.precision == cls.precision)
        )


@dataclass(frozen=True)
class RolloutConfig:
    current: str = DEFAULT_GROUP
    candidate: str | None = None
    weight: int = 0  # the candidate's share at start, percent
    steps: tuple[int, ...] = (10, 50, 100)
    sticky: str = "session"  # session (then tenant), tenant, or none (each request)
    window_s: float = 300.0
    min_requests: int = 50
    ttft_slo_s: float = 1.0
    attainment_margin: float = 0.05
    error_margin: float = 0.02
    hold_s: float = 3600.0
    auto_rollback: bool = True


@dataclass(frozen=True)
class SpecGateConfig:
    group: str
    lane: str = "cold"


class Phase(StrEnum):
    OFF = "off"  # no candidate, or its share is 0 and it never took traffic
    CANARY = "canary"  # the candidate takes a share below 100 %
    HOLD = "hold"  # the candidate takes everything; the current group is kept warm
    DONE = "done"  # the hold is over: the current group is drained
    ROLLED_BACK = "rolled_back"  # the candidate fell behind; its share went back to 0


@dataclass(frozen=True)
class Event:
    """A rollout step for the shell to log and count (kind: step, rollback, drained)."""

    kind: str
    weight: int
    reason: str


@dataclass(frozen=True)
class Window:
    requests: int
    errors: int
    attained: int

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def attainment(self) -> float:
        return self.attained / self.requests if self.requests else 1.0


@dataclass
class _Bucket:
    second: int
    requests: int = 0
    errors: int = 0
    attained: int = 0


@dataclass
class _Side:
    buckets: deque[_Bucket] = field(default_factory=lambda: deque(maxlen=MAX_WINDOW_BUCKETS))

    def add(self, now: float, ok: bool, attained: bool) -> None:
        second = int(now)
        if not self.buckets or self.buckets[-1].second != second:
            self.buckets.append(_Bucket(second))
        bucket = self.buckets[-1]
        bucket.requests += 1
        bucket.errors += not ok
        bucket.attained += ok and attained

    def window(self, now: float, window_s: float) -> Window:
        start = now - window_s
        while self.buckets and self.buckets[0].second + 1 <= start:
            self.buckets.popleft()
        return Window(
            sum(b.requests for b in self.buckets),
            sum(b.errors for b in self.buckets),
            sum(b.attained for b in self.buckets),
        )


def share_of(key: str) -> int:
    """A key's place in 0..99, the same in every process."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % 100


class Router:
    """Chooses each request's group and runs the rollout's state machine."""

    def __init__(
        self,
        groups: tuple[str, ...],
        rollout: RolloutConfig | None = None,
        routes: tuple[RouteRule, ...] = (),
        spec_gate: SpecGateConfig | None = None,
        now: float = 0.0,
    ) -> None:
        self.groups = groups
        self.rollout = rollout or RolloutConfig(current=groups[0])
        self.routes = routes
        self.spec_gate = spec_gate
        self.gate_passed = False
        known = set(groups)
        named = [self.rollout.current, *(r.group for r in routes)]
        if self.rollout.candidate is not None:
            named.append(self.rollout.candidate)
        if spec_gate is not None:
            named.append(spec_gate.group)
        for name in named:
            if name not in known:
                raise ValueError(f"unknown backend group {name!r} (known: {', '.join(groups)})")
        self.weight = 0
        self.phase = Phase.OFF
        self.hold_until: float | None = None
        self.baseline: Window | None = None
        self._sides = {name: _Side() for name in groups}
        self.counts = {"step": 0, "rollback": 0, "drained": 0}
        if self.rollout.weight:
            self.set_weight(self.rollout.weight, now, "configured")

    # -- routing ----------------------------------------------------------------------------

    @property
    def precisions(self) -> frozenset[str]:
        """The `precision` values some route names."""
        return frozenset(r.precision for r in self.routes if r.precision is not None)

    def choose(self, cls: RouteClass) -> str:
        group = next((r.group for r in self.routes if r.matches(cls)), self.rollout.current)
        gate = self.spec_gate
        if gate is not None and self.gate_passed and cls.lane == gate.lane:
            group = gate.group
        return self.rolled(group, cls)

    def rolled(self, group: str, cls: RouteClass) -> str:
        """`group`, or the candidate where the rollout sends this request there."""
        candidate = self.rollout.candidate
        if candidate is None or group != self.rollout.current:
            return group
        if self.phase is Phase.DONE:
            return candidate
        if self.weight and share_of(cls.sticky_key(self.rollout.sticky)) < self.weight:
            return candidate
        return group

    def shares(self) -> dict[str, int]:
        """Percent of the current group's traffic each group takes now."""
        out = dict.fromkeys(self.groups, 0)
        candidate = self.rollout.candidate
        weight = 100 if self.phase is Phase.DONE else self.weight
        out[self.rollout.current] = 100 - weight if candidate else 100
        if candidate is not None:
            out[candidate] = weight
        return out

    def taking_traffic(self, group: str) -> bool:
        """Whether `group` may get requests now (or at once, on a rollback)."""
        if self.rollout.candidate is None:
            return True
        if group == self.rollout.current:
            return self.phase is not Phase.DONE or any(r.group == group for r in self.routes)
        return True

    def set_gate(self, passed: bool) -> None:
        self.gate_passed = passed

    # -- the rollout ------------------------------------------------------------------------

    def observe(self, group: str, ok: bool, ttft_s: float | None, now: float) -> None:
        """A request on `group` ended (ok: without error); ttft_s from reaching the backend."""
        side = self._sides.get(group)
        if side is not None:
            side.add(now, ok, ttft_s is not None and ttft_s <= self.rollout.ttft_slo_s)

    def window(self, group: str, now: float) -> Window:
        return self._sides[group].window(now, self.rollout.window_s)

    def set_weight(self, weight: int, now: float, reason: str) -> list[Event]:
        """The operator's (or the config's) step: the candidate takes `weight` percent."""
        if self.rollout.candidate is None:
            raise ValueError("no rollout candidate is configured (rollout.candidate)")
        if not 0 <= weight <= 100:
            raise ValueError(f"rollout weight {weight} is not a percentage (0..100)")
        if self.phase is Phase.DONE:
            raise ValueError("the rollout is done: the current group was drained")
        if weight == 100 and self.phase is not Phase.HOLD:
            current = self.window(self.rollout.current, now)
            self.baseline = current if current.requests >= self.rollout.min_requests else None
            self.hold_until = now + self.rollout.hold_s
        self.weight = weight
        self.phase = Phase.HOLD if weight == 100 else Phase.CANARY if weight else Phase.OFF
        if self.phase is not Phase.HOLD:
            self.hold_until = None
        self.counts["step"] += 1
        return [Event("step", weight, reason)]

    def advance(self, now: float) -> list[Event]:
        """The next configured step above the present share."""
        later = [s for s in self.rollout.steps if s > self.weight]
        if not later:
            raise ValueError(f"no step above {self.weight} % (rollout.steps)")
        return self.set_weight(later[0], now, "advanced")

    def tick(self, now: float) -> list[Event]:
        """Roll back a candidate that fell behind; drain the current group after the hold."""
        if self.phase in (Phase.CANARY, Phase.HOLD) and self.rollout.auto_rollback:
            reason = self.behind(now)
            if reason is not None:
                self.weight = 0
                self.phase = Phase.ROLLED_BACK
                self.hold_until = None
                self.counts["rollback"] += 1
                return [Event("rollback", 0, reason)]
        if self.phase is Phase.HOLD and self.hold_until is not None and now >= self.hold_until:
            self.phase = Phase.DONE
            self.counts["drained"] += 1
            return [Event("drained", 100, f"hold of {self.rollout.hold_s:g} s is over")]
        return []

    def behind(self, now: float) -> str | None:
        """Why the candidate is behind the current group, or None while it is not (or too
        few requests say either way)."""
        cfg = self.rollout
        assert cfg.candidate is not None
        candidate = self.window(cfg.candidate, now)
        current = self.window(cfg.current, now)
        if current.requests < cfg.min_requests:
            current = self.baseline or current
        if candidate.requests < cfg.min_requests or current.requests < cfg.min_requests:
            return None
        if candidate.attainment < current.attainment - cfg.attainment_margin:
            return (
                f"SLO attainment {candidate.attainment:.1%} against {current.attainment:.1%} "
                f"(margin {cfg.attainment_margin:.1%})"
            )
        if candidate.error_rate > current.error_rate + cfg.error_margin:
            return (
                f"error rate {candidate.error_rate:.1%} against {current.error_rate:.1%} "
                f"(margin {cfg.error_margin:.1%})"
            )
        return None
