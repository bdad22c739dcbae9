"""The scheduler seam's inputs and outputs: frozen, plain data."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Protocol


class Urgency(IntEnum):
    """How soon a request wants service; lower sorts first."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


class RejectReason(StrEnum):
    QUEUE_FULL = "queue_full"
    DUPLICATE = "duplicate_request_id"


class ExpireReason(StrEnum):
    QUEUE_TIMEOUT = "queue_timeout"


@dataclass(frozen=True)
class Request:
    """What the scheduler knows of a request when it arrives."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    urgency: Urgency = Urgency.STANDARD
    tenant: str = ""
    # Latest time it may still be dispatched (monotonic seconds); None waits forever.
    queue_deadline: float | None = None


@dataclass(frozen=True)
class Admitted:
    request_id: str


@dataclass(frozen=True)
class Rejected:
    request_id: str
    reason: RejectReason
    message: str
    retry_after_s: float


@dataclass(frozen=True)
class Dispatch:
    """Send this request to the backend now."""

    request_id: str
    lane: str


@dataclass(frozen=True)
class Expired:
    """This request waited too long; answer it with an error."""

    request_id: str
    reason: ExpireReason


Decision = Dispatch | Expired


@dataclass(frozen=True)
class SchedulerStats:
    queued: int
    in_flight: int
    max_queued: int
    max_in_flight: int


class Scheduler(Protocol):
    """The seam every policy implements. All methods are called from one task only."""

    name: str

    def submit(self, request: Request, now: float) -> Admitted | Rejected:
        """Accept the request into the queue, or reject it at once."""
        ...

    def schedule(self, now: float) -> list[Decision]:
        """Requests to dispatch or expire now, in order."""
        ...

    def cancel(self, request_id: str, now: float) -> None:
        """Forget a request that left before finishing (queued or in flight)."""
        ...

    def on_done(self, request_id: str, now: float) -> None:
        """A dispatched request finished; its capacity is free again."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """The next time `schedule` could decide something without any new input."""
        ...

    def stats(self) -> SchedulerStats: ...
