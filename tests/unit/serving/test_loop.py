"""The core loop and its batch runners with the real policy core and a scripted backend.

These are unit tests of the shell: the backend is `scheduler_svc.testing.ScriptedBackend`, never
the proof that a feature works against Triton (tests/integration/ run the real one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

from scheduler_svc.core.config import PolicyConfig, default_lanes
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.types import Dispatch, Expired, ExpireReason, Request, Target
from scheduler_svc.errors import BackendFailedError, BackendUnavailableError
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.loop import CoreLoop, Ticket
from scheduler_svc.serving.rows import BatchJob, RowRunner, StaticRunner
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.clock import run_virtual
from scheduler_svc.testing.waiting import until

STATIC = EngineProfile(Batching.STATIC, max_batch_size=64)
# Lanes that never time out or age here, and buckets that wait 20 ms to fill.
LANES = tuple(
    replace(lane, queue_timeout_s=None, max_wait_s=None, batch_timeout_s=0.02)
    for lane in default_lanes()
)


def policy(static: bool) -> PolicyScheduler:
    return PolicyScheduler(
        PolicyConfig(
            lanes=LANES,
            continuous_batching=not static,
            max_batches_in_flight=1 if static else None,
        )
    )


def row(rid: str, prompt: int, max_tokens: int = 4) -> GenerationInput:
    return GenerationInput(rid, tuple(range(3, 3 + prompt)), max_tokens, end_id=1, pad_id=2)


async def submit(loop: CoreLoop, rid: str, prompt: int, max_tokens: int = 4) -> Ticket:
    return await loop.submit(Request(rid, prompt, max_tokens), row(rid, prompt, max_tokens), None)


async def read(ticket: Ticket) -> list[int]:
    decision = await ticket.decision
    assert isinstance(decision, Dispatch)
    out: list[int] = []
    async for tokens in ticket.channel.tokens():
        out += tokens.ids
    return out


def run(
    static: bool, backend: ScriptedBackend, body: Callable[[CoreLoop], Awaitable[None]]
) -> None:
    async def main() -> None:
        loop = CoreLoop(policy(static))
        runner = (StaticRunner if static else RowRunner)(backend, loop)
        loop.set_runners({Target.PRIMARY: runner})
        loop.start()
        try:
            await body(loop)
        finally:
            await loop.close()

    run_virtual(main())  # virtual time: the 20 ms batch timers pass without waiting


def test_a_static_engine_gets_each_released_batch_as_one_request_one_at_a_time() -> None:
    backend = ScriptedBackend(STATIC)

    async def body(loop: CoreLoop) -> None:
        backend.hold()
        first = [await submit(loop, f"a{i}", 100) for i in range(3)]
        await until(lambda: len(backend.calls) == 1, "the first bucket reaches the engine")
        # While the engine runs it, two more buckets form (lengths 8:1 apart) and wait.
        short = [await submit(loop, f"s{i}", 20) for i in range(2)]
        long = [await submit(loop, f"l{i}", 160) for i in range(2)]
        await asyncio.sleep(0.05)  # 50 virtual ms, past the 20 ms batch timeout: both are ready
        assert loop.scheduler.lanes["hot"].head() is not None  # type: ignore[attr-defined]
        assert len(backend.calls) == 1 and loop.stats().queued == 4
        backend.release()
        answers = await asyncio.gather(*(read(t) for t in first + short + long))
        assert all(a == [100, 101, 102, 103] for a in answers)
        await until(lambda: loop.stats().in_flight == 0, "every row is done in the core")
        assert backend.max_active == 1  # never two batches in the engine at once
        rows = [sorted(len(r.prompt_ids) for r in call.rows) for call in backend.calls]
        assert rows[0] == [100, 100, 100]
        assert sorted(rows[1:]) == [[20, 20], [160, 160]]  # each engine batch one bucket
        assert all(call.finished for call in backend.calls)

    run(True, backend, body)


def test_an_in_flight_engine_gets_one_stream_per_row_at_once() -> None:
    backend = ScriptedBackend()

    async def body(loop: CoreLoop) -> None:
        backend.hold()
        tickets = [await submit(loop, f"r{i}", 40 + 30 * i) for i in range(4)]
        await until(lambda: len(backend.calls) == 4, "every row reaches the engine")
        assert all(len(call.rows) == 1 for call in backend.calls)
        backend.release()
        answers = await asyncio.gather(*(read(t) for t in tickets))
        assert all(len(a) == 4 for a in answers)

    run(False, backend, body)


def test_a_row_ends_at_its_end_id_while_its_batch_runs_on() -> None:
    backend = ScriptedBackend(STATIC, ends_after={"early": 1})

    async def body(loop: CoreLoop) -> None:
        backend.hold()
        early = await submit(loop, "early", 50, max_tokens=6)
        late = await submit(loop, "late", 50, max_tokens=6)
        await until(lambda: len(backend.calls) == 1, "the batch starts")
        backend.release()
        assert await read(early) == [100, 1]
        assert await read(late) == [100, 101, 102, 103, 104, 105]
        await until(lambda: loop.stats().in_flight == 0, "both rows are done")

    run(True, backend, body)


def test_a_reader_that_leaves_stops_its_row_and_a_queued_one_is_cancelled() -> None:
    backend = ScriptedBackend()

    async def body(loop: CoreLoop) -> None:
        backend.hold()
        running = await submit(loop, "running", 50)
        await until(lambda: len(backend.calls) == 1, "the row runs")
        loop.leave(running)  # the client went away mid-answer
        await until(lambda: backend.calls[0].stopped, "the engine request is stopped")
        await until(lambda: loop.stats().in_flight == 0, "the core freed its row")
        backend.release()

    run(False, backend, body)

    backend = ScriptedBackend(STATIC)

    async def queued(loop: CoreLoop) -> None:
        backend.hold()
        await submit(loop, "busy", 50)
        await until(lambda: len(backend.calls) == 1, "the engine is busy")
        waiting = await submit(loop, "waiting", 50)
        await until(lambda: loop.stats().queued == 1, "the second request waits")
        loop.leave(waiting)
        await until(lambda: loop.stats().queued == 0, "the core forgot it")
        assert waiting.decision.cancelled()
        backend.release()

    run(True, backend, queued)


def test_every_member_of_a_static_batch_whose_request_fails_gets_the_error() -> None:
    backend = ScriptedBackend(STATIC, fail_with=BackendFailedError("engine died"))

    async def body(loop: CoreLoop) -> None:
        tickets = [await submit(loop, f"m{i}", 60) for i in range(3)]
        results = await asyncio.gather(*(read(t) for t in tickets), return_exceptions=True)
        assert [type(r) for r in results] == [BackendFailedError] * 3
        await until(lambda: loop.stats().in_flight == 0, "the reservations are freed")
        assert loop.scheduler.stats().kv is not None
        assert loop.scheduler.stats().kv.reserved_blocks == 0

    run(True, backend, body)


def test_a_target_without_a_backend_ends_its_rows_unavailable() -> None:
    async def main() -> None:
        loop = CoreLoop(policy(False))  # no runners at all
        loop.start()
        try:
            ticket = await submit(loop, "r", 20)
            try:
                await read(ticket)
            except BackendUnavailableError as exc:
                assert "primary" in str(exc)
            else:
                raise AssertionError("expected BackendUnavailableError")
            await until(lambda: loop.stats().in_flight == 0, "the core freed the row")
        finally:
            await loop.close()

    asyncio.run(main())


def test_leaked_reservations_are_reclaimed_and_counted() -> None:
    async def main() -> None:
        scheduler = policy(False)
        loop = CoreLoop(scheduler)
        loop.start()
        try:
            backend = ScriptedBackend()
            backend.hold()
            loop.set_runners({Target.PRIMARY: RowRunner(backend, loop)})
            tickets = [await submit(loop, f"r{i}", 100) for i in range(2)]
            await until(lambda: len(scheduler.mirror.held()) == 2, "both rows hold blocks")
            loop._tickets.pop("r1")  # a request that vanished without a word: a leak
            reclaimed = await loop.call(lambda _s, now: loop.reclaim_leaks(now))
            assert reclaimed == 1 and set(scheduler.mirror.held()) == {"r0"}
            assert loop.leaked == 1 and loop.metrics.leaked._value.get() == 1
            backend.release()
            assert len(await read(tickets[0])) == 4
        finally:
            await loop.close()

    asyncio.run(main())


class Recording(PolicyScheduler):
    """The policy, recording the progress reports it gets."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.reports: list[tuple[str, int]] = []

    def on_progress(self, request_id: str, output_tokens: int, now: float) -> None:
        self.reports.append((request_id, output_tokens))
        super().on_progress(request_id, output_tokens, now)


