"""Requests and sequences as the reference engine tracks them.

One Triton request carries one or more rows; each row is a `Sequence` with its own prompt,
output budget and KV blocks. The engine owns the sequence ids (a counter), so ordering never
depends on object identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    LENGTH = "length"
    END_ID = "end_id"
    STOP_WORDS = "stop_words"
    STOPPED = "stopped"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters with TensorRT-LLM's meaning: top_k 0 and top_p 0 mean greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1 or (self.top_k == 0 and self.top_p == 0)


@dataclass(frozen=True)
class RowSpec:
    """One row of a request as parsed from its tensors."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    end_id: int
    pad_id: int
    # Token sequences that end the row once generated (TensorRT-LLM's stop_words_list); unlike
    # end_id, the stop word's tokens are part of the output.
    stop_words: tuple[tuple[int, ...], ...] = ()


@dataclass(eq=False)
class Sequence:
    """One row in flight. `num_cached` counts KV slots holding valid keys, pad slots included."""

    seq_id: int
    request: EngineRequest
    row: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    end_id: int
    pad_id: int
    stop_words: tuple[tuple[int, ...], ...] = ()
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    pad: int = 0
    finish: FinishReason | None = None
    num_sent: int = 0

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass(eq=False)
class EngineRequest:
    """A Triton request: its rows, how it wants answers, and an opaque handle for the sink."""

    key: str
    streaming: bool
    sampling: Sampling
    handle: object
    rows: list[Sequence] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(row.done for row in self.rows)
