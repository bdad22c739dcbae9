"""The virtual-time event loop the shell's unit tests run on."""

from __future__ import annotations

import asyncio
import threading
import time

from scheduler_svc.serving.loop import event_loop_time
from scheduler_svc.testing.clock import run_virtual


def test_timers_fire_in_order_without_waiting_in_real_time() -> None:
    fired: list[tuple[str, float]] = []

    async def main() -> float:
        start = event_loop_time()

        async def after(name: str, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            fired.append((name, event_loop_time() - start))

        await asyncio.gather(after("late", 30.0), after("early", 5.0))
        try:
            async with asyncio.timeout(60.0):
                await asyncio.Event().wait()  # never set: only the timeout ends it
        except TimeoutError:
            pass
        return event_loop_time() - start

    began = time.monotonic()
    elapsed = run_virtual(main())
    assert time.monotonic() - began < 5.0  # 90 virtual seconds, far fewer real ones
    assert [name for name, _ in fired] == ["early", "late"]
    assert [round(at, 3) for _, at in fired] == [5.0, 30.0]
    assert round(elapsed, 3) == 90.0


def test_while_a_thread_works_the_clock_follows_real_time() -> None:
    release = threading.Event()

    async def main() -> tuple[bool, float]:
        start = event_loop_time()
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(None, release.wait, 10.0)
        # A timer due long after the thread's work: it must not fire before the work is done.
        late = asyncio.ensure_future(asyncio.sleep(3600.0))
        threading.Timer(0.2, release.set).start()
        done = await work
        fired_early = late.done()
        late.cancel()
        return done and not fired_early, event_loop_time() - start

    ok, elapsed = run_virtual(main())
    assert ok  # the thread finished before the hour-long timer
    assert 0.15 <= elapsed < 60.0  # about the thread's real 0.2 s, not the timer's hour
