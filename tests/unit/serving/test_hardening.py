"""Limits before work, strict policy input, an atomic scheduling step, and faults that must not
stall or silence a request: unit tests of the shell and the core over a scripted backend.

tests/integration/test_hardening_live.py proves the same against the real Triton.
"""

from __future__ import annotations

import asyncio
import math
import struct
import threading
from typing import Any

import pytest

from scheduler_svc.config import SidecarConfig, load_config
from scheduler_svc.core.config import PolicyConfig, from_mapping, to_mapping
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.quota import Limits, TenantQuotas
from scheduler_svc.core.types import Admitted, Request, StepFailedError, Target
from scheduler_svc.errors import (
    BackendStalledError,
    BadRequestError,
    ConfigError,
    InternalError,
    MaxDurationError,
    PermissionDeniedError,
    QuotaExceededError,
    ShuttingDownError,
    UnauthenticatedError,
)
from scheduler_svc.serving import auth
from scheduler_svc.serving.app import make_scheduler
from scheduler_svc.serving.auth import Credentials, Principal
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.kvpoll import parse_kv_blocks, poll_kv
from scheduler_svc.serving.fronts.controls import parse_policy_json
from scheduler_svc.serving.fronts.guard import Identity, role_for
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.rows import runner_for
from scheduler_svc.serving.service import (
    INLINE_PROMPT_CHARS,
    PREFIX_CHARS_PER_TOKEN,
    Final,
    GenerationParams,
    GenerationService,
)
from scheduler_svc.serving.tokenizer import load_tokenizer
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.waiting import until

TOKENIZER = load_tokenizer()


def serve(backend: ScriptedBackend, body: Any, config: dict[str, Any] | None = None) -> None:
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

    asyncio.run(main())


async def collect(service: GenerationService, params: GenerationParams) -> list[Any]:
    return [event async for event in service.generate(params)]


# -- limits before work ---------------------------------------------------------------------


def test_oversized_fields_are_refused_before_any_work() -> None:
    encoded: list[str] = []

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        spy(service, encoded)
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
            (GenerationParams("r", prompt="hi", temperature=1e39), "temperature: 1e"),
            (GenerationParams("r", prompt="hi", top_k=2**40), f"top_k: {2**40} is outside"),
            (GenerationParams("r", prompt="hi", top_k=vocab + 1), f"0..{vocab}"),
            (GenerationParams("r", prompt="hi", seed=2**64), "seed: "),
            (GenerationParams("r", prompt="hi", presence_penalty=-1e39), "presence_penalty"),
            (GenerationParams("r", prompt="hi", frequency_penalty=4e38), "frequency_penalty"),
            (GenerationParams("r", prompt="hi", repetition_penalty=1e-50), "repetition_penalty"),
        ]
        for params, needle in cases:
            with pytest.raises(BadRequestError, match=needle):
                await collect(service, params)
        assert loop.accepted == 0
        ok = GenerationParams("r", prompt="hi", max_tokens=2, temperature=1.0, top_k=vocab)
        assert isinstance((await collect(service, ok))[-1], Final)

    serve(ScriptedBackend(), body)


def spy(service: GenerationService, seen: list[str]) -> None:
    """Record the thread each prompt is tokenized on."""
    encode = service._encode

    def recorded(text: str) -> tuple[int, ...]:
        seen.append(threading.current_thread().name)
        return encode(text)

    service._encode = recorded  # type: ignore[method-assign]


