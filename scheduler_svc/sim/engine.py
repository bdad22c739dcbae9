"""Simulated engines in virtual time: in-flight (continuous) batching and static batching.

In-flight, as the reference engine's batcher plans a step (engine/batcher.py): every running
sequence past its prompt decodes one token; the rest of `max_num_tokens` goes to prompt chunks
(chunked context, split between prompts by the profile's `context_chunking_policy`); waiting
sequences are admitted in arrival order while the sequence limit, that budget and the KV pool
allow (the head of the queue is never overtaken). KV blocks are taken as TensorRT-LLM's
`batch_scheduler_policy` takes them: as tokens arrive (`max_utilization`, paged: when a decoding
sequence needs a block and none is free, the newest running sequence is paused and later
recomputed from its prompt and what it had generated), for prompt + max_tokens at admission
(`guaranteed_no_evict`: nothing is ever paused), or for the whole maximum sequence length at
admission (contiguous, the source document's "before").
Static: one batch at a time; every row is padded to the batch's longest prompt and the batch
decodes until its longest output is done.
A step's time is the cost profile's (`profiles/profile.py`), counted as the engine counts it:
decode rows, the KV tokens they and the prompt chunks read, and the prompt tokens fed.

Invariants: free blocks + blocks held by running sequences == total; a sequence is waiting,
running or finished, never two of these.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler_svc.core.chunking import split_budget
from scheduler_svc.profiles import CostProfile


@dataclass(eq=False)
class SimSequence:
    """A request as the engine sees it."""

    request_id: str
    prompt_tokens: int
    output_tokens: int  # what it will really generate
    max_tokens: int = 0  # what the client allowed (guaranteed_no_evict reserves it); 0: output
    batch_id: int = 0  # the sidecar's batch (static engines run it as one unit); 0: none
    generated: int = 0
    prefilled: int = 0
    blocks: int = 0
    admitted_seq: int = 0

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass
class StepResult:
    duration_s: float
    first_token: list[SimSequence]
    progressed: list[SimSequence]
    finished: list[SimSequence]


@dataclass
class EngineTotals:
    steps: int = 0
    rows: int = 0  # sum over steps of the sequences each step runs
    batches: int = 0
    batch_rows: int = 0
    padded_prompt_tokens: int = 0
    prompt_tokens: int = 0
    paused: int = 0
    slots_allocated: int = 0  # sum over steps of allocated token slots
    slots_used: int = 0
    blocks_held: int = 0  # sum over steps of KV blocks held by running sequences
    pool_blocks: int = 0  # the KV pool's size (in-flight engines)
    row_limit: int = 0  # the most rows a step runs (max_num_sequences, or a static batch)


class _Engine:
    """What both engines share: a bounded waiting queue and the rows running now."""

    def __init__(self, cost: CostProfile) -> None:
        self.cost = cost
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.totals = EngineTotals(row_limit=cost.max_num_sequences)

    def enqueue(self, seq: SimSequence) -> bool:
        """False when the engine's own queue is full (the request is refused)."""
        if len(self.waiting) >= self.cost.max_queue_size:
            return False
        self.waiting.append(seq)
        return True

    def busy(self) -> bool:
        return bool(self.waiting or self.running)


