"""`ScriptedBackend`: a `Backend` whose engine is a script, for unit tests of the shell.

It reports the profile it was given and answers every request row with `max_tokens` ids
(`first_id`, `first_id + 1`, ...), or fewer ending with the row's end id where `ends_after`
says so. It records what reached it: each engine request with its rows, how many ran at once,
which were stopped before their end. A test holds the engine busy with `hold()` / `release()`
(requests wait at their start until released) and makes it fail with `fail_with`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.serving.backends.base import GenerationInput, Tokens


@dataclass
class EngineCall:
    """One engine request as the backend received it."""

    request_id: str
    rows: list[GenerationInput]
    finished: bool = False
    stopped: bool = False


@dataclass
class ScriptedBackend:
    engine: EngineProfile = field(
        default_factory=lambda: EngineProfile(Batching.INFLIGHT, max_batch_size=64)
    )
    first_id: int = 100
    engine_model: str = "tensorrt_llm"
    ends_after: dict[str, int] = field(default_factory=dict)  # request id -> ids before its end
    fail_with: Exception | None = None
    is_ready: bool = True
    kv: tuple[int, int] | None = None
    calls: list[EngineCall] = field(default_factory=list)
    active: int = 0
    max_active: int = 0

    def __post_init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        """Requests that start from now on wait until `release`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ready(self) -> bool:
        return self.is_ready

    async def health(self) -> list[tuple[str, bool]]:
        return [("scripted", self.is_ready)]

    async def profile(self) -> EngineProfile:
        return self.engine

    async def read_kv(self) -> tuple[int, int] | None:
        return self.kv

    def _answer(self, row: GenerationInput) -> list[list[int]]:
        """The row's answer, one id per response."""
        n = self.ends_after.get(row.request_id)
        if n is None or n >= row.max_tokens:
            return [[self.first_id + i] for i in range(row.max_tokens)]
        return [[self.first_id + i] for i in range(n)] + [[row.end_id]]

    async def stream(self, request: GenerationInput) -> AsyncGenerator[Tokens, None]:
        async for _, tokens in self._run(EngineCall(request.request_id, [request])):
            yield tokens

    async def stream_batch(
        self, request_id: str, rows: list[GenerationInput], timeout_s: float | None
    ) -> AsyncGenerator[tuple[int, Tokens], None]:
        async for index, tokens in self._run(EngineCall(request_id, list(rows))):
            yield index, tokens

    async def _run(self, call: EngineCall) -> AsyncGenerator[tuple[int, Tokens], None]:
        self.calls.append(call)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self._open.wait()
            if self.fail_with is not None:
                raise self.fail_with
            answers = [self._answer(row) for row in call.rows]
            # Lockstep, as an engine step gives every row its next id.
            steps = max(len(a) for a in answers)
            for step in range(steps):
                rows = [index for index, answer in enumerate(answers) if step < len(answer)]
                for index in rows:
                    ids = answers[index][step]
                    # A scripted log probability per id, where the row asks: -1 / (its
                    # position + 1), so a test can tell them apart and in order.
                    probs = [-1.0 / (step + 1)] * len(ids)
                    asked = call.rows[index].return_log_probs
                    # Triton's final flag rides on the request's last response only.
                    last = step == steps - 1 and index == rows[-1]
                    yield index, Tokens(ids, probs if asked else None, last)
                await asyncio.sleep(0)  # one engine step: let the readers run
            call.finished = True
        finally:
            call.stopped = not call.finished
            self.active -= 1