def test_long_prompts_are_tokenized_off_the_event_loop_short_ones_on_it() -> None:
    threads: list[str] = []
    long_prompt = "hello there " * (INLINE_PROMPT_CHARS // 12 + 1)

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        spy(service, threads)
        await collect(service, GenerationParams("r", prompt=long_prompt, max_tokens=2))
        await collect(service, GenerationParams("s", prompt="hello there", max_tokens=2))

    serve(ScriptedBackend(), body)
    assert len(threads) == 2
    assert threads[0].startswith("tokenize")  # longer than INLINE_PROMPT_CHARS: on a thread
    assert threads[1] == threading.main_thread().name  # short: the hop would cost more


# -- the tenant comes from the credential ---------------------------------------------------


def test_a_request_may_only_narrow_its_credentials_tenant() -> None:
    team = Principal("team-a", "team-a", frozenset({auth.CLIENT}))
    assert team.tenant_for("") == "team-a"
    assert team.tenant_for("team-a/batch-jobs") == "team-a/batch-jobs"
    with pytest.raises(PermissionDeniedError, match="may only narrow"):
        team.tenant_for("team-b")
    with pytest.raises(PermissionDeniedError):
        team.tenant_for("team-ab")


def test_credentials_match_by_digest_and_never_keep_the_token(tmp_path: Any) -> None:
    token = "s3cret-token-of-team-a"
    path = tmp_path / "credentials.yaml"
    path.write_text(
        "tokens:\n"
        f"  - {{name: a, token: {token}, tenant: team-a, roles: [client]}}\n"
        f"  - {{name: ops, token_sha256: {auth.digest('ops-token-0123456789').hex()}, "
        "tenant: '', roles: [client, admin]}\n"
        "identities:\n  - {name: cert-ops, identity: ops.internal, roles: [admin]}\n"
    )
    creds = Credentials.load(path)
    assert creds.by_token(token) == Principal("a", "team-a", frozenset({"client"}))
    # No tenant key: the credential's own name, never any tenant (a forgotten key fails closed).
    cert_ops = creds.by_identity(["ops.internal"])
    assert cert_ops is not None and cert_ops.tenant == "cert-ops"
    with pytest.raises(PermissionDeniedError, match="may only narrow"):
        cert_ops.tenant_for("team-a")
    # Anonymous beside credentials: a tenant of its own, which it may only narrow.
    anonymous = auth.ANONYMOUS_BESIDE_CREDENTIALS
    assert anonymous.tenant_for("") == "anonymous"
    assert anonymous.tenant_for("anonymous/x") == "anonymous/x"
    with pytest.raises(PermissionDeniedError):
        anonymous.tenant_for("team-a")
    ops = creds.by_token("ops-token-0123456789")
    assert ops is not None and auth.ADMIN in ops.roles
    assert creds.by_token(token[:-1]) is None and creds.by_token("") is None
    assert creds.by_identity(["nobody", "ops.internal"]) is not None
    assert token not in repr(creds.__dict__)
    for bad in (
        "tokens: [{name: a, token: short, roles: [client]}]",
        "tokens: [{name: a, token: long-enough-token-1, roles: [root]}]",
        "tokens: [{name: a, token_sha256: abc, roles: [client]}]",
        "identities: [{name: a, roles: [client]}]",
    ):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="credentials"):
            Credentials.load(path)


def test_an_authorization_value_means_nothing_without_credentials(tmp_path: Any) -> None:
    nobody = Identity(None, auth.ANONYMOUS_CLIENT)
    for value in (None, "Bearer sk-anything", "Basic dXNlcjpwdw==", "garbage"):
        assert nobody.identify_by(value, list) == auth.ANONYMOUS_CLIENT
    path = tmp_path / "credentials.yaml"
    path.write_text("tokens: [{name: a, token: long-enough-token-1, roles: [client]}]")
    strict = Identity(Credentials.load(path), auth.NOBODY)
    with pytest.raises(UnauthenticatedError, match="expected 'Bearer <token>'"):
        strict.identify_by("Basic dXNlcjpwdw==", list)
    with pytest.raises(UnauthenticatedError, match="not valid"):
        strict.identify_by("Bearer wrong-token-000000", list)
    found = strict.identify_by("Bearer long-enough-token-1", list)
    assert found.name == "a"


def test_every_admin_method_needs_the_admin_role() -> None:
    for method in ("Drain", "Resume", "UpdatePolicy", "LoadModel", "UnloadModel", "GetStats"):
        assert role_for(f"/scheduler.v1.Admin/{method}") == auth.ADMIN
    assert role_for("/scheduler.v1.Scheduler/Generate") == auth.CLIENT
    assert role_for("/inference.GRPCInferenceService/ModelInfer") == auth.CLIENT
    assert role_for("/inference.GRPCInferenceService/RepositoryModelLoad") == auth.ADMIN
    assert role_for("/inference.GRPCInferenceService/LogSettings") == auth.ADMIN
    assert role_for("/inference.GRPCInferenceService/RepositoryIndex") == auth.CLIENT  # reading
    assert role_for("/grpc.health.v1.Health/Check") == ""
    assert role_for("/some.Unknown/Method") == auth.ADMIN  # unlisted: the strictest


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
        spy(service, encoded)
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


