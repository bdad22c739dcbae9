"""The engine as the core sees it, and the one rule that turns what it reports into policy.

A backend reports an `EngineProfile` once, at start: how the engine batches, how many rows a
request may carry, how many batches it runs at once, its token budget, its KV pool and, where it
says, what a step costs. Everything decided about dispatch (which batch runner, how many
batches stay in the engine, whether buckets wait to fill, the lanes' targets, the prefill budget,
how the KV mirror reserves) follows from that one fact by `policy_for_engine`, except what the
operator's policy section pins (`Pinned`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from scheduler_svc.core.config import MEDIAN_FOR_ALLOCATING_ENGINES, PolicyConfig
from scheduler_svc.core.slo import lane_targets

# The share of the tightest lane's TTFT target one step's long-prompt work may take on an
# in-flight engine: a short prompt arriving waits for the step running and then its own, so
# two such steps stay well inside its target.
PREFILL_SHARE_OF_TARGET = 0.25

# TensorRT-LLM's context_chunking_policy under which a step is shared equally between prompts.
EQUAL_PROGRESS = "equal_progress"


def prefill_budget_tokens(
    tightest_target_s: float,
    prompt_token_s: float | None,
    max_num_tokens: int | None,
    chunking: str | None = None,
) -> int | None:
    """The prompt tokens of later lanes an in-flight engine may hold unprefilled: what costs
    PREFILL_SHARE_OF_TARGET of the tightest lane's target where the engine's cost per prompt
    token is known (at most two of its steps' max_num_tokens), else two steps' max_num_tokens
    (one the engine runs, one ready for the next); None where neither is known.

    An engine that chunks prompts by `equal_progress` (`chunking`, TensorRT-LLM's
    context_chunking_policy) gives every prompt in its context phase a share of each step and
    takes at most max_num_tokens a step, so a short prompt arriving is in the next step whatever
    long prompts it holds: the engine bounds the long work ahead of it by itself. There a budget
    is kept only where one step's max_num_tokens costs more than the share (a large step, e.g.
    8,192 tokens on a GPU), and is None where the cost is unknown or a step fits the share; a
    budget there would only serialize the later lanes' prompts (measured on the CPU engine:
    `bench --plan budget`, docs/benchmarks.md). Under first_come_first_served a prompt waits for
    every prompt ahead of it, and the budget is what bounds that wait."""
    steps = 2 * max_num_tokens if max_num_tokens else None
    tokens = None
    if prompt_token_s is not None and prompt_token_s > 0:
        tokens = max(1, int(PREFILL_SHARE_OF_TARGET * tightest_target_s / prompt_token_s))
    if chunking == EQUAL_PROGRESS:
        if tokens is None or max_num_tokens is None or tokens >= max_num_tokens:
            return None
        return tokens
    if tokens is None:
        return steps
    return tokens if steps is None else min(tokens, steps)


class Batching(StrEnum):
    """How the engine forms its batches (TensorRT-LLM's `gpt_model_type`)."""

    INFLIGHT = "inflight"  # inflight_fused_batching: rows join and leave at every step
    STATIC = "static"  # V1: one padded batch at a time, run until its longest row is done


class StepCost(Protocol):
    """What an engine step costs, where the engine says (an emulated engine's cost profile)."""

    @property
    def per_prompt_token_s(self) -> float: ...

    def prefill_s(self, prompt_tokens: int) -> float: ...


@dataclass(frozen=True)
class EngineProfile:
    """The engine as the backend reports it once."""

    batching: Batching
    max_batch_size: int  # rows one request may carry (Triton's max_batch_size)
    batches_at_once: int = 1  # engine batches that run at the same time (instances x endpoints)
    max_num_sequences: int | None = None  # rows the engine runs at once, where it says
    max_num_tokens: int | None = None  # tokens one engine step takes, where it says
    kv_total_blocks: int | None = None  # the paged KV pool, where it can be read
    kv_free_blocks: int | None = None
    # Whether the engine reserves prompt + max_tokens when it admits a sequence (TensorRT-LLM's
    # guaranteed_no_evict, its default) rather than allocating as tokens come (max_utilization).
    reserves_max_tokens: bool = True
    # How prompts in their context phase share a step, where the engine chunks them
    # (TensorRT-LLM's context_chunking_policy; None: it does not chunk, or does not say).
    context_chunking: str | None = None
    # What an engine step costs, where the engine says, and the factor its steps are slowed by;
    # lane targets and the prefill budget follow it.
    step_cost: StepCost | None = None
    time_scale: float = 1.0
    # Whether the engine serves a prompt's leading blocks from its KV cache where it holds them
    # (TensorRT-LLM's enable_kv_cache_reuse): shared blocks are held once, not per request.
    kv_cache_reuse: bool = False

    def prefill_s(self, prompt_tokens: int) -> float | None:
        """An idle engine's time to first token for a prompt, where the cost is known."""
        if self.step_cost is None:
            return None
        return self.step_cost.prefill_s(prompt_tokens) * self.time_scale

    def prompt_token_s(self) -> float | None:
        """What one more prompt token adds to a step, where the cost is known."""
        if self.step_cost is None:
            return None
        return self.step_cost.per_prompt_token_s * self.time_scale

    def sequences(self) -> int:
        """Sequences the engine runs at once: its max_num_sequences where it says, else
        Triton's max_batch_size (TensorRT-LLM's engine batch), times the batches it runs at
        once (instances x endpoints)."""
        return (self.max_num_sequences or self.max_batch_size) * self.batches_at_once


@dataclass(frozen=True)
class Pinned:
    """What the operator's policy section sets itself, so the engine's profile leaves it be."""

    max_in_flight: bool = False  # queue.max_in_flight or policy.kv.max_in_flight
    continuous_batching: bool = False
    max_batches_in_flight: bool = False
    lane_targets: frozenset[str] = frozenset()  # lanes whose ttft_target_s is set
    prefill_budget: bool = False
    reserve_max_tokens: bool = False
    predict_quantile: bool = False


def policy_for_engine(base: PolicyConfig, engine: EngineProfile, pinned: Pinned) -> PolicyConfig:
    """`base` with what the engine's profile decides, where `pinned` leaves it: as many
    requests in flight as the engine runs sequences; a static engine gets no continuous
    batching and as many batches in flight as it runs at once; an in-flight engine batches
    continuously with no batch limit, its lanes' TTFT targets follow the engine's step cost
    where it states one (core/slo.py's rule), and the later lanes' unprefilled prompt tokens
    stay within a budget from that cost or two steps' max_num_tokens
    (`prefill_budget_tokens()`; none where the engine chunks prompts by equal_progress).
    A static engine refuses a request with more rows than it runs (max_num_sequences) or than
    a request may carry (max_batch_size), so its rows in flight are capped there; an in-flight
    engine merely queues what it cannot run yet. On an in-flight engine the KV mirror
    reserves as the engine allocates (`kv.reserve_max_tokens` under guaranteed_no_evict; the
    median predicted output under max_utilization)."""
    static = engine.batching is Batching.STATIC
    changes: dict[str, Any] = {}
    if not pinned.max_in_flight:
        # As many sequences as the engine runs: a 256-sequence engine is not held to 16.
        base = dataclasses.replace(
            base, kv=dataclasses.replace(base.kv, max_in_flight=engine.sequences())
        )
        changes["kv"] = base.kv
    if not pinned.continuous_batching:
        changes["continuous_batching"] = not static
    if not pinned.max_batches_in_flight:
        changes["max_batches_in_flight"] = engine.batches_at_once if static else None
    lanes = base.lanes
    if not static and engine.step_cost is not None:
        # The engine says what a step costs: each lane works to the one SLO rule's bound on it
        # (core/slo.py), unless the policy section pins the lane's target.
        targets = lane_targets(
            ((lane.name, lane.min_prompt_tokens) for lane in lanes),
            lambda tokens: engine.prefill_s(tokens) or 0.0,
        )
        lanes = tuple(
            lane
            if lane.name in pinned.lane_targets
            else dataclasses.replace(lane, ttft_target_s=targets[lane.name])
            for lane in lanes
        )
        if lanes != base.lanes:
            changes["lanes"] = lanes
    if not pinned.prefill_budget and not static:
        # From the engine's cost per prompt token where it says, else two of its steps.
        tightest = min(lane.ttft_target_s for lane in lanes)
        budget = prefill_budget_tokens(
            tightest, engine.prompt_token_s(), engine.max_num_tokens, engine.context_chunking
        )
        if budget is not None:
            changes["prefill_budget_tokens"] = budget
    if static:
        per_batch = min(engine.max_batch_size, engine.max_num_sequences or 1 << 30)
        rows = min(base.kv.max_in_flight, per_batch * engine.batches_at_once)
        if rows != base.kv.max_in_flight:
            changes["kv"] = dataclasses.replace(base.kv, max_in_flight=rows)
    if not static and not pinned.reserve_max_tokens:
        # The mirror reserves as the engine allocates: prompt + max_tokens under
        # guaranteed_no_evict, the predicted output under max_utilization.
        kv = changes.get("kv", base.kv)
        if kv.reserve_max_tokens != engine.reserves_max_tokens:
            changes["kv"] = dataclasses.replace(kv, reserve_max_tokens=engine.reserves_max_tokens)
    if not static and not engine.reserves_max_tokens and not pinned.predict_quantile:
        # An engine that allocates as tokens come: reserve each request's median output (many
        # rows' outputs sum close to their medians; the reserve absorbs the spread and a row
        # that outruns grows). The 90th percentile, summed over every row, held the KV bench at
        # 0.68x Triton alone.
        changes["predict"] = dataclasses.replace(
            base.predict, quantile=MEDIAN_FOR_ALLOCATING_ENGINES
        )
    return dataclasses.replace(base, **changes) if changes else base
