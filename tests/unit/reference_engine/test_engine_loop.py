"""The engine loop's delivery rules, with a hand-driven model in place of torch.

The runner here is a test double of the model only: each step waits until the test lets it go,
so every interleaving below is exact, not timed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from reference_engine.batcher import Sampled, Work
from reference_engine.config import EngineConfig
from reference_engine.engine import Engine, EngineStats
from reference_engine.errors import EngineError
from reference_engine.request import EngineRequest, RowSpec, RunningSequence, Sampling

WAIT_S = 10.0


class SteppedRunner:
    """Emits token 100 + (tokens generated so far), one step per `allow()`."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)
        self.fail_next = False

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def step(self, works: tuple[Work, ...], tables: list[list[int]]) -> list[int]:
        assert self._permits.acquire(timeout=WAIT_S), "the test never allowed this step"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("simulated kernel failure")
        tokens = [100 + len(w.seq.generated) for w in works if w.emits]
        return Sampled(tokens, [None] * len(tokens))


@dataclass
class RecordingSink:
    messages: list[tuple[str, int, list[int], bool]] = field(default_factory=list)
    ends: dict[str, list[str]] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    changed: threading.Condition = field(default_factory=threading.Condition)
    stats: EngineStats | None = None
    broken: set[str] = field(default_factory=set)  # requests whose answers cannot be sent
    refused: list[tuple[str, str]] = field(default_factory=list)

    def _check(self, request: EngineRequest, what: str) -> None:
        if request.key in self.broken:
            with self.changed:
                self.refused.append((request.key, what))
                self.changed.notify_all()
            raise RuntimeError(f"the response sender of {request.key} is gone")

    def _end(self, key: str, how: str) -> None:
        self.ends.setdefault(key, []).append(how)

    def emit(
        self,
        request: EngineRequest,
        seq: RunningSequence,
        tokens: list[int],
        log_probs: list[float] | None,
        final: bool,
    ) -> None:
        self._check(request, "emit")
        with self.changed:
            self.messages.append((request.key, seq.row, tokens, final))
            if final:
                self._end(request.key, "final")
            self.changed.notify_all()

    def close(self, request: EngineRequest) -> None:
        with self.changed:
            self._end(request.key, "close")
            self.changed.notify_all()

    def fail(self, request: EngineRequest, error: EngineError) -> None:
        self._check(request, "fail")
        with self.changed:
            self._end(request.key, f"fail: {error}")
            self.changed.notify_all()

    def is_cancelled(self, request: EngineRequest) -> bool:
        if request.key == "unknowable":
            raise RuntimeError("cannot reach the server")
        return request.key in self.cancelled

    def publish(self, stats: EngineStats) -> None:
        with self.changed:
            self.stats = stats
            self.changed.notify_all()

    def wait_for(self, predicate: object) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=WAIT_S)  # type: ignore[arg-type]


@pytest.fixture
def loop() -> Iterator[tuple[Engine, SteppedRunner, RecordingSink]]:
    runner, sink = SteppedRunner(), RecordingSink()
    engine = Engine(EngineConfig(max_tokens_in_paged_kv_cache=1024), sink, lambda: runner)
    engine.start()
    yield engine, runner, sink
    runner.allow(1000)
    engine.shutdown()


def submit(engine: Engine, key: str, *rows: tuple[int, int], streaming: bool) -> None:
    specs = [RowSpec(tuple(range(5, 5 + n)), out, -1, 2) for n, out in rows]
    engine.submit(key, specs, streaming=streaming, sampling=Sampling(), handle=None)


def test_streaming_sends_every_token_and_one_final(
    loop: tuple[Engine, SteppedRunner, RecordingSink],
) -> None:
    engine, runner, sink = loop
    submit(engine, "s", (4, 3), streaming=True)
    runner.allow(3)
    sink.wait_for(lambda: "s" in sink.ends)
    assert sink.messages == [("s", 0, [100], False), ("s", 0, [101], False), ("s", 0, [102], True)]
    assert sink.ends == {"s": ["final"]}


def test_non_streaming_rows_answer_once_each(
    loop: tuple[Engine, SteppedRunner, RecordingSink],
) -> None:
    engine, runner, sink = loop
    submit(engine, "m", (4, 2), (6, 4), streaming=False)
    runner.allow(4)
    sink.wait_for(lambda: "m" in sink.ends)
    assert sink.messages == [("m", 0, [100, 101], False), ("m", 1, [100, 101, 102, 103], True)]