# -- strict policy input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"kv": {"max_in_flight": 1.5}}', "kv.max_in_flight: must be an integer"),
        ('{"kv": {"max_in_flight": true}}', "not a boolean"),
        ('{"retry_after_s": Infinity}', "Infinity is not a number"),
        ('{"retry_after_s": 1e308}', "retry_after_s: must be in"),
        ('{"lanes": [{"name": ["x"]}]}', "lanes[0].name: must be a string"),
        ('{"lanes": [{"name": "hot", "share": 5e-324}]}', "share: must be in"),
        ('{"quantum_tokens": "8"}', "quantum_tokens: must be an integer"),
        ("[" * 100 + "]" * 100, "nested 100 deep"),
        ('{"a": "' + "x" * 100_000 + '"}', "characters, at most"),
        ("{not json", "not JSON"),
    ],
)
def test_policy_updates_are_strictly_typed_and_bounded(text: str, needle: str) -> None:
    cfg = SidecarConfig()
    with pytest.raises((BadRequestError, ValueError)) as caught:
        cfg.policy_override(cfg.policy_config(), parse_policy_json(text))
    assert needle in str(caught.value)


def test_the_config_file_is_strictly_typed_too() -> None:
    for overrides, needle in (
        ({"queue": {"max_in_flight": 1.5}}, "queue.max_in_flight"),
        ({"queue": {"retry_after_s": math.inf}}, "finite"),
        ({"server": {"drain_grace_s": "30"}}, "server.drain_grace_s"),
        ({"policy": {"kv": {"max_in_flight": 2.5}}}, "kv.max_in_flight"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, overrides)
    assert from_mapping(to_mapping(PolicyConfig())) == PolicyConfig()


# -- an atomic scheduling step --------------------------------------------------------------


def test_a_step_that_fails_hands_over_what_it_decided_and_leaks_nothing() -> None:
    policy = PolicyScheduler(PolicyConfig())
    for i, prompt in enumerate((10, 10, 600)):  # hot, hot, warm: two buckets
        verdict = policy.submit(Request(f"r{i}", prompt, 8), 0.0)
        assert isinstance(verdict, Admitted)
    calls = {"n": 0}
    need = policy.mirror.need

    def failing_need(prompt_tokens: int, output_tokens: int) -> int:
        if prompt_tokens == 600:  # the second batch cannot be worked out
            raise OverflowError("boom")
        calls["n"] += 1
        return need(prompt_tokens, output_tokens)

    policy.mirror.need = failing_need  # type: ignore[method-assign]
    with pytest.raises(StepFailedError) as caught:
        policy.schedule(0.06)  # both buckets ready (50 ms), no queue timeout yet (100 ms)
    released = {d.request_id for d in caught.value.decisions}
    assert released == {"r0", "r1"}  # the first batch went out whole
    assert set(policy.mirror.held()) == released  # reservations only for what went out
    assert set(policy.queued_ids()) == {"r2"}  # the other is still queued, not lost
    policy.mirror.need = need  # type: ignore[method-assign]
    assert {d.request_id for d in policy.schedule(0.07)} == {"r2"}
    assert dict(policy.stats().counters)["step_failed"] == 1


def test_the_core_loop_answers_a_request_the_core_fails_on() -> None:
    async def main() -> None:
        scheduler = PolicyScheduler(PolicyConfig())

        def broken(request: Request, now: float) -> Any:
            raise RuntimeError("a bug")

        scheduler.submit = broken  # type: ignore[method-assign]
        loop = CoreLoop(scheduler)
        loop.start()
        try:
            row = GenerationInput("r", (1, 2), 4, 1, 2)
            with pytest.raises(InternalError):
                await asyncio.wait_for(loop.submit(Request("r", 2, 4), row, None), 5)
        finally:
            await loop.close()

    asyncio.run(main())


# -- faults ---------------------------------------------------------------------------------


def test_a_silent_backend_ends_the_request_unavailable() -> None:
    backend = ScriptedBackend()

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        backend.hold()  # Triton frozen: nothing comes back
        with pytest.raises(BackendStalledError, match=r"sent nothing for 0\.3 s"):
            await collect(service, GenerationParams("r", prompt="hi", max_tokens=4))
        await until(lambda: loop.stats().in_flight == 0)  # its place is free again
        backend.release()

    serve(backend, body, {"triton": {"stall_timeout_s": 0.3}})


def test_a_request_ends_at_the_servers_maximum_duration_even_while_queued() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.STATIC, 1))

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        backend.hold()
        running = asyncio.create_task(collect(service, GenerationParams("a", prompt="hi")))
        await until(lambda: loop.stats().in_flight == 1)
        with pytest.raises(MaxDurationError):  # queued behind it, no client deadline
            await collect(service, GenerationParams("b", prompt="hi"))
        with pytest.raises(MaxDurationError):
            await running
        assert loop.stats().queued == 0
        backend.release()

    serve(
        backend,
        body,
        {
            "server": {"max_request_s": 0.3},
            "triton": {"stall_timeout_s": 30.0},
            "policy": {
                "max_batches_in_flight": 1,
                "kv": {"max_in_flight": 1},
                "lanes": [{"name": "hot", "queue_timeout_s": None}],
            },
        },
    )


