"""Limits before work: oversized fields and numbers the engine cannot take are refused before
any work, and long prompts are tokenized off the event loop."""

from __future__ import annotations

import threading

import pytest

from scheduler_svc.contracts.generation import Final, GenerationParams
from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.errors import (
    BadRequestError,
)
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.service import INLINE_PROMPT_CHARS, GenerationService
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.stack import collect, record_tokenizing, serve

# -- limits before work ---------------------------------------------------------------------


def test_oversized_fields_are_refused_before_any_work() -> None:
    encoded: list[str] = []

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        record_tokenizing(service, encoded)
        limit = service.cfg.model.prompt_bytes_limit
        cases = [
            (GenerationParams("r", prompt="x" * (limit + 1)), "prompt: more than"),
            (GenerationParams("r", prompt="é" * (limit // 2 + 1)), "prompt: more than"),
            (GenerationParams("r", prompt="hi", tenant="t" * 1_000_000), "tenant: 1000000"),
            (GenerationParams("r" * 10_000, prompt="hi"), "request_id: 10000"),
            (GenerationParams("r", token_ids=(5,) * 5000), "prompt: 5000 tokens"),
        ]
        for params, needle in cases:
            with pytest.raises(BadRequestError, match=needle) as caught:
                await collect(service, params)
            assert len(str(caught.value)) < 200  # the error echoes bounded text only
        assert encoded == [] and loop.accepted == 0

    serve(ScriptedBackend(), body)


def test_numbers_the_engine_cannot_take_are_refused_by_name() -> None:
    """Values that fit Python but not the engine's 32-bit tensors: refused here, one request at
    a time, never cast and sent (where, batched, they failed every row beside them)."""

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        vocab = service.vocab_size
        cases = [
            (
                GenerationParams("r", prompt="hi", sampling=Sampling(temperature=1e39)),
                "temperature: 1e",
            ),
            (
                GenerationParams("r", prompt="hi", sampling=Sampling(top_k=2**40)),
                f"top_k: {2**40} is outside",
            ),
            (GenerationParams("r", prompt="hi", sampling=Sampling(top_k=vocab + 1)), f"0..{vocab}"),
            (GenerationParams("r", prompt="hi", sampling=Sampling(seed=2**64)), "seed: "),
            (
                GenerationParams("r", prompt="hi", sampling=Sampling(presence_penalty=-1e39)),
                "presence_penalty",
            ),
            (
                GenerationParams("r", prompt="hi", sampling=Sampling(frequency_penalty=4e38)),
                "frequency_penalty",
            ),
            (
                GenerationParams("r", prompt="hi", sampling=Sampling(repetition_penalty=1e-50)),
                "repetition_penalty",
            ),
        ]
        for params, needle in cases:
            with pytest.raises(BadRequestError, match=needle):
                await collect(service, params)
        assert loop.accepted == 0
        ok = GenerationParams(
            "r", prompt="hi", max_tokens=2, sampling=Sampling(temperature=1.0, top_k=vocab)
        )
        assert isinstance((await collect(service, ok))[-1], Final)

    serve(ScriptedBackend(), body)


def test_long_prompts_are_tokenized_off_the_event_loop_short_ones_on_it() -> None:
    threads: list[str] = []
    long_prompt = "hello there " * (INLINE_PROMPT_CHARS // 12 + 1)

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        record_tokenizing(service, threads)
        await collect(service, GenerationParams("r", prompt=long_prompt, max_tokens=2))
        await collect(service, GenerationParams("s", prompt="hello there", max_tokens=2))

    serve(ScriptedBackend(), body)
    assert len(threads) == 2
    assert threads[0].startswith("tokenize")  # longer than INLINE_PROMPT_CHARS: on a thread
    assert threads[1] == threading.main_thread().name  # short: the hop would cost more