def test_stop_returns_what_was_made_and_frees_blocks(
    loop: tuple[Engine, SteppedRunner, RecordingSink],
) -> None:
    engine, runner, sink = loop
    submit(engine, "n", (4, 50), streaming=False)
    submit(engine, "t", (4, 50), streaming=True)
    runner.allow(2)
    sink.wait_for(lambda: len(sink.messages) == 2)  # "t" streamed two tokens
    engine.stop("n")
    engine.stop("t")
    runner.allow(1)
    sink.wait_for(lambda: {"n", "t"} <= set(sink.ends))
    assert ("n", 0, [100, 101], True) in sink.messages or (
        "n",
        0,
        [100, 101, 102],
        True,
    ) in sink.messages
    assert sink.ends == {"n": ["final"], "t": ["close"]}
    sink.wait_for(lambda: sink.stats is not None and sink.stats.kv_used_blocks == 0)


def test_a_client_that_goes_away_is_closed_once(
    loop: tuple[Engine, SteppedRunner, RecordingSink],
) -> None:
    engine, runner, sink = loop
    submit(engine, "c", (4, 50), streaming=True)
    runner.allow(1)
    sink.wait_for(lambda: len(sink.messages) == 1)
    sink.cancelled.add("c")
    runner.allow(1)
    sink.wait_for(lambda: "c" in sink.ends)
    runner.allow(5)
    submit(engine, "after", (4, 1), streaming=True)
    sink.wait_for(lambda: "after" in sink.ends)
    assert sink.ends["c"] == ["close"]


def test_a_failing_step_ends_every_request_once_and_the_loop_goes_on(
    loop: tuple[Engine, SteppedRunner, RecordingSink],
) -> None:
    engine, runner, sink = loop
    submit(engine, "a", (4, 5), streaming=True)
    submit(engine, "b", (4, 5), streaming=False)
    runner.fail_next = True
    runner.allow(1)
    sink.wait_for(lambda: {"a", "b"} <= set(sink.ends))
    assert all(
        ends == ["fail: engine step failed: RuntimeError('simulated kernel failure')"]
        for ends in sink.ends.values()
    )
    submit(engine, "next", (4, 1), streaming=False)
    runner.allow(1)
    sink.wait_for(lambda: "next" in sink.ends)
    assert sink.ends["next"] == ["final"]
    sink.wait_for(lambda: sink.stats is not None and sink.stats.kv_used_blocks == 0)


def test_a_request_that_cannot_be_answered_is_ended_and_the_others_go_on(
    loop: tuple[Engine, SteppedRunner, RecordingSink],
) -> None:
    engine, runner, sink = loop
    sink.broken.add("lost")
    submit(engine, "lost", (4, 50), streaming=True)
    submit(engine, "kept", (4, 3), streaming=True)
    runner.allow(3)
    sink.wait_for(lambda: "kept" in sink.ends)
    assert sink.ends == {"kept": ["final"]}
    assert sink.refused == [("lost", "emit")]  # asked once, then dropped
    assert [m for m in sink.messages if m[0] == "kept"] == [
        ("kept", 0, [100], False),
        ("kept", 0, [101], False),
        ("kept", 0, [102], True),
    ]
    sink.wait_for(
        lambda: (
            sink.stats is not None
            and sink.stats.kv_used_blocks == 0
            and sink.stats.active_requests == 0
        )
    )


def test_a_failing_loop_that_cannot_fail_its_requests_still_frees_them(
    loop: tuple[Engine, SteppedRunner, RecordingSink],
) -> None:
    engine, runner, sink = loop
    sink.broken.add("mute")
    submit(engine, "mute", (4, 5), streaming=False)
    runner.fail_next = True
    runner.allow(1)
    sink.wait_for(lambda: ("mute", "fail") in sink.refused)
    submit(engine, "next", (4, 1), streaming=False)
    runner.allow(1)
    sink.wait_for(lambda: "next" in sink.ends)
    assert sink.ends == {"next": ["final"]}
    sink.wait_for(lambda: sink.stats is not None and sink.stats.kv_used_blocks == 0)


def test_a_request_whose_client_cannot_be_asked_about_is_ended(
    loop: tuple[Engine, SteppedRunner, RecordingSink],
) -> None:
    engine, _runner, sink = loop
    submit(engine, "unknowable", (4, 50), streaming=True)
    sink.wait_for(lambda: "unknowable" in sink.ends)
    assert sink.ends["unknowable"] == ["close"]
    sink.wait_for(lambda: sink.stats is not None and sink.stats.kv_used_blocks == 0)
