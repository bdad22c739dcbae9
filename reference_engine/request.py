"""Requests and sequences as the reference engine tracks them.

One Triton request carries one or more rows; each row is a `RunningSequence` with its own prompt,
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
    # Penalties with TensorRT-LLM's meaning: repetition divides a positive logit (multiplies a
    # negative one) of every token seen, prompt included; presence and frequency subtract from
    # the logits of tokens generated so far, once and per occurrence.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1 or (self.top_k == 0 and self.top_p == 0)

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


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
    # Token sequences never generated (bad_words_list): a word's last token is banned where the
    # output already ends with the rest of it.
    bad_words: tuple[tuple[int, ...], ...] = ()
    # The end token (and stop words) cannot end the row before this many tokens.
    min_length: int = 0
    # This row's sampling; None: the request's.
    sampling: Sampling | None = None
    # Whether each generated token's log probability is returned (return_log_probs).
    return_log_probs: bool = False


@dataclass(eq=False)
class RunningSequence:
    """One row in flight. `num_cached` counts KV slots holding valid keys, pad slots included."""

    seq_id: int
    request: EngineRequest
    row: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    end_id: int
    pad_id: int
    stop_words: tuple[tuple[int, ...], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_length: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    pad: int = 0
    finish: FinishReason | None = None
    num_sent: int = 0
    context_len: int = 0  # tokens its context phase feeds (prompt, plus output on a recompute)
    # KV cache reuse: its prompt's full blocks' keys (computed at its first admission), and how
    # many of its leading blocks are cached in the pool.
    keys: list[bytes] | None = None
    registered: int = 0
    natural_len: int | None = None  # the synthetic end-of-sequence model's length (eos.py)
    return_log_probs: bool = False
    # One per generated token, where return_log_probs asks: the log probability of the token
    # under the distribution it was chosen from.
    log_probs: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def in_context(self) -> bool:
        """Admitted, and its context not all fed yet (chunked context spans several steps)."""
        return self.num_cached < self.context_len

    @property
    def context_left(self) -> int:
        return max(0, self.context_len - self.num_cached)

    def banned(self) -> list[int]:
        """Tokens this row may not generate next: bad words' last tokens where the output ends
        with the rest of the word, and the end token while under min_length."""
        out = []
        generated = self.generated
        for word in self.bad_words:
            head = word[:-1]
            if (
                len(head) <= len(generated)
                and tuple(generated[len(generated) - len(head) :]) == head
            ):
                out.append(word[-1])
        if len(generated) < self.min_length and self.end_id >= 0:
            out.append(self.end_id)
        return out


@dataclass(eq=False)
class EngineRequest:
    """A Triton request: its rows, how it wants answers, and an opaque handle for the sink."""

    key: str
    streaming: bool
    sampling: Sampling
    handle: object
    rows: list[RunningSequence] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(row.done for row in self.rows)
