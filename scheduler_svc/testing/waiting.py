"""Waiting in a test of the shell: let the event loop run until something holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(
    check: Callable[[], bool], what: str = "the condition", timeout_s: float = 5.0
) -> None:
    """Let the loop's tasks run (a millisecond a turn) until `check` holds; AssertionError
    naming `what` after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            while not check():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"never happened within {timeout_s} s: {what}") from None
