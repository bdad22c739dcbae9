"""The reference engine's iteration scheduler: which sequences run in the next model step.

Pure Python (no torch), driven by one engine thread: `add` queues a request, `schedule` plans an
iteration, `commit` applies the sampled tokens, `cancel` ends a request early.

Two strategies, as TensorRT-LLM's `gpt_model_type`:
- `inflight`: every iteration decodes one token for each running sequence and admits waiting
  ones first-come-first-served while the token budget, the sequence cap and the KV pool allow.
  With `enable_chunked_context`, a prompt's context phase is split across iterations: decodes
  are planned first, then the rest of `max_num_tokens` goes to prompts in their context phase,
  oldest first (`first_come_first_served`) or in equal chunks (`equal_progress`); a prompt's
  last chunk samples its first token. Without it a whole prompt must fit one iteration.
- `static` (V1): a batch of whole requests is formed only when the engine is empty; its rows
  are padded to the longest prompt, prefilled together and decoded in lockstep until every row
  is done. Rows that finish early keep computing a pad token (the waste static batching pays).

Two KV policies, as TensorRT-LLM's `batch_scheduler_policy`:
- `guaranteed_no_evict`: admission reserves blocks for prompt + maximum output.
- `max_utilization`: admission takes blocks for the prompt; sequences grow block by block, and
  when the pool is empty the most recently admitted sequence is paused (its blocks freed) and
  later recomputed from its prompt and the tokens it already produced.

KV cache reuse (TensorRT-LLM's `enable_kv_cache_reuse`, in-flight batching only): a prompt's
full blocks are registered in the pool as its context phase computes them; a later prompt that
starts with the same blocks shares them at admission and its context phase starts after them
(their prefill is skipped, and emulated timing charges only the tokens fed). At least the
prompt's last token is always fed, so its first token is sampled as without reuse. Greedy
outputs are the same with and without reuse (tests/unit/reference_engine/test_reuse.py).

Invariants: every block belongs to a running sequence, is cached and idle, or is free (see
`BlockPool`); a finished
or cancelled sequence holds no blocks once its iteration is committed (static batches free all
rows' blocks together when the batch ends); the waiting queue holds only unadmitted rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from reference_engine.blocks import BlockPool, PoolExhaustedError, block_keys
from reference_engine.config import EngineConfig
from reference_engine.eos import natural_length
from reference_engine.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NeverFitsError,
    QueueFullError,
)
from reference_engine.request import (
    EngineRequest,
    FinishReason,
    RowSpec,
    RunningSequence,
    Sampling,
)
from scheduler_svc.core.chunking import split_budget


@dataclass(frozen=True)
class Work:
    """Tokens one sequence feeds in one iteration, written from KV slot `start` on: a decode
    (one token), or (`is_context`) its prompt or one chunk of it."""

    seq: RunningSequence
    tokens: tuple[int, ...]
    start: int
    emits: bool
    is_context: bool = False


@dataclass(frozen=True)
class Plan:
    works: tuple[Work, ...]
    num_paused: int = 0

    @property
    def context_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.works if w.is_context)

    @property
    def num_context(self) -> int:
        return sum(1 for w in self.works if w.is_context)


@dataclass(frozen=True)
class Sampled:
    """What the model chose in one iteration, one entry per emitting work in plan order: the
    token, and its log probability where the row asks for one (None otherwise)."""

    tokens: list[int]
    log_probs: list[float | None]


@dataclass(frozen=True)
class Update:
    """What one committed iteration produced for one row."""

    seq: RunningSequence
    new_tokens: tuple[int, ...]
    row_finished: bool
    new_log_probs: tuple[float, ...] = ()  # the new tokens', where the row asked for them


@dataclass
class TokenCounts:
    """Tokens pushed through the model, and how many of them served a real row."""

    context_processed: int = 0
    context_useful: int = 0
    generation_processed: int = 0
    generation_useful: int = 0
    paused_total: int = 0
    # With KV cache reuse: prompt tokens admitted, and of them those served from cached blocks.
    prompt_tokens_admitted: int = 0
    prompt_tokens_reused: int = 0
    # Requests ended before they were done, by how: a `stop`, a client cancellation, a failure.
    stopped_total: int = 0
    cancelled_total: int = 0
    failed_total: int = 0


class Batcher:
    """Plans engine iterations over a paged KV pool. Not thread-safe: one owner at a time."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.pool = BlockPool(cfg.num_blocks, cfg.tokens_per_block)
        self.counts = TokenCounts()
        self._waiting: deque[RunningSequence] = deque()
        self._running: list[RunningSequence] = []
        self._requests: dict[str, EngineRequest] = {}
        self._next_seq_id = 0
        self._static = cfg.batching_strategy == "static"
        self._reuse = cfg.enable_kv_cache_reuse

    # -- state -------------------------------------------------------------------------------

    @property
    def num_waiting_requests(self) -> int:
        return len({seq.request.key for seq in self._waiting})

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def cached_tokens(self) -> int:
        """Token slots holding valid keys (pad slots included), over every running sequence."""
        return sum(seq.num_cached for seq in self._running)

    @property
    def running_ids(self) -> set[int]:
        """Sequences holding KV blocks (a static batch's finished rows included)."""
        return {seq.seq_id for seq in self._running}

    @property
    def requests(self) -> list[EngineRequest]:
        return list(self._requests.values())

    def idle(self) -> bool:
        return not self._waiting and not self._running

    # -- intake ------------------------------------------------------------------------------

    def add(
        self,
        key: str,
        rows: list[RowSpec],
        *,
        streaming: bool,
        sampling: Sampling,
        handle: object,
    ) -> EngineRequest:
        """Queue a request, or raise an `EngineError` that says why it cannot be."""
        if key in self._requests:
            raise DuplicateRequestError(f"request id {key!r} is already in flight")
        self._validate(rows)
        if self.cfg.max_queue_size and self.num_waiting_requests >= self.cfg.max_queue_size:
            raise QueueFullError(
                f"Exceeds maximum queue size of {self.cfg.max_queue_size} requests"
            )
        request = EngineRequest(key=key, streaming=streaming, sampling=sampling, handle=handle)
        for index, spec in enumerate(rows):
            seq = RunningSequence(
                seq_id=self._next_seq_id,
                request=request,
                row=index,
                prompt=spec.prompt,
                max_new_tokens=spec.max_new_tokens,
                end_id=spec.end_id,
                pad_id=spec.pad_id,
                stop_words=spec.stop_words,
                bad_words=spec.bad_words,
                min_length=spec.min_length,
                sampling=spec.sampling or sampling,
                natural_len=self._natural_length(spec.prompt),
                return_log_probs=spec.return_log_probs,
            )
            self._next_seq_id += 1
            request.rows.append(seq)
            self._waiting.append(seq)
        self._requests[key] = request
        return request

    def _validate(self, rows: list[RowSpec]) -> None:
        cfg = self.cfg
        if not rows:
            raise InvalidRequestError("input_ids: a request needs at least one row")
        for index, row in enumerate(rows):
            if len(row.prompt) > cfg.max_input_len:
                raise InvalidRequestError(
                    f"input_lengths: row {index} has {len(row.prompt)} tokens, above "
                    f"max_input_len {cfg.max_input_len}"
                )
            total = len(row.prompt) + row.max_new_tokens
            if self.pool.blocks_for(total) > self.pool.num_blocks:
                raise NeverFitsError(
                    f"row {index} needs {self.pool.blocks_for(total)} KV blocks for "
                    f"{total} tokens but the pool holds {self.pool.num_blocks}; it can never run"
                )
        if self._static:
            longest = max(len(r.prompt) for r in rows)
            widest = max(r.max_new_tokens for r in rows)
            padded_blocks = len(rows) * self.pool.blocks_for(longest + widest)
            if len(rows) > cfg.max_num_sequences:
                raise NeverFitsError(
                    f"input_ids: {len(rows)} rows exceed max_num_sequences "
                    f"{cfg.max_num_sequences} of the static batcher"
                )
            if len(rows) * longest > cfg.max_num_tokens:
                raise NeverFitsError(
                    f"input_ids: the padded batch of {len(rows)} x {longest} tokens exceeds "
                    f"max_num_tokens {cfg.max_num_tokens}"
                )
            if padded_blocks > self.pool.num_blocks:
                raise NeverFitsError(
                    f"the padded batch needs {padded_blocks} KV blocks but the pool holds "
                    f"{self.pool.num_blocks}; it can never run"
                )

    def cancel(self, key: str, reason: FinishReason) -> EngineRequest | None:
        """End every unfinished row of a request now and free their blocks."""
        request = self._requests.get(key)
        if request is None:
            return None
        if reason == FinishReason.STOPPED:
            self.counts.stopped_total += 1
        elif reason == FinishReason.CANCELLED:
            self.counts.cancelled_total += 1
        else:
            self.counts.failed_total += 1
        for seq in request.rows:
            if seq.done:
                continue
            seq.finish = reason
            if seq in self._waiting:
                self._waiting.remove(seq)
            if seq in self._running:
                self._running.remove(seq)
                self.pool.free(seq.seq_id)
        self._end_static_batch_if_done()
        self._forget_if_done(request)
        return request

    # -- planning ----------------------------------------------------------------------------

    def schedule(self) -> Plan:
        """Plan the next iteration; an empty plan means there is nothing to run."""
        if self._static:
            return self._schedule_static()
        return self._schedule_inflight()

    def _schedule_inflight(self) -> Plan:
        works: list[Work] = []
        paused = 0
        for seq in list(self._running):
            if seq not in self._running or seq.in_context:
                continue  # paused as a victim earlier in this loop, or still prefilling
            if self.cfg.batch_scheduler_policy == "max_utilization":
                paused += self._grow_or_pause(seq)
                if seq not in self._running:
                    continue
            works.append(Work(seq, (seq.generated[-1],), seq.num_cached, emits=True))
        budget = self.cfg.max_num_tokens - len(works)
        contexts = [seq for seq in self._running if seq.in_context]
        chunked = self.cfg.enable_chunked_context
        equal = chunked and self.cfg.context_chunking_policy == "equal_progress"
        left = budget - sum(seq.context_left for seq in contexts)  # FCFS: what the older leave
        while self._waiting and len(self._running) < self.cfg.max_num_sequences:
            seq = self._waiting[0]
            tokens = len(seq.prompt) + len(seq.generated)
            shared = self._cached_prefix(seq, tokens)
            fed = tokens - len(shared) * self.pool.tokens_per_block
            if equal:  # every prompt in its context phase gets a token this step
                fits = len(contexts) < budget
            elif chunked:  # what the older prompts leave
                fits = left > 0
            else:  # the whole prompt (less its cached blocks), this step
                fits = fed <= left
            if not fits or not self._admit(seq, tokens, shared):
                break  # first come, first served: the head waits, nobody overtakes it
            contexts.append(seq)
            left -= fed
        wants = [seq.context_left for seq in contexts]
        sizes = split_budget(wants, budget, self.cfg.context_chunking_policy)
        for seq, size in zip(contexts, sizes, strict=True):
            if size:
                context = (seq.prompt + tuple(seq.generated))[
                    seq.num_cached : seq.num_cached + size
                ]
                done = seq.num_cached + size == seq.context_len
                works.append(Work(seq, context, seq.num_cached, emits=done, is_context=True))
        self.counts.paused_total += paused
        return Plan(tuple(works), num_paused=paused)

    def _admit(self, seq: RunningSequence, tokens: int, shared: list[int]) -> bool:
        """Start the waiting head's context phase if the pool holds it: its cached blocks
        shared, blank ones for the rest (prompt + maximum output under guaranteed_no_evict,
        the context alone under max_utilization). False if the pool cannot."""
        if self.cfg.batch_scheduler_policy == "guaranteed_no_evict":
            need = self.pool.blocks_for(len(seq.prompt) + seq.max_new_tokens)
        else:
            need = self.pool.blocks_for(tokens)
        need -= len(shared)
        if need > self.pool.num_free - self.pool.idle_among(shared):
            return False
        self._waiting.popleft()
        self.pool.share(seq.seq_id, shared)
        self.pool.allocate(seq.seq_id, need)
        self._running.append(seq)
        seq.registered = len(shared)
        seq.num_cached = len(shared) * self.pool.tokens_per_block
        seq.context_len = tokens
        if self._reuse:
            self.counts.prompt_tokens_admitted += len(seq.prompt)
            self.counts.prompt_tokens_reused += seq.num_cached
        return True

    def _cached_prefix(self, seq: RunningSequence, tokens: int) -> list[int]:
        """The cached blocks `seq` can start from: its prompt's leading full blocks, short of
        the last token it feeds (that one samples its next token)."""
        if not self._reuse:
            return []
        if seq.keys is None:
            seq.keys = block_keys(seq.prompt, self.pool.tokens_per_block)
        usable = min(len(seq.prompt), tokens - 1) // self.pool.tokens_per_block
        return self.pool.match(seq.keys[:usable])

    def _register(self, seq: RunningSequence) -> None:
        """Cache the prompt blocks whose tokens `seq` has computed."""
        assert seq.keys is not None
        full = min(seq.num_cached, len(seq.prompt)) // self.pool.tokens_per_block
        for index in range(seq.registered, full):
            self.pool.register(seq.seq_id, index, seq.keys[index])
        seq.registered = max(seq.registered, full)

    def _grow_or_pause(self, seq: RunningSequence) -> int:
        """Give `seq` room for one more token, pausing the newest sequences if needed."""
        paused = 0
        while True:
            try:
                self.pool.ensure(seq.seq_id, seq.num_cached + 1)
                return paused
            except PoolExhaustedError:
                victim = self._running[-1]
                self._pause(victim)
                paused += 1
                if victim is seq:
                    return paused

    def _pause(self, seq: RunningSequence) -> None:
        self._running.remove(seq)
        self.pool.free(seq.seq_id)
        seq.num_cached = seq.registered = 0
        self._waiting.appendleft(seq)

    def _schedule_static(self) -> Plan:
        if self._running:
            works = [
                Work(
                    seq,
                    (seq.pad_id if seq.done else seq.generated[-1],),
                    seq.num_cached,
                    emits=not seq.done,
                )
                for seq in self._running
            ]
            return Plan(tuple(works))
        batch = self._form_static_batch()
        if not batch:
            return Plan(())
        longest = max(len(seq.prompt) for seq in batch)
        widest = max(seq.max_new_tokens for seq in batch)
        works = []
        for seq in batch:
            self._waiting.remove(seq)
            seq.pad = longest - len(seq.prompt)
            self.pool.allocate(seq.seq_id, self.pool.blocks_for(longest + widest))
            self._running.append(seq)
            seq.context_len = longest
            prompt = (seq.pad_id,) * seq.pad + seq.prompt
            works.append(Work(seq, prompt, 0, emits=True, is_context=True))
        return Plan(tuple(works))

    def _form_static_batch(self) -> list[RunningSequence]:
        batch: list[RunningSequence] = []
        for group in _group_by_request(self._waiting):
            trial = batch + group
            longest = max(len(s.prompt) for s in trial)
            widest = max(s.max_new_tokens for s in trial)
            fits = (
                len(trial) <= self.cfg.max_num_sequences
                and len(trial) * longest <= self.cfg.max_num_tokens
                and len(trial) * self.pool.blocks_for(longest + widest) <= self.pool.num_free
            )
            if not fits:
                break
            batch = trial
        return batch

    # -- results -----------------------------------------------------------------------------

    def commit(
        self,
        plan: Plan,
        sampled: Iterable[int],
        log_probs: Iterable[float | None] | None = None,
    ) -> list[Update]:
        """Apply one token per emitting work (in plan order), with its log probability where
        the runner gave one; return what each row gained."""
        updates: list[Update] = []
        tokens = iter(sampled)
        probs = iter(log_probs) if log_probs is not None else None
        for work in plan.works:
            seq = work.seq
            processed = len(work.tokens)
            if work.is_context:  # a static row's pad slots come first, in its first chunk
                useful = processed - (seq.pad if work.start == 0 else 0)
            else:
                useful = processed if work.emits else 0
            if work.is_context:
                self.counts.context_processed += processed
                self.counts.context_useful += useful
            else:
                self.counts.generation_processed += processed
                self.counts.generation_useful += useful
            seq.num_cached = work.start + processed
            if self._reuse and work.is_context:
                self._register(seq)
            if not work.emits:
                continue
            token = next(tokens)
            log_prob = next(probs) if probs is not None else None
            if seq.done:
                continue
            updates.append(self._advance(seq, token, log_prob))
        for update in updates:
            if update.row_finished and not self._static:
                self._running.remove(update.seq)
                self.pool.free(update.seq.seq_id)
        self._end_static_batch_if_done()
        for update in updates:
            self._forget_if_done(update.seq.request)
        return updates

    def _natural_length(self, prompt: tuple[int, ...]) -> int | None:
        cfg = self.cfg
        if cfg.eos_model == "none":
            return None
        return natural_length(prompt, cfg.eos_mean_tokens, cfg.eos_sigma, cfg.eos_seed)

    def _advance(self, seq: RunningSequence, token: int, log_prob: float | None = None) -> Update:
        natural = seq.natural_len
        done = len(seq.generated)
        if natural is not None and seq.end_id >= 0 and done >= max(natural, seq.min_length):
            # The synthetic end-of-sequence model: the row ends here, as a trained model's
            # would (min_length holds the end back as it holds the real one).
            token = seq.end_id
        if token == seq.end_id:
            seq.finish = FinishReason.END_ID
            return Update(seq, (), row_finished=True)
        seq.generated.append(token)
        new_log_probs: tuple[float, ...] = ()
        if seq.return_log_probs:
            # A runner that gives none (a test's model double) leaves it unknown: NaN.
            new_log_probs = (float("nan") if log_prob is None else log_prob,)
            seq.log_probs.append(new_log_probs[0])
        generated = seq.generated
        if len(generated) >= seq.min_length and any(
            len(word) <= len(generated) and tuple(generated[-len(word) :]) == word
            for word in seq.stop_words
        ):
            seq.finish = FinishReason.STOP_WORDS
        elif len(generated) >= seq.max_new_tokens:
            seq.finish = FinishReason.LENGTH
        return Update(seq, (token,), row_finished=seq.done, new_log_probs=new_log_probs)

    def _end_static_batch_if_done(self) -> None:
        if self._static and self._running and all(seq.done for seq in self._running):
            for seq in self._running:
                self.pool.free(seq.seq_id)
            self._running.clear()

    def _forget_if_done(self, request: EngineRequest) -> None:
        if request.done:
            self._requests.pop(request.key, None)


def _group_by_request(seqs: Iterable[RunningSequence]) -> list[list[RunningSequence]]:
    groups: dict[str, list[RunningSequence]] = {}
    for seq in seqs:
        groups.setdefault(seq.request.key, []).append(seq)
    return list(groups.values())
