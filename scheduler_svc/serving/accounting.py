"""What the service records of one request: its one `request end` log line (`RequestRecord`)
and its part in its root tenant's fair-share metrics (`TenantShare`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from scheduler_svc.core.types import Decision, Expired
from scheduler_svc.serving.metrics import SidecarMetrics

log = structlog.get_logger("scheduler_svc.requests")


class TenantShare:
    """One request's part in its root tenant's fair-share metrics: queued from admission to
    the policy's decision, refused by reason, tokens served per lane."""

    def __init__(self, metrics: SidecarMetrics, label: str) -> None:
        self.metrics, self.label, self.queued = metrics, label, True
        metrics.tenant_queued.labels(label).inc()

    def _leave_queue(self) -> None:
        if self.queued:
            self.queued = False
            self.metrics.tenant_queued.labels(self.label).dec()

    def decided(self, decision: Decision) -> None:
        self._leave_queue()
        if isinstance(decision, Expired):
            self.metrics.tenant_refusals.labels(self.label, decision.reason.value).inc()

    def ended(self, run: RequestRecord) -> None:
        self._leave_queue()  # left before a decision: the client went, or the server's cap
        if run.dispatched:
            served = run.prompt_tokens + run.completion_tokens
            self.metrics.tenant_tokens.labels(self.label, run.lane).inc(served)


@dataclass
class RequestRecord:
    """What one request's log line records."""

    request_id: str  # the client's (or, when it gave none, the internal one)
    internal_id: str  # the sidecar's own: the core's key and the engine request's id
    started: float
    clock: Callable[[], float] = field(repr=False)  # the service's (the core loop's)
    queued_at: float | None = None
    first_token_at: float | None = None
    lane: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    outcome: str = "error"
    dispatched: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def queue_ms(self) -> float:
        return ((self.queued_at or self.clock()) - self.started) * 1000

    def who(self, tenant: str) -> dict[str, object]:
        """What every log line about this request names."""
        return {
            "request_id": self.request_id,
            "sidecar_id": self.internal_id,
            "tenant": tenant,
            "prompt_tokens": self.prompt_tokens,
        }

    def log_end(self, tenant: str, ended: float) -> None:
        """The request's one `request end` line (`ended`: when it ended, on the clock)."""
        log.info(
            "request end",
            **self.who(tenant),
            lane=self.lane,
            outcome=self.outcome,
            completion_tokens=self.completion_tokens,
            queue_ms=round(((self.queued_at or ended) - self.started) * 1000, 2),
            ttft_ms=round((self.first_token_at - self.started) * 1000, 2)
            if self.first_token_at
            else None,
            total_ms=round((ended - self.started) * 1000, 2),
        )