def test_progress_and_the_output_length_reach_the_core() -> None:
    async def main() -> None:
        scheduler = Recording(PolicyConfig(lanes=LANES, continuous_batching=True))
        loop = CoreLoop(scheduler)
        backend = ScriptedBackend()
        loop.set_runners({Target.PRIMARY: RowRunner(backend, loop)})
        loop.start()
        try:
            ticket = await submit(loop, "r", 100, max_tokens=40)
            assert len(await read(ticket)) == 40
            await until(lambda: loop.stats().in_flight == 0, "the row is done")
            # The first token, then every PROGRESS_EVERY_TOKENS (4), its 40th and last included.
            assert scheduler.reports == [("r", 1)] + [("r", n) for n in range(4, 41, 4)]
            assert scheduler.predictor.samples("", "hot") == 1  # its output length was learnt
            assert scheduler.mirror.held() == {}
        finally:
            await loop.close()

    asyncio.run(main())


def test_a_late_leave_never_touches_a_later_request_with_the_same_id() -> None:
    """Found by `scheduler-svc chaos`: a client reusing a request id saw its second request
    cancelled (and never answered) by the first one's late leave."""
    backend = ScriptedBackend(EngineProfile(Batching.STATIC, 8))

    async def body(loop: CoreLoop) -> None:
        first = await submit(loop, "x", 10)
        assert len(await read(first)) == 4  # ran to its end; its handler has not left yet
        await until(lambda: loop.stats().in_flight == 0, "the first row is done")
        backend.hold()
        busy = await submit(loop, "busy", 10)  # the engine's one batch
        await until(lambda: loop.stats().in_flight == 1, "the engine is busy")
        second = await submit(loop, "x", 10)  # same id, queued behind it
        loop.leave(first)  # the first handler leaves only now
        backend.release()
        assert len(await read(busy)) == 4
        assert len(await read(second)) == 4  # served, not cancelled
        loop.leave(busy)
        loop.leave(second)

    run(True, backend, body)


