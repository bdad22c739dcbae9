"""What every front shows alike: text held until it shows, and a bug answered with its id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog

from scheduler_svc.contracts.generation import Delta, Final, Finish
from scheduler_svc.errors import InternalError
from scheduler_svc.serving.fronts.presentation import (
    Ending,
    logged_internal_error,
    shown_pieces,
)
from scheduler_svc.serving.metrics import SidecarMetrics
from scheduler_svc.serving.service import final_of

FINAL = Final("r", "héllo", (1, 2, 3, 4), Finish.LENGTH, 2, 4, 0.0, 1.0, 2.0, "hot", None)


async def _events(*items: Delta | Final) -> AsyncIterator[Delta | Final]:
    for item in items:
        yield item


def _pieces(*items: Delta | Final, shows: Any = None) -> list[Delta | Ending]:
    async def main() -> list[Delta | Ending]:
        pieces = (
            shown_pieces(_events(*items)) if shows is None else shown_pieces(_events(*items), shows)
        )
        return [piece async for piece in pieces]

    return asyncio.run(main())


def test_ids_without_text_ride_with_the_next_piece_and_every_log_probability_goes_once() -> None:
    pieces = _pieces(
        Delta("h", (1,), (-0.1,)),
        Delta("", (2,), (-0.2,)),  # half a character: no text yet
        Delta("é", (3,), (-0.3,)),
        Delta("", (4,), (-0.4,)),  # never completed
        FINAL,
    )
    assert pieces == [
        Delta("h", (1,), (-0.1,)),
        Delta("é", (2, 3), (-0.2, -0.3)),
        Ending(Delta("", (4,), (-0.4,)), FINAL),
    ]


def test_a_front_chooses_what_shows_and_an_answer_without_an_end_is_a_bug() -> None:
    ids_show = _pieces(Delta("", (1,)), FINAL, shows=lambda d: bool(d.token_ids))
    assert ids_show == [Delta("", (1,)), Ending(Delta(), FINAL)]
    with pytest.raises(InternalError, match="without a final answer"):
        _pieces(Delta("a", (1,)))
    assert asyncio.run(final_of(_events(Delta("a", (1,)), FINAL))) is FINAL


def test_a_bug_is_logged_counted_and_answered_with_its_id() -> None:
    metrics = SidecarMetrics()
    with structlog.testing.capture_logs() as logs:
        error = logged_internal_error(
            structlog.get_logger("t"), ValueError("boom"), metrics, "Generate", method="Generate"
        )
    [entry] = logs
    assert entry["event"] == "internal error" and entry["error_id"] in str(error)
    assert str(error).endswith("(logged by the sidecar)")
    count = metrics.registry.get_sample_value(
        "scheduler_svc_internal_errors_total", {"method": "Generate"}
    )
    assert count == 1