def test_expel_answers_queued_and_running_requests() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.STATIC, 1))

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        backend.hold()
        tasks = [
            asyncio.create_task(collect(service, GenerationParams(f"r{i}", prompt="hi")))
            for i in range(3)
        ]
        await until(lambda: loop.accepted == 3)
        assert await loop.expel(ShuttingDownError("bye", 1.0)) == 3
        for task in tasks:
            with pytest.raises(ShuttingDownError) as caught:
                await task
            assert caught.value.retry_after_s == 1.0
        backend.release()

    serve(backend, body, {"policy": {"max_batches_in_flight": 1, "kv": {"max_in_flight": 1}}})


@pytest.mark.parametrize(
    "page",
    [
        "<html><body>502 Bad Gateway</body></html>",
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"} NaN\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 10\n',
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"} 1\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} +Inf\n',
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"} 20\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 10\n',
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"} -1\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 10\n',
        "\x00\xff garbage {{{",
    ],
)
def test_an_unbelievable_metrics_page_gives_no_kv_counts(page: str) -> None:
    assert parse_kv_blocks(page, "tensorrt_llm") is None


def test_the_kv_poller_survives_any_failure_and_recovers() -> None:
    seen: list[tuple[int, int]] = []
    answers: list[Any] = [RuntimeError("boom"), None, (3, 10)]

    async def read() -> tuple[int, int] | None:
        answer = answers.pop(0) if answers else (4, 10)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    async def main() -> None:
        task = asyncio.create_task(poll_kv(lambda f, t: seen.append((f, t)), read, 0.001))
        await until(lambda: len(seen) >= 2)
        assert not task.done()
        task.cancel()

    asyncio.run(main())
    assert seen[:2] == [(3, 10), (4, 10)]


# -- ModelStreamInfer -----------------------------------------------------------------------


class _Context:
    """The little of a servicer context the KServe front reads."""

    def time_remaining(self) -> float | None:
        return None


def _infer(rid: str) -> Any:
    from tritonclient.grpc import service_pb2 as kserve_pb  # noqa: PLC0415

    request = kserve_pb.ModelInferRequest(model_name="ensemble", id=rid)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(len(b"hi").to_bytes(4, "little") + b"hi")
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append((2).to_bytes(4, "little"))
    return request


def test_model_stream_infer_caps_a_stream_and_answers_each_request_once() -> None:
    from scheduler_svc.serving.fronts.kserve import KServeFront  # noqa: PLC0415

    backend = ScriptedBackend()

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        front = KServeFront(service)
        backend.hold()

        async def requests() -> Any:
            for i in range(4):
                yield _infer(f"r{i}")
            await until(lambda: loop.accepted == 2)
            backend.release()  # the first two may now finish
            raise BadRequestError("the request is not a valid message (malformed)")

        answers = []
        with pytest.raises(BadRequestError, match="malformed"):
            async for answer in front.ModelStreamInfer(requests(), _Context()):
                answers.append(answer)
        by_id: dict[str, list[Any]] = {}
        for answer in answers:
            by_id.setdefault(answer.infer_response.id, []).append(answer)
        assert sorted(by_id) == ["r0", "r1", "r2", "r3"]
        for rid in ("r2", "r3"):  # over the cap of 2: refused in-band, carrying the id
            [refused] = by_id[rid]
            assert refused.error_message.startswith("[RESOURCE_EXHAUSTED]")
        for rid in ("r0", "r1"):  # accepted before the bad message: answered, once
            [final] = by_id[rid]
            assert not final.error_message
            assert final.infer_response.parameters["triton_final_response"].bool_param

    serve(backend, body, {"server": {"max_stream_requests": 2}})


def test_a_client_that_stops_reading_is_cut_off_after_the_write_timeout() -> None:
    from scheduler_svc.errors import DeadlineError  # noqa: PLC0415
    from scheduler_svc.serving.fronts.guard import Guard, Identity, _Call  # noqa: PLC0415
    from scheduler_svc.serving.metrics import SidecarMetrics  # noqa: PLC0415

    class Stuck:
        """A context whose client never reads: every write waits forever."""

        async def write(self, message: object) -> None:
            await asyncio.Event().wait()

    async def main() -> None:
        guard = Guard(lambda: Identity(None, auth.ANONYMOUS_CLIENT), SidecarMetrics(), 0.2)
        wrapped = _Call(guard, "/scheduler.v1.Scheduler/GenerateStream", auth.CLIENT, _Handler())
        with pytest.raises(DeadlineError, match=r"read nothing for 0\.2 s"):
            await wrapped._write(Stuck(), b"answer")  # type: ignore[arg-type]

    asyncio.run(main())