class HeldRunner:
    """A runner whose rows never end: what it was given stays running."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def start(self, job: BatchJob) -> None:
        self.started += [r.request_id for r in job.rows]

    async def close(self) -> None:
        return None


def test_deadlines_come_from_the_injected_clock_without_sleeping() -> None:
    """The loop feeds the core its own clock: on a fake clock an idle loop dispatches at once
    (the fast path), and a hot request behind the engine's one busy sequence is answered at
    hot's 250 ms target when the fake clock gets there, not before, with no real time passing."""

    async def main() -> None:
        now = [100.0]
        scheduler = PolicyScheduler(
            PolicyConfig(kv=replace(PolicyConfig().kv, max_in_flight=1), continuous_batching=True)
        )
        loop = CoreLoop(scheduler, clock=lambda: now[0])
        held = HeldRunner()
        loop.set_runners({Target.PRIMARY: held})
        loop.start()
        try:
            long = await submit(loop, "long", 2000)
            assert isinstance(await long.decision, Dispatch) and held.started == ["long"]
            hot = await submit(loop, "hot", 20)
            now[0] = 100.249
            await loop.call(lambda s, t: None)  # a turn of the loop at the new time
            assert not hot.decision.done()
            now[0] = 100.25
            await loop.call(lambda s, t: None)
            decision = await hot.decision
            assert isinstance(decision, Expired)
            assert decision.reason is ExpireReason.MISSED_TARGET
            assert held.started == ["long"]
        finally:
            await loop.close()

    asyncio.run(main())
