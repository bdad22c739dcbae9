"""Per-tenant admission limits: requests at once, and a token bucket on prompt + output tokens.

`take` is asked at arrival, before the request is queued; `give_back` when it ends (whatever
the end). A refusal says which limit and when a retry could pass. State is kept for at most
`max_tenants` tenants: the least recently seen idle tenant is forgotten first (a forgotten
tenant comes back with a full bucket, which only ever errs towards admitting).

Tenants nest by `/`: `team-a/nightly` narrows `team-a`. A request is charged to every level of
its tenant that has limits of its own (`team-a`, `team-a/nightly`, ...); where none has, to its
root with the default limits. A narrowed tenant without limits of its own shares its parent's:
the parent's limits bound the sum of its sub-tenants, and naming a fresh sub-tenant never buys
a fresh bucket. (The default never binds a root above a tenant that has limits of its own:
`org/team` configured is not capped by an unconfigured `org`.)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_concurrent: int | None = None
    tokens_per_s: float | None = None
    burst_tokens: int | None = None  # None: ten seconds of tokens_per_s

    @property
    def bucket(self) -> float:
        if self.tokens_per_s is None:
            return math.inf
        return float(self.burst_tokens or max(1.0, 10 * self.tokens_per_s))


@dataclass(frozen=True)
class Refusal:
    quota: str  # "concurrent" or "tokens"
    message: str
    retry_after_s: float


@dataclass
class _State:
    active: int
    tokens: float
    at: float


class TenantQuotas:
    def __init__(
        self, default: Limits, tenants: Mapping[str, Limits], max_tenants: int = 1024
    ) -> None:
        self.default = default
        self.tenants = dict(tenants)
        self.max_tenants = max_tenants
        self._state: OrderedDict[str, _State] = OrderedDict()

    def limits(self, tenant: str) -> Limits:
        return self.tenants.get(tenant, self.default)

    def levels(self, tenant: str) -> list[str]:
        """The tenants a request of `tenant` is charged to, widest first: each level with limits
        of its own, else its root (with the default)."""
        parts = tenant.split("/")
        chain = ("/".join(parts[: i + 1]) for i in range(len(parts)))
        return [level for level in chain if level in self.tenants] or [parts[0]]

    def take(self, tenant: str, tokens: int, now: float) -> Refusal | None:
        """Admit one request of `tokens` for `tenant`, or say why not (nothing is taken)."""
        return self._charge(tenant, tokens, tokens, now, admit=True)

    def take_more(self, tenant: str, tokens: int, total: int, now: float) -> Refusal | None:
        """Charge `tokens` more to a request `take` admitted (once its real size, `total`, is
        known), or say why not (nothing more is charged; it still holds its place until
        `give_back`). `take` on a lower bound, then this, refuses what one `take` of the real
        size would, and a tenant at its concurrency limit before any work is done."""
        return self._charge(tenant, tokens, total, now, admit=False)

    def _charge(
        self, tenant: str, tokens: int, total: int, now: float, *, admit: bool
    ) -> Refusal | None:
        charged = [(level, self.limits(level)) for level in self.levels(tenant)]
        states = [self._touch(level, limits, now) for level, limits in charged]
        try:
            for (level, limits), state in zip(charged, states, strict=True):
                refusal = self._refusal(limits, state, tokens, total, admit)
                if refusal is not None:
                    if level != tenant:
                        message = f"counted against tenant {level}: {refusal.message}"
                        refusal = Refusal(refusal.quota, message, refusal.retry_after_s)
                    return refusal
            for (_, limits), state in zip(charged, states, strict=True):
                if limits.tokens_per_s is not None:
                    state.tokens -= tokens
                state.active += admit
            return None
        finally:
            self._forget_idle()  # after charging: a level just charged is not idle

    @staticmethod
    def _refusal(
        limits: Limits, state: _State, tokens: int, total: int, admit: bool
    ) -> Refusal | None:
        busy = limits.max_concurrent is not None and state.active >= limits.max_concurrent
        if admit and busy:
            return Refusal(
                "concurrent",
                f"{state.active} requests of this tenant are in progress, its limit is "
                f"{limits.max_concurrent}",
                0.1,
            )
        if limits.tokens_per_s is None:
            return None
        if total > limits.bucket:
            return Refusal(
                "tokens",
                f"the request costs {total} tokens, more than this tenant's bucket of "
                f"{limits.bucket:.0f} can ever hold",
                60.0,
            )
        if tokens > state.tokens:
            wait = (tokens - state.tokens) / limits.tokens_per_s
            return Refusal(
                "tokens",
                f"the tenant's token rate ({limits.tokens_per_s:g} tokens/s) is used up",
                round(wait, 3),
            )
        return None

    def give_back(self, tenant: str, refund: int = 0) -> None:
        """A request of `tenant` ended; `refund`: tokens it was charged and never used (one
        refused by `take_more` gives back what `take` charged)."""
        for level in self.levels(tenant):
            state = self._state.get(level)
            if state is not None and state.active > 0:
                state.active -= 1
                limits = self.limits(level)
                if refund and limits.tokens_per_s is not None:
                    state.tokens = min(limits.bucket, state.tokens + refund)

    def _touch(self, tenant: str, limits: Limits, now: float) -> _State:
        state = self._state.get(tenant)
        if state is None:
            state = _State(0, limits.bucket, now)
            self._state[tenant] = state
        else:
            self._state.move_to_end(tenant)
            if limits.tokens_per_s is not None:
                refill = (now - state.at) * limits.tokens_per_s
                state.tokens = min(limits.bucket, state.tokens + max(0.0, refill))
        state.at = now
        return state

    def _forget_idle(self) -> None:
        if len(self._state) <= self.max_tenants:
            return
        for name in list(self._state)[:-1]:  # oldest first; tenants with work in progress stay
            if len(self._state) <= self.max_tenants:
                return
            if self._state[name].active == 0:
                del self._state[name]

    @property
    def tracked(self) -> int:
        return len(self._state)