class _Handler:
    request_deserializer = None


def test_an_http_body_that_arrives_slowly_is_cut_off_after_the_read_timeout() -> None:
    from scheduler_svc.serving.chat import PLAIN, ChatTemplate  # noqa: PLC0415
    from scheduler_svc.serving.fronts.http import HttpFront  # noqa: PLC0415

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        front = HttpFront(
            service, lambda: Identity(None, auth.ANONYMOUS_CLIENT), ChatTemplate(PLAIN, "plain")
        )
        port = await front.start("127.0.0.1", 0, None)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"model": '  # and then nothing more
            )
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(4096), 10)
            writer.close()
        finally:
            await front.close()
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.endswith(b"408 Request Timeout"), answer
        assert b"did not arrive within 0.2 s (server.read_timeout_s)" in rest

    serve(ScriptedBackend(), body, {"server": {"read_timeout_s": 0.2}})


def test_a_malformed_triton_response_is_a_clear_backend_failure() -> None:
    from tritonclient.grpc import service_pb2 as kserve_pb  # noqa: PLC0415

    from scheduler_svc.errors import BackendFailedError  # noqa: PLC0415
    from scheduler_svc.serving.backends.triton import (  # noqa: PLC0415
        batch_index,
        output_ids,
        output_log_probs,
    )

    response = kserve_pb.ModelInferResponse()
    response.outputs.add(name="output_ids", datatype="INT32")
    response.raw_output_contents.append(b"\x01\x02\x03")  # 3 bytes of INT32
    with pytest.raises(BackendFailedError, match="malformed 'output_ids'"):
        output_ids(response)
    empty = kserve_pb.ModelInferResponse()
    empty.outputs.add(name="batch_index", datatype="INT32")
    empty.raw_output_contents.append(b"")
    with pytest.raises(BackendFailedError, match="empty 'batch_index'"):
        batch_index(empty)
    good = kserve_pb.ModelInferResponse()
    good.outputs.add(name="output_ids", datatype="INT32")
    good.raw_output_contents.append((7).to_bytes(4, "little") + (9).to_bytes(4, "little"))
    assert output_ids(good) == [7, 9] and batch_index(good) == 0
    # Log probabilities: the last values for the response's ids; missing or short is a failure.
    with pytest.raises(BackendFailedError, match="no 'output_log_probs'"):
        output_log_probs(good, 2)
    good.outputs.add(name="output_log_probs", datatype="FP32")
    good.raw_output_contents.append(struct.pack("<3f", -0.5, -1.5, -2.5))
    assert output_log_probs(good, 2) == [-1.5, -2.5]
    with pytest.raises(BackendFailedError, match="3 'output_log_probs' values for 4 ids"):
        output_log_probs(good, 4)
    typed = kserve_pb.ModelInferResponse()
    typed.outputs.add(name="output_log_probs", datatype="FP32").contents.fp32_contents.extend([-1])
    assert output_log_probs(typed, 1) == [-1.0]


def test_an_unexpected_failure_in_a_streamed_request_still_answers_it_with_its_id() -> None:
    from scheduler_svc.serving.fronts.kserve import KServeFront  # noqa: PLC0415

    async def body(service: GenerationService, loop: CoreLoop) -> None:
        front = KServeFront(service)

        async def broken(params: GenerationParams) -> Any:
            raise RuntimeError("a bug")
            yield  # an async generator, as generate is

        service.generate = broken  # type: ignore[method-assign,assignment]

        async def requests() -> Any:
            yield _infer("only")

        answers = [a async for a in front.ModelStreamInfer(requests(), _Context())]
        [answer] = answers
        assert answer.infer_response.id == "only"
        assert answer.error_message.startswith("[INTERNAL] internal error ")
        assert loop.metrics.internal_errors.labels("ModelStreamInfer")._value.get() == 1

    serve(ScriptedBackend(), body)


def test_both_wordings_of_a_full_engine_queue_are_resource_exhausted() -> None:
    from scheduler_svc.errors import BackendBusyError, from_backend_message  # noqa: PLC0415

    for text in (
        "Exceeds maximum queue size",  # Triton core
        "Maximum queue size of 64 has been reached, please try again later",  # the executor
    ):
        assert isinstance(from_backend_message(text), BackendBusyError)
