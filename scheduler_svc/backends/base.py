"""What the sidecar needs from a backend: its engine profile, its rows' tokens, its KV counts.

A backend reports an `EngineProfile` once, at start: how the engine batches, how many rows a
request may carry, how many batches it runs at once, its token budget and KV pool. Everything
the shell decides about dispatch (which batch runner, how many batches the policy keeps in the
engine, whether buckets wait to fill) is derived from that one fact.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from scheduler_svc.core.routing import RouteClass
from scheduler_svc.profiles import CostProfile


class Batching(StrEnum):
    """How the engine forms its batches (TensorRT-LLM's `gpt_model_type`)."""

    INFLIGHT = "inflight"  # inflight_fused_batching: rows join and leave at every step
    STATIC = "static"  # V1: one padded batch at a time, run until its longest row is done


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
    # What an engine step costs, where the engine says (an emulated engine's cost profile),
    # and the factor its steps are slowed by; lane targets and the prefill budget follow it.
    step_cost: CostProfile | None = None
    time_scale: float = 1.0

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
class GenerationInput:
    """One request row as the engine sees it: token ids in, token ids out."""

    request_id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    end_id: int
    pad_id: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    # Token sequences that end generation (the model's other end tokens), sent as TensorRT-LLM's
    # stop_words_list; their tokens are part of the output.
    stop_words: tuple[tuple[int, ...], ...] = ()
    # Token sequences never to generate (bad_words_list), the fewest tokens before the end
    # token may end it, and TensorRT-LLM's penalties.
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_length: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Seconds the client still waits; the backend call is cut off then.
    timeout_s: float | None = None
    # Whether each generated id comes with its log probability (return_log_probs).
    return_log_probs: bool = False
    # What routing to a backend group reads (tenant, session, precision; the lane at dispatch).
    route: RouteClass = field(default_factory=RouteClass)


@dataclass(frozen=True)
class Tokens:
    """Newly generated ids, with their log probabilities where the request asked for them."""

    ids: list[int]
    log_probs: list[float] | None = None


DEFAULT_ENGINE_MODEL = "tensorrt_llm"  # TensorRT-LLM's engine model, as its templates name it


class Backend(Protocol):
    @property
    def engine_model(self) -> str:
        """The model its requests go to (configured, or discovered once Triton answers)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ready(self) -> bool:
        """Whether the backend and its model are ready now."""
        ...

    async def health(self) -> list[tuple[str, bool]]:
        """(address, ready) of each endpoint behind this backend."""
        ...

    async def profile(self) -> EngineProfile:
        """The engine's profile (read once, at start)."""
        ...

    async def read_kv(self) -> tuple[int, int] | None:
        """The engine's (free, total) KV blocks now, or None when they cannot be read."""
        ...

    def stream(self, request: GenerationInput) -> AsyncGenerator[Tokens, None]:
        """Yield newly generated ids as they come; closing the iterator ends the request."""
        ...

    def stream_batch(
        self, request_id: str, rows: list[GenerationInput], timeout_s: float | None
    ) -> AsyncGenerator[tuple[int, Tokens], None]:
        """Every row in one request; yield (row index, new ids) as the engine streams them.
        Closing the iterator ends the request."""
        ...
