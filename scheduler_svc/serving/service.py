"""The request path every front shares: validate, tokenize, queue, detokenize, account.

Data moves one way: front -> service (validate, tokenize) -> core loop (the core decides) ->
batch runner (the backend) -> this request's row channel -> service (detokenize) -> front. The
service never talks to a backend: it reads its own row's tokens and turns them into text.

`GenerationService.generate` yields `Delta`s as text becomes safe to show and one `Final` at the
end, or raises a `RequestError`. Whatever happens, the request leaves the core loop exactly once
and one log line records how it ended.

The request's bounds are checks.py's, its log line and tenant metrics accounting.py's, its
types (GenerationParams, Delta, Final) contracts/generation.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import structlog
from tokenizers import Tokenizer

from scheduler_svc.config import QuotaConfig, SidecarConfig, TenantQuota
from scheduler_svc.contracts.generation import Delta, Final, Finish, GenerationParams
from scheduler_svc.core.bucketing import root_tenant
from scheduler_svc.core.quota import Limits, Refusal, TenantQuotas
from scheduler_svc.core.routing import RouteClass
from scheduler_svc.core.types import Expired, ExpireReason, Request
from scheduler_svc.errors import (
    BackendFailedError,
    BackendUnavailableError,
    BadRequestError,
    ConfigError,
    InternalError,
    MaxDurationError,
    OverloadedError,
    QueueTimeoutError,
    QuotaExceededError,
    RequestError,
    ShuttingDownError,
    clip,
)
from scheduler_svc.serving import auth
from scheduler_svc.serving.accounting import RequestRecord, TenantShare
from scheduler_svc.serving.backends.base import DEFAULT_ENGINE_MODEL, GenerationInput
from scheduler_svc.serving.checks import MAX_WORD_TOKENS, check_request
from scheduler_svc.serving.loop import CoreLoop, Ticket
from scheduler_svc.serving.text import TextStream
from scheduler_svc.serving.tokenqueue import TokenizerQueue

log = structlog.get_logger("scheduler_svc.requests")

DEFAULT_TEXT_MODEL = "ensemble"
# Long prompts wait in the tokenizer queue (scheduler_svc/serving/tokenqueue.py: bounded, taken in
# turn by tenant) for the tokenizer threads, which let go of the GIL, so a long prompt never
# holds up the event loop nor one tenant's burst everyone else's.
TOKENIZER_WAITING = 1024  # prompts
TOKENIZER_WAITING_BYTES = 16 << 20  # a tenant at most half
# A prompt longer than this many characters per allowed token is counted on a prefix first: if
# the prefix alone has too many tokens, it is refused having tokenized only that (a 120 KB
# prompt for a 4,096-token model: ~25 KB of work, not 120 KB).
PREFIX_CHARS_PER_TOKEN = 6
# A prompt this short is tokenized on the event loop (~25 µs per 100 characters here): less
# than the hop to a tokenizer thread and back.
INLINE_PROMPT_CHARS = 256


def tokenizer_threads() -> int:
    """Half the CPUs this process may use, at least one: the other half stays with the event
    loop (and, in an embedded stack, Triton). Measured on 2 cores (`make bench-flood`): with
    both cores tokenizing a flood, another tenant's requests slowed by up to 177 ms; with one,
    by at most 36 ms."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 2
    return max(1, cpus // 2)


def make_quotas(cfg: QuotaConfig) -> TenantQuotas:
    def limits(q: TenantQuota) -> Limits:
        return Limits(q.max_concurrent, q.tokens_per_s, q.burst_tokens)

    return TenantQuotas(
        limits(cfg.default), {k: limits(v) for k, v in cfg.tenants.items()}, cfg.max_tenants
    )


async def final_of(events: AsyncIterator[Delta | Final]) -> Final:
    """A request's final event, its deltas passed over (the whole answer is in it)."""
    async for event in events:
        if isinstance(event, Final):
            return event
    raise InternalError("generation ended without a final answer")


class GenerationService:
    def __init__(
        self,
        cfg: SidecarConfig,
        tokenizer: Tokenizer,
        loop: CoreLoop,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.clock = loop.clock  # the core's clock: deadlines and timings on one time base
        self.vocab_size = tokenizer.get_vocab_size()
        outside = [t for t in cfg.model.stop_token_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise ConfigError(
                f"model.stop_token_ids: {outside[0]} is outside the vocabulary "
                f"0..{self.vocab_size - 1}"
            )
        self._stop_words = tuple((t,) for t in cfg.model.stop_token_ids)
        self.loop = loop
        self.backend_ready = False
        # The text model the fronts answer for: the configured one, or the one discovered in
        # Triton's repository once it is ready.
        self.text_model = cfg.model.kserve_model or DEFAULT_TEXT_MODEL
        # The engine model the KServe front schedules token-id requests for: the backend's
        # (configured, or discovered once Triton answers).
        self.engine_model = cfg.triton.engine_model or DEFAULT_ENGINE_MODEL
        self.draining = False  # Admin.Drain or SIGTERM: new requests are refused
        # The prompt tokens the backend expects its engine to find cached (set by the app when
        # the backend can tell: a pool with prefix routing over engines that reuse KV blocks).
        self.cached_tokens: Callable[[GenerationInput], int] | None = None
        self.outcomes: Counter[str] = Counter()
        self.quotas = make_quotas(cfg.quotas)
        self._tokenize = TokenizerQueue(
            tokenizer_threads(),
            TOKENIZER_WAITING,
            TOKENIZER_WAITING_BYTES,
            cfg.queue.retry_after_s,
        )
        # At least the most bytes one token stands for (a vocabulary entry's spelling is never
        # shorter in UTF-8 than the text it stands for: byte-level BPE spells a byte as one
        # character, sentencepiece a space as '▁'): a prompt of n bytes has at least n / this
        # many tokens.
        self.max_token_bytes = max(len(k.encode()) for k in tokenizer.get_vocab())
        self._metric_tenants: set[str] = set(cfg.quotas.tenants)
        # The `precision` values a request may ask for (those the routes name).
        self.precisions = frozenset(r.precision for r in cfg.routes if r.precision is not None)

    def close(self) -> None:
        self._tokenize.close()

    def _encode_words(self, words: tuple[str, ...], name: str) -> tuple[tuple[int, ...], ...]:
        """Words as token ids, as the ensemble's preprocessing tokenizes them (no special
        tokens); a word the tokenizer makes nothing of is dropped."""
        if not words:
            return ()
        encoded = self.tokenizer.encode_batch(list(words), add_special_tokens=False)
        out = tuple(tuple(e.ids) for e in encoded if e.ids)
        if any(len(w) > MAX_WORD_TOKENS for w in out):
            raise BadRequestError(f"{name}: each word at most {MAX_WORD_TOKENS} tokens")
        return out

    def _encode(self, text: str) -> tuple[int, ...]:
        # encode_batch releases the GIL while it works; encode does not.
        special = self.cfg.model.add_special_tokens
        return tuple(self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)

    def _encode_within(self, text: str, limit: int) -> tuple[int, ...]:
        """The prompt's ids; a prompt far longer than `limit` tokens could take is first counted
        on a prefix cut where the tokenizer's own pieces meet, whose ids begin the whole's: if
        that prefix alone is over the limit, so is the prompt (refused, the rest never read)."""
        head = PREFIX_CHARS_PER_TOKEN * limit
        pre = self.tokenizer.pre_tokenizer
        if len(text) > head and pre is not None:
            window = head - 2048
            pieces = pre.pre_tokenize_str(text[window:head])
            if len(pieces) >= 8:  # a piece boundary well inside the window
                cut = window + pieces[-2][1][0]
                counted = len(self._encode(text[:cut]))
                if counted > limit:
                    raise BadRequestError(
                        f"prompt: more than {limit} tokens, the model's limit (its first "
                        f"{cut:,} characters are {counted})"
                    )
        return self._encode(text)

    async def _prompt_ids(self, params: GenerationParams, tenant: str) -> tuple[int, ...]:
        limit = self.cfg.model.max_input_tokens
        if params.token_ids is not None:
            ids = params.token_ids
            if len(ids) > limit:
                raise BadRequestError(
                    f"prompt: {len(ids)} tokens, the model accepts at most {limit}"
                )
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequestError(
                    f"token_ids: {bad[0]} is outside the vocabulary 0..{self.vocab_size - 1}"
                )
        elif len(text := params.prompt or "") <= INLINE_PROMPT_CHARS:
            ids = self._encode(text)
        else:
            size = len(text.encode("utf-8", "surrogatepass"))
            ids = await self._tokenize.run(tenant, size, lambda: self._encode_within(text, limit))
        if not ids:
            raise BadRequestError("prompt: empty (give prompt text or token_ids)")
        if len(ids) > limit:
            raise BadRequestError(f"prompt: {len(ids)} tokens, the model accepts at most {limit}")
        return ids

    def _least_prompt_tokens(self, params: GenerationParams) -> int:
        """A lower bound of the prompt's tokens, known before tokenizing it."""
        if params.token_ids is not None:
            return len(params.token_ids)
        size = len((params.prompt or "").encode("utf-8", "surrogatepass"))
        return -(-size // self.max_token_bytes)

    def _tenant_label(self, tenant: str) -> str:
        """A tenant's metric label: configured tenants and the first others seen by name
        (quotas.metric_tenants in all), the rest `other`."""
        if tenant in self._metric_tenants:
            return tenant
        if len(self._metric_tenants) < self.cfg.quotas.metric_tenants:
            self._metric_tenants.add(tenant)
            return tenant
        return "other"

    def _refuse_by_quota(self, refusal: Refusal | None, tenant: str) -> None:
        if refusal is None:
            return
        self.loop.metrics.tenant_refused.labels(self._tenant_label(tenant), refusal.quota).inc()
        raise QuotaExceededError(f"tenant {clip(tenant)}: {refusal.message}", refusal.retry_after_s)

    async def answer(self, params: GenerationParams) -> Final:
        """The whole answer, for the fronts' unary calls: the request's final event."""
        async with contextlib.aclosing(self.generate(params)) as events:
            return await final_of(events)

    async def generate(self, params: GenerationParams) -> AsyncGenerator[Delta | Final, None]:
        # The client's id is a label, echoed and logged, never a key: clients reuse ids (a
        # counter per connection is common), as Triton allows. Inside, every request has an
        # id of its own.
        internal = uuid.uuid4().hex
        run = RequestRecord(
            request_id=params.request_id or internal,
            internal_id=internal,
            started=self.clock(),
            clock=self.clock,
        )
        max_tokens = check_request(params, self.cfg.model, self.vocab_size, self.precisions)
        tenant = auth.CURRENT.get().tenant_for(params.tenant)
        if self.draining:
            raise ShuttingDownError("the sidecar is draining; retry on another instance")
        if not self.backend_ready:
            raise BackendUnavailableError("the backend is not ready; retry shortly")
        # Quota before any tokenizing: the tenant's concurrency exactly, its tokens on a lower
        # bound of the prompt's; the rest is charged once the prompt is counted.
        least = self._least_prompt_tokens(params) + max_tokens
        self._refuse_by_quota(self.quotas.take(tenant, least, self.clock()), tenant)
        taken = least
        try:
            prompt = await self._prompt_ids(params, tenant)
            words = (
                self._encode_words(params.stop_words, "stop_words") + params.stop_word_ids,
                self._encode_words(params.bad_words, "bad_words") + params.bad_word_ids,
            )
            run.prompt_tokens = len(prompt)
            total = len(prompt) + max_tokens
            more = self.quotas.take_more(tenant, total - least, total, self.clock())
            self._refuse_by_quota(more, tenant)
            taken = 0  # charged in full: nothing to give back
        except BaseException:
            self.quotas.give_back(tenant, refund=taken)
            raise
        try:
            async with contextlib.aclosing(
                self._generate(params, run, tenant, prompt, words, max_tokens)
            ) as events:
                async for event in events:
                    yield event
        finally:
            self.quotas.give_back(tenant)

    def _pinned_lane(self, params: GenerationParams) -> str | None:
        """The lane the request's priority pins (queue.priority_lanes), under the policy."""
        if self.cfg.queue.scheduler != "policy":
            return None
        return self.cfg.queue.priority_lanes.get(params.urgency.name.lower())

    def _remaining(self, params: GenerationParams) -> float:
        """The server's own cap on a request's life, within the client's deadline if it set
        one."""
        remaining = self.cfg.server.max_request_s
        if params.time_remaining_s is not None:
            remaining = min(remaining, params.time_remaining_s)
        return remaining

    async def _generate(
        self,
        params: GenerationParams,
        run: RequestRecord,
        tenant: str,
        prompt: tuple[int, ...],
        words: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]],
        max_tokens: int,
    ) -> AsyncGenerator[Delta | Final, None]:
        queue_timeout = params.queue_timeout_s or self.cfg.queue.default_queue_timeout_s
        row = GenerationInput(
            request_id=run.internal_id,
            prompt_ids=prompt,
            max_tokens=max_tokens,
            end_id=self.cfg.model.end_id if params.end_id is None else params.end_id,
            pad_id=self.cfg.model.pad_id if params.pad_id is None else params.pad_id,
            sampling=params.sampling,
            stop_words=(self._stop_words if params.end_id != -1 else ()) + words[0],
            bad_words=words[1],
            return_log_probs=params.return_log_probs,
            route=RouteClass(
                request_id=run.internal_id,
                tenant=tenant,
                session=params.session,
                precision=params.precision,
            ),
        )
        request = Request(
            request_id=run.internal_id,
            prompt_tokens=len(prompt),
            max_tokens=max_tokens,
            urgency=params.urgency,
            tenant=tenant,
            queue_deadline=run.started + queue_timeout if queue_timeout else None,
            lane=self._pinned_lane(params),
            cached_tokens=self.cached_tokens(row) if self.cached_tokens is not None else 0,
        )
        remaining = self._remaining(params)
        deadline = run.started + remaining
        ends_at = asyncio.get_running_loop().time() + remaining
        ticket = await self._submit(run, tenant, request, row, deadline)
        share = TenantShare(self.loop.metrics, self._tenant_label(root_tenant(tenant)))
        try:
            try:
                async with asyncio.timeout_at(ends_at):
                    decision = await asyncio.shield(ticket.decision)
            except TimeoutError:
                raise MaxDurationError(
                    f"waited {remaining:g} s in the sidecar queue, the server's maximum for a "
                    "request (server.max_request_s) or the client's deadline"
                ) from None
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling() == 0:  # the decision, not this call
                    raise InternalError("the request was withdrawn from the queue") from None
                raise
            run.queued_at = self.clock()
            run.lane = decision.lane
            share.decided(decision)
            if isinstance(decision, Expired):
                raise self._expired(decision, run, queue_timeout)
            run.dispatched = True
            text = self._text(run, params, decision.max_tokens or max_tokens, ticket, ends_at)
            async with contextlib.aclosing(text) as events:
                async for event in events:
                    yield event
        except asyncio.CancelledError:
            run.outcome = "cancelled"
            raise
        except GeneratorExit:
            if run.outcome != "ok":  # the front stopped reading before the end: the client left
                run.outcome = "cancelled"
            raise
        except RequestError as exc:
            run.outcome = exc.type
            raise
        finally:
            self.loop.leave(ticket)
            share.ended(run)
            self.outcomes[run.outcome] += 1
            ended = self.clock()
            self.loop.metrics.observe_end(
                run.lane, run.outcome, run.dispatched, run.ttft_s, ended - run.started
            )
            # The log line is written once the answer is on its way (a unary answer is sent
            # when the front returns, after this runs): ~0.2 ms off every request's latency.
            asyncio.get_running_loop().call_soon(run.log_end, tenant, ended)

    async def _submit(
        self,
        run: RequestRecord,
        tenant: str,
        request: Request,
        row: GenerationInput,
        deadline: float,
    ) -> Ticket:
        try:
            return await self.loop.submit(request, row, deadline)
        except RequestError as exc:
            if isinstance(exc, OverloadedError):
                label = self._tenant_label(root_tenant(tenant))
                self.loop.metrics.tenant_refusals.labels(label, exc.reason).inc()
            # Refused before it was accepted: no `request end` follows, so say why here.
            log.info("request refused", **run.who(tenant), outcome=exc.type, reason=str(exc)[:200])
            raise

    def _expired(
        self, decision: Expired, run: RequestRecord, queue_timeout: float | None
    ) -> RequestError:
        waited = f"waited {run.queue_ms:.0f} ms in the sidecar queue ({decision.lane} lane)"
        # The policy's predicted wait where its lane has learned a drain rate; else the fixed one.
        retry = decision.retry_after_s or self.cfg.queue.retry_after_s
        if decision.reason == ExpireReason.NO_FALLBACK:
            return OverloadedError(
                f"{waited}, past its queue timeout, with no fallback backend, shorter "
                "max_tokens or lower lane to degrade to",
                retry,
            )
        if decision.reason == ExpireReason.MISSED_TARGET:
            return OverloadedError(
                f"{waited}, past its lane's time-to-first-token target, with no fallback "
                "backend or shorter max_tokens: answered now rather than served late",
                retry,
            )
        if decision.reason == ExpireReason.PREDICTED_LATE:
            return OverloadedError(
                f"{waited}, past its queue timeout; the lower lane it would join is predicted "
                f"to start it in about {retry * 1000:.0f} ms, later than it may wait",
                retry,
            )
        if decision.reason == ExpireReason.REQUEUE_LIMIT:
            return OverloadedError(f"{waited} and was requeued to its limit", retry)
        if decision.reason == ExpireReason.PUSHED_OUT:
            return OverloadedError(
                f"{waited}; its lane is full and a tenant under its fair share arrived: the "
                "newest request of the tenant furthest over its share made room",
                retry,
                decision.reason.value,
            )
        return QueueTimeoutError(
            f"{waited}, past the request's timeout of {(queue_timeout or 0) * 1000:.0f} ms"
        )

    async def _text(
        self,
        run: RequestRecord,
        params: GenerationParams,
        max_tokens: int,
        ticket: Ticket,
        ends_at: float,
    ) -> AsyncGenerator[Delta | Final, None]:
        """Read this request's row, detokenize, stop at stop strings, end with a Final."""
        text = TextStream(self.tokenizer, params.stop)
        asked = params.return_log_probs
        log_probs: list[float] = []
        async for tokens in ticket.channel.tokens(ends_at):
            run.first_token_at = run.first_token_at or self.clock()
            before = len(text.token_texts)
            delta = text.push(tokens.ids)
            run.completion_tokens = len(text.ids)
            probs = None
            if asked:
                probs = tuple(tokens.log_probs or ())
                if len(probs) != len(tokens.ids):
                    raise BackendFailedError(
                        f"the engine sent {len(probs)} log probabilities for "
                        f"{len(tokens.ids)} tokens"
                    )
                log_probs += probs
            texts = tuple(text.token_texts[before:]) if asked else None
            last = tokens.last or text.stopped or len(text.ids) >= max_tokens
            yield Delta(delta, tuple(tokens.ids), probs, texts, last)
            if text.stopped:
                break  # leaving closes the row's channel: the runner stops it in the engine
        tail = text.finish()
        if tail:
            yield Delta(tail, (), () if asked else None, () if asked else None, last=True)
        ended = self.clock()
        run.outcome = "ok"
        yield Final(
            request_id=run.request_id,
            text=text.text,
            token_ids=tuple(text.ids),
            finish=Finish.STOP if text.stopped or len(text.ids) < max_tokens else Finish.LENGTH,
            prompt_tokens=run.prompt_tokens,
            completion_tokens=len(text.ids),
            queue_ms=run.queue_ms,
            ttft_ms=((run.first_token_at or ended) - run.started) * 1000,
            total_ms=(ended - run.started) * 1000,
            lane=run.lane,
            log_probs=tuple(log_probs) if asked else None,
            token_texts=tuple(text.token_texts) if asked else None,
        )
