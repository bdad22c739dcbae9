"""Virtual time for the shell's unit tests: an asyncio event loop whose clock jumps to its next
timer whenever nothing is ready, so timeouts, deadlines and the core loop's timers fire in
order at once and no test waits in real time.

The sidecar times everything on the event loop's clock (`CoreLoop`'s default clock is the
running loop's `time()`, which in production is `time.monotonic()`), so running a test on this
loop moves the core's `now`, the service's deadlines and asyncio's own timeouts together.

While work handed to threads runs (long prompts are tokenized off the loop), the clock follows
real time: the loop waits for the thread as a real one would, and timers due meanwhile fire as
they would in production. Libraries that do I/O on threads of their own (gRPC's core) are not
seen here; tests of them run on a real loop.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")

_THREAD_POLL_S = 0.05  # how long, in real time, one wait for a busy thread may block


class _JumpingSelector(selectors.DefaultSelector):
    """With nothing ready and no thread busy, moves the clock to the next timer at once."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self._loop.threads_busy:
            # A thread's result wakes the loop through its self-pipe; meanwhile time is real.
            wait = _THREAD_POLL_S if timeout is None else min(timeout, _THREAD_POLL_S)
            began = time.monotonic()
            ready = super().select(wait)
            self._loop.advance(time.monotonic() - began)
            return ready
        ready = super().select(0)
        if not ready and timeout is not None and timeout > 0:
            self._loop.advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at `start`."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self.threads_busy = 0  # executor jobs not yet done
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def run_in_executor(  # type: ignore[override]  # the variadic generics, spelled simply
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.threads_busy += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: asyncio.Future[Any]) -> None:
        self.threads_busy -= 1


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, on virtual time."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
