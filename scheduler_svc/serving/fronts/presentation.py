"""What every front does alike with an answer: pieces of text shown only once they show
something, and a bug answered with an error id that points into the log."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from scheduler_svc.contracts.generation import Delta, Final
from scheduler_svc.errors import InternalError
from scheduler_svc.serving.metrics import SidecarMetrics


@dataclass(frozen=True)
class Ending:
    """A request's end: its final answer, and what was still held back (ids whose text never
    came; their log probabilities are still due)."""

    leftover: Delta
    final: Final


def has_text(piece: Delta) -> bool:
    return bool(piece.text)


async def shown_pieces(
    events: AsyncIterator[Delta | Final], shows: Callable[[Delta], bool] = has_text
) -> AsyncIterator[Delta | Ending]:
    """The request's deltas, each held back and joined to the next until it `shows` something
    (text, by default: a token whose text is not complete yet rides with the next), then its
    `Ending`; every token and log probability goes out exactly once."""
    carry = Delta()
    async for event in events:
        if isinstance(event, Final):
            yield Ending(carry, event)
            return
        piece = carry + event
        if shows(piece):
            yield piece
            carry = Delta()
        else:
            carry = piece
    raise InternalError("generation ended without a final answer")


def logged_internal_error(
    log: Any, exc: BaseException, metrics: SidecarMetrics, where: str, **context: object
) -> InternalError:
    """A bug, logged with a fresh error id and counted under `where`: the error to answer with,
    naming the id so an operator can find the log line."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error", error_id=error_id, exc_info=exc, **context)
    metrics.internal_errors.labels(where).inc()
    return InternalError(f"internal error {error_id} (logged by the sidecar)")
