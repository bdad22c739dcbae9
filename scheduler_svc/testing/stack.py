"""The shell's request path wired over a backend, for unit tests: a core loop with the policy the
config makes, the batch runner the backend's engine profile chooses, and the service."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from scheduler_svc.config import SidecarConfig
from scheduler_svc.contracts.generation import Delta, Final, GenerationParams
from scheduler_svc.core.types import Target
from scheduler_svc.serving.app import make_scheduler
from scheduler_svc.serving.backends.base import Backend
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.rows import runner_for
from scheduler_svc.serving.service import GenerationService
from scheduler_svc.serving.tokenizer import load_tokenizer
from scheduler_svc.testing.clock import run_virtual

TOKENIZER = load_tokenizer()  # the packaged one, loaded once for every test


def serve(
    backend: Backend,
    body: Callable[[GenerationService, CoreLoop], Awaitable[None]],
    config: dict[str, Any] | None = None,
    virtual_time: bool = True,
) -> None:
    """Run `body` against a ready service over `backend` (config: the sidecar's, as a mapping),
    then close the loop and the service. On virtual time (scheduler_svc/testing/clock.py)
    unless `virtual_time` is False: tests of a front whose library does I/O on threads of its
    own (gRPC) run in real time."""
    cfg = SidecarConfig.model_validate(config or {})

    async def main() -> None:
        loop = CoreLoop(make_scheduler(cfg))
        engine = await backend.profile()
        stall = cfg.triton.stall_timeout_s
        loop.set_runners({Target.PRIMARY: runner_for(engine, backend, loop, stall)})
        loop.start()
        service = GenerationService(cfg, TOKENIZER, loop)
        service.backend_ready = True
        try:
            await body(service, loop)
        finally:
            await loop.close()
            service.close()

    if virtual_time:
        run_virtual(main())
    else:
        asyncio.run(main())


async def collect(service: GenerationService, params: GenerationParams) -> list[Delta | Final]:
    """Every event of one request, its final answer last."""
    return [event async for event in service.generate(params)]


def record_tokenizing(service: GenerationService, seen: list[str]) -> None:
    """Record the name of the thread each of `service`'s prompts is tokenized on."""
    encode = service._encode

    def recorded(text: str) -> tuple[int, ...]:
        seen.append(threading.current_thread().name)
        return encode(text)

    service._encode = recorded  # type: ignore[method-assign]
