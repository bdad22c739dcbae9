"""Tenant quotas: concurrency and token rate, charged to the parent of a narrowed tenant,
checked before the prompt is tokenized, refused with a retry hint."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.contracts.generation import Final, GenerationParams
from scheduler_svc.core.quota import Limits, TenantQuotas
from scheduler_svc.errors import (
    BadRequestError,
    QuotaExceededError,
)
from scheduler_svc.serving import auth
from scheduler_svc.serving.auth import Principal
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.service import PREFIX_CHARS_PER_TOKEN, GenerationService
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.stack import collect, record_tokenizing, serve
from scheduler_svc.testing.waiting import until

# -- quotas ---------------------------------------------------------------------------------


def test_tenant_quotas_bound_concurrency_and_token_rate() -> None:
    quotas = TenantQuotas(Limits(max_concurrent=2), {"b": Limits(tokens_per_s=100)}, 2)
    assert quotas.take("a", 10, 0.0) is None and quotas.take("a", 10, 0.0) is None
    refusal = quotas.take("a", 10, 0.0)
    assert refusal is not None and refusal.quota == "concurrent"
    quotas.give_back("a")
    assert quotas.take("a", 10, 0.0) is None
    # b: a bucket of 1000 tokens refilled at 100/s
    assert quotas.take("b", 900, 0.0) is None
    refusal = quotas.take("b", 300, 0.0)
    assert refusal is not None and refusal.quota == "tokens"
    assert refusal.retry_after_s == pytest.approx(2.0)
    assert quotas.take("b", 300, 2.0) is None
    huge = quotas.take("b", 5000, 100.0)
    assert huge is not None and "can ever hold" in huge.message
    for i in range(100):  # idle tenants are forgotten beyond max_tenants; busy ones stay
        quotas.take(f"t{i}", 1, 3.0)
        quotas.give_back(f"t{i}")
    assert quotas.tracked <= 3 and quotas._state["a"].active == 2


def test_a_narrowed_tenant_is_charged_to_its_parent_and_never_gets_a_fresh_bucket() -> None:
    default = Limits(max_concurrent=2, tokens_per_s=10, burst_tokens=100)
    quotas = TenantQuotas(
        default,
        {
            "team-a": default,
            "team-a/batch": Limits(max_concurrent=1),
            "org/team": Limits(max_concurrent=5),
        },
    )
    assert quotas.levels("team-a/x/y") == ["team-a"]  # no limits of their own: the parent's
    assert quotas.levels("team-a/batch/n") == ["team-a", "team-a/batch"]
    assert quotas.levels("b/c") == ["b"]  # nothing configured: the root, with the default
    assert quotas.levels("org/team/x") == ["org/team"]  # the default does not cap org/team
    # Each fresh sub-tenant used to get the default quota afresh; now they share team-a's.
    assert quotas.take("team-a/one", 40, 0.0) is None
    assert quotas.take("team-a/two", 40, 0.0) is None
    refusal = quotas.take("team-a/three", 10, 0.0)
    assert refusal is not None and refusal.quota == "concurrent"
    assert "counted against tenant team-a" in refusal.message
    quotas.give_back("team-a/one")
    # The bucket is the parent's too: 80 of its 100 tokens are spent.
    refusal = quotas.take("team-a/four", 30, 0.0)
    assert refusal is not None and refusal.quota == "tokens"
    assert refusal.retry_after_s == pytest.approx(1.0)
    # A narrower level with limits of its own is bound by them and by its parent's.
    quotas.give_back("team-a/two")
    assert quotas.take("team-a/batch/n1", 5, 0.0) is None
    refusal = quotas.take("team-a/batch/n2", 5, 0.0)
    assert refusal is not None and "counted against tenant team-a/batch" in refusal.message
    assert quotas.take("team-a/other", 5, 0.0) is None  # team-a's second place
    refusal = quotas.take("team-a/more", 5, 0.0)
    assert refusal is not None and "counted against tenant team-a:" in refusal.message
    for i in range(3):  # an unconfigured root: sub-tenants share its default quota
        assert (quotas.take(f"b/{i}", 5, 0.0) is None) == (i < 2)
    quotas.give_back("team-a/batch/n1")
    quotas.give_back("team-a/other")
    assert quotas._state["team-a"].active == 0 and quotas._state["team-a/batch"].active == 0


def test_quota_is_checked_before_the_prompt_is_tokenized() -> None:
    encoded: list[str] = []
    backend = ScriptedBackend()
    long_prompt = "hello there " * 100  # longer than INLINE_PROMPT_CHARS: a tokenizer thread

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        record_tokenizing(service, encoded)
        backend.hold()
        first = asyncio.create_task(collect(service, GenerationParams("r1", prompt="hi")))
        await until(lambda: loop.accepted == 1)
        encoded.clear()
        with pytest.raises(QuotaExceededError, match="requests of this tenant are in progress"):
            await collect(service, GenerationParams("r2", prompt=long_prompt))
        assert encoded == []  # refused on its concurrency before any tokenizing
        backend.release()
        await first
        # A lower bound of the prompt's tokens (its bytes over the longest token's) is charged
        # before tokenizing: a prompt whose bound alone exceeds the bucket is never tokenized.
        huge = "word " * (service.max_token_bytes * 300 // 5)
        with pytest.raises(QuotaExceededError, match="more than this tenant's bucket"):
            await collect(service, GenerationParams("r3", prompt=huge, max_tokens=2))
        assert encoded == []
        # The rest is charged once counted; a refusal then gives back what was charged.
        state = service.quotas._state["team-a"]
        before = state.tokens
        with pytest.raises(QuotaExceededError, match="more than this tenant's bucket"):
            await collect(service, GenerationParams("r4", prompt="hello " * 260, max_tokens=2))
        assert len(encoded) == 1 and state.active == 0
        assert state.tokens == pytest.approx(before, abs=50)  # refilled a little, not spent

    quotas = {"tenants": {"team-a": {"max_concurrent": 1, "tokens_per_s": 20, "burst_tokens": 250}}}
    principal = Principal("a", "team-a", frozenset({auth.CLIENT}))
    token = auth.CURRENT.set(principal)
    try:
        serve(backend, body, {"quotas": quotas, "model": {"max_input_tokens": 4096}})
    finally:
        auth.CURRENT.reset(token)


def test_a_prompt_far_over_the_limit_is_refused_on_a_prefix() -> None:
    lengths: list[int] = []

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        encode = service._encode

        def measured(text: str) -> tuple[int, ...]:
            lengths.append(len(text))
            return encode(text)

        service._encode = measured  # type: ignore[method-assign]
        limit = service.cfg.model.max_input_tokens
        story = "Long prompts block short chats; 长请求会阻塞短对话。 "
        prompt = story * (PREFIX_CHARS_PER_TOKEN * limit * 2 // len(story))  # ~2x the prefix
        with pytest.raises(BadRequestError, match=f"more than {limit} tokens"):
            await collect(service, GenerationParams("r", prompt=prompt, max_tokens=2))
        assert len(lengths) == 1 and lengths[0] <= PREFIX_CHARS_PER_TOKEN * limit < len(prompt)
        # Within the limit, the whole prompt is counted (the prefix is only a shortcut).
        fits = "internationalization " * (limit * 9 // 21)  # ~10 characters a token
        assert len(fits) > PREFIX_CHARS_PER_TOKEN * limit
        lengths.clear()
        events = await collect(service, GenerationParams("s", prompt=fits, max_tokens=2))
        assert isinstance(events[-1], Final) and lengths[-1] == len(fits)

    serve(ScriptedBackend(), body)


def test_a_tenant_over_its_quota_is_refused_with_a_retry_hint() -> None:
    async def body(service: GenerationService, loop: CoreLoop) -> None:
        backend.hold()
        first = asyncio.create_task(collect(service, GenerationParams("r1", prompt="hi")))
        await until(lambda: loop.accepted == 1)
        with pytest.raises(QuotaExceededError) as caught:
            await collect(service, GenerationParams("r2", prompt="hi"))
        assert caught.value.retry_after_s is not None
        other = Principal("b", "team-b", frozenset({auth.CLIENT}))
        token = auth.CURRENT.set(other)  # another tenant is not held up by team-a's limit
        try:
            second = asyncio.create_task(collect(service, GenerationParams("r3", prompt="hi")))
            await until(lambda: loop.accepted == 2)
        finally:
            auth.CURRENT.reset(token)
        backend.release()
        await first
        await second
        assert service.quotas._state["team-b"].active == 0

    backend = ScriptedBackend()
    token = auth.CURRENT.set(Principal("a", "team-a", frozenset({auth.CLIENT})))
    try:
        serve(backend, body, {"quotas": {"default": {"max_concurrent": 1}}})
    finally:
        auth.CURRENT.reset(token)
