"""The scheduler seam's inputs and outputs: frozen, plain data."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Protocol


class Urgency(IntEnum):
    """How soon a request wants service; lower sorts first.

    The one name inside the sidecar for what each wire spells its own way: scheduler.v1's
    `priority`, the OpenAI body's vLLM-style `priority`, llm-d's objective header (mapped by
    `http.objectives`) and KServe's `priority` parameter all become an `Urgency`, and
    `queue.priority_lanes` pins a lane per urgency. The wire and config names stay: they are
    the protocols' and users' words."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


class RejectReason(StrEnum):
    """Why a request was refused at submission; the values double as metric labels."""

    QUEUE_FULL = "queue_full"
    DUPLICATE = "duplicate_request_id"
    TOO_LARGE = "too_large"
    UNKNOWN_LANE = "unknown_lane"
    # Its lane's learned drain rate says it could not start within the time the lane allows
    # (or before the request's own deadline): refused at once instead of late.
    PREDICTED_LATE = "predicted_late"


class ExpireReason(StrEnum):
    """Why a queued request was answered with an error instead of being dispatched."""

    QUEUE_TIMEOUT = "queue_timeout"
    NO_FALLBACK = "hot_timeout_no_fallback"
    # In deadline order (an in-flight engine): past its lane's TTFT target with no fallback
    # backend and no shorter answer; answered now rather than served late from a lower lane.
    MISSED_TARGET = "missed_target"
    REQUEUE_LIMIT = "requeue_limit"
    # Past its lane's timeout, and the lower lane it would join could not start it in time.
    PREDICTED_LATE = "predicted_late"
    # Its lane was full and a tenant under its fair share arrived: the newest request of the
    # tenant furthest over its share made room (fairness.enabled).
    PUSHED_OUT = "pushed_out"


class Target(StrEnum):
    """Which backend a dispatch goes to; the shell maps each to a configured endpoint."""

    PRIMARY = "primary"
    DEGRADE = "degrade"
    ELASTIC = "elastic"


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
    # A lane the client pinned (by priority hint); None lets the policy pick by length.
    lane: str | None = None
    # Leading prompt tokens the shell expects the engine to find in its KV cache (blocks it
    # shares with requests it holds or served lately); the KV mirror reserves the rest. 0 when
    # the engine does not reuse KV blocks or nothing is known.
    cached_tokens: int = 0


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
class BatchInfo:
    """One released batch, shared by the `Dispatch` of each of its rows."""

    batch_id: int
    lane: str
    target: Target
    max_batch: int
    prompt_tokens: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.prompt_tokens)

    @property
    def padding_ratio(self) -> float:
        """Share of a padded [rows x longest prompt] input that is padding."""
        longest = max(self.prompt_tokens)
        return 1.0 - sum(self.prompt_tokens) / (longest * self.size) if longest else 0.0

    @property
    def utilization(self) -> float:
        """Rows over the lane's max batch."""
        return self.size / self.max_batch


@dataclass(frozen=True)
class Dispatch:
    """Send this request to the backend now (as a row of `batch`, where there is one)."""

    request_id: str
    lane: str
    batch: BatchInfo | None = None
    target: Target = Target.PRIMARY
    # The request's max_tokens after any degrade; None leaves it as submitted.
    max_tokens: int | None = None


@dataclass(frozen=True)
class Expired:
    """This request waited too long; answer it with an error."""

    request_id: str
    reason: ExpireReason
    lane: str = ""
    # When a retry could start, as the lane's drain rate predicts; None: no prediction.
    retry_after_s: float | None = None


Decision = Dispatch | Expired


class StepFailedError(Exception):
    """`schedule()` failed part-way. `decisions` are those it made before the failure: their
    state changes are complete (each batch is released whole or not at all), so the caller
    must act on them. The cause is chained (`__cause__`)."""

    def __init__(self, decisions: list[Decision]) -> None:
        super().__init__(f"schedule() failed after {len(decisions)} decisions")
        self.decisions = decisions


@dataclass(frozen=True)
class LaneStats:
    name: str
    queued: int
    max_queued: int
    oldest_wait_s: float
    # The lane's declared bound on waiting before promotion (aging); None: no bound.
    max_wait_s: float | None
    # What an arrival now would wait, from the lane's learned drain rate; None: not learned.
    predicted_wait_s: float | None = None
    # The lane's learned drain rate (prompt + output tokens per busy second); None: not yet.
    drain_tokens_per_s: float | None = None


@dataclass(frozen=True)
class KvStats:
    total_blocks: int
    free_blocks: int
    reserved_blocks: int
    external_blocks: int
    tokens_per_block: int
    fragmentation: float
    stale: bool
    reserve_blocks: int = 0  # what new admissions leave free while others hold blocks
    owed_blocks: int = 0  # outgrown into but not yet free: admissions wait while > 0


@dataclass(frozen=True)
class SchedulerStats:
    queued: int
    in_flight: int
    max_queued: int
    max_in_flight: int
    lanes: tuple[LaneStats, ...] = ()
    kv: KvStats | None = None
    breaker_open: bool = False
    # Cumulative event counts by name (rejected_*, degraded, demoted, requeued, promoted, ...).
    counters: tuple[tuple[str, int], ...] = ()
    # Released primary batches with a member still running (the policy's engine slots).
    batches_in_flight: int = 0


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

    def on_done(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        """A dispatched request finished (having produced `output_tokens`, where known)."""
        ...

    def on_progress(self, request_id: str, output_tokens: int, now: float) -> None:
        """A dispatched request has produced `output_tokens` so far."""
        ...

    def observe_kv(self, free_blocks: int, total_blocks: int, now: float) -> None:
        """The backend's own count of its paged KV blocks (from its metrics)."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """The next time `schedule` could decide something without any new input."""
        ...

    def stats(self) -> SchedulerStats: ...