class InflightEngine(_Engine):
    """Continuous batching over a finite paged KV pool."""

    def __init__(
        self, cost: CostProfile, contiguous: bool = False, reserve_max_tokens: bool = False
    ) -> None:
        super().__init__(cost)
        self.contiguous = contiguous
        self.reserve_max_tokens = reserve_max_tokens  # guaranteed_no_evict
        self.total_blocks = cost.total_blocks
        self.free_blocks = self.total_blocks
        self.totals.pool_blocks = self.total_blocks
        self._admissions = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cost.tokens_per_block)

    def _admit(self, budget: int, prefilling: list[SimSequence]) -> None:
        """Admit from the head of the queue while the sequence limit, this step's prompt budget
        (the reference engine's rule for its chunking policy) and the KV pool allow."""
        equal = self.cost.context_chunking_policy == "equal_progress"
        left = budget - sum(s.context - s.prefilled for s in prefilling)
        while self.waiting and len(self.running) < self.cost.max_num_sequences:
            seq = self.waiting[0]
            fits = len(prefilling) < budget if equal else left > 0
            if not fits:
                return
            if self.contiguous:
                tokens = self.cost.max_seq_len
            elif self.reserve_max_tokens:
                tokens = seq.prompt_tokens + max(seq.max_tokens, seq.output_tokens)
            else:
                tokens = seq.context + 1
            need = self.blocks_for(tokens)
            if need > self.free_blocks:
                return
            self.waiting.popleft()
            self.free_blocks -= need
            seq.blocks = need
            self._admissions += 1
            seq.admitted_seq = self._admissions
            self.running.append(seq)
            prefilling.append(seq)
            left -= seq.context

    def _pause_newest(self) -> None:
        victim = max(self.running, key=lambda s: s.admitted_seq)
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.prefilled = 0  # recomputed from scratch: prompt + what it had generated
        self.waiting.appendleft(victim)
        self.totals.paused += 1

    def step(self) -> StepResult:
        """Run one iteration; the caller advances time by `duration_s`."""
        decoding = [s for s in self.running if s.context <= s.prefilled]
        for seq in decoding:
            if seq not in self.running:
                continue  # paused this step to make room
            if not self.contiguous and self.blocks_for(seq.context + 1) > seq.blocks:
                while self.free_blocks == 0 and len(self.running) > 1:
                    self._pause_newest()
                if seq not in self.running:
                    continue
                if self.free_blocks:
                    self.free_blocks -= 1
                    seq.blocks += 1
        decoding = [s for s in decoding if s in self.running]
        budget = self.cost.max_num_tokens - len(decoding)
        prefilling = [s for s in self.running if s.context > s.prefilled]
        self._admit(budget, prefilling)
        wants = [s.context - s.prefilled for s in prefilling]
        sizes = split_budget(wants, budget, self.cost.context_chunking_policy)
        # What the step reads from the KV cache: each decode row its context (all but the token
        # it feeds), each prompt chunk the chunks before it.
        read = sum(s.context - 1 for s in decoding)
        first: list[SimSequence] = []
        prompt_tokens = chunked = 0
        for seq, chunk in zip(prefilling, sizes, strict=True):
            if not chunk:
                continue
            chunked += 1
            read += seq.prefilled
            prompt_tokens += chunk
            seq.prefilled += chunk
            if seq.prefilled == seq.context:
                first.append(seq)
        duration = self.cost.step_s(len(decoding), read, prompt_tokens)
        self._account(len(decoding) + chunked)
        produced = first + decoding
        for seq in produced:
            seq.generated += 1
            seq.prefilled = seq.context
        finished = [s for s in produced if s.generated >= s.output_tokens]
        for seq in finished:
            self.running.remove(seq)
            self.free_blocks += seq.blocks
            seq.blocks = 0
        firsts = [s for s in produced if s.generated == 1]
        return StepResult(duration, firsts, produced, finished)

    def _account(self, rows: int) -> None:
        t = self.totals
        t.steps += 1
        t.rows += rows
        t.slots_allocated += sum(s.blocks for s in self.running) * self.cost.tokens_per_block
        t.slots_used += sum(s.prefilled for s in self.running)
        t.blocks_held += self.total_blocks - self.free_blocks


class StaticEngine(_Engine):
    """One padded batch at a time (TensorRT-LLM's V1 / static batching); `running` is it."""

    def __init__(self, cost: CostProfile, max_batch: int = 64) -> None:
        super().__init__(cost)
        self.max_batch = max_batch
        self.totals.row_limit = max_batch
        self._padded_len = 0

    def _next_batch(self) -> None:
        head = self.waiting[0]
        batch: list[SimSequence] = []
        while self.waiting and len(batch) < self.max_batch:
            seq = self.waiting[0]
            if head.batch_id and seq.batch_id != head.batch_id:
                break  # a sidecar batch runs as the unit it was released as
            if not head.batch_id and seq.batch_id:
                break
            batch.append(self.waiting.popleft())
        self.running = batch
        self._padded_len = max(s.prompt_tokens for s in batch)
        t = self.totals
        t.batches += 1
        t.batch_rows += len(batch)
        t.padded_prompt_tokens += self._padded_len * len(batch)
        t.prompt_tokens += sum(s.prompt_tokens for s in batch)

    def step(self) -> StepResult:
        rows = len(self.running) if self.running else 0
        if not self.running:
            self._next_batch()
            rows = len(self.running)
            duration = self.cost.step_s(0, 0, rows * self._padded_len)
            produced = list(self.running)
        else:
            longest = max(s.generated for s in self.running)
            # Every row, finished ones too, reads the padded prompt and the steps so far.
            duration = self.cost.step_s(rows, rows * (self._padded_len + longest - 1), 0)
            produced = [s for s in self.running if s.generated < s.output_tokens]
        self.totals.steps += 1
        self.totals.rows += rows
        for seq in produced:
            seq.generated += 1
        finished = [s for s in produced if s.generated >= s.output_tokens]
        if all(s.generated >= s.output_tokens for s in self.running):
            self.running = []
        firsts = [s for s in produced if s.generated == 1]
        return StepResult(duration, firsts, produced, finished)
