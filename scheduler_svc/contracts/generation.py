"""A generation request as every front hands it to the service, and what comes back: the text
(or token ids) and sampling asked for, each step's `Delta` and the one `Final`. Fronts build
these from their wire formats and present them back; the service validates and serves them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.core.types import Urgency


class Finish(StrEnum):
    LENGTH = "length"
    STOP = "stop"


@dataclass(frozen=True)
class GenerationParams:
    """A request as either front hands it over, before validation."""

    request_id: str = ""
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    # None takes the configured default.
    max_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    # The engine's end and pad token ids for this request; None takes the model's.
    end_id: int | None = None
    pad_id: int | None = None
    stop: tuple[str, ...] = ()
    # TensorRT-LLM's word lists, as text: tokenized here (as the ensemble's preprocessing does)
    # and sent to the engine. Stop words end generation and are part of the output; bad words
    # are never generated.
    stop_words: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()
    # The same as token ids (the engine contract's stop_words_list / bad_words_list).
    stop_word_ids: tuple[tuple[int, ...], ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # Each generated token's log probability back, where the engine produces them.
    return_log_probs: bool = False
    urgency: Urgency = Urgency.STANDARD
    tenant: str = ""
    # A conversation's id: a rollout keeps every request of a session on one version.
    session: str = ""
    # The engine precision the client asks for (a value `routes` names, e.g. fp16 or awq).
    precision: str = ""
    queue_timeout_s: float | None = None
    # Seconds left until the client's deadline, when it set one.
    time_remaining_s: float | None = None


@dataclass(frozen=True)
class Delta:
    text: str = ""
    token_ids: tuple[int, ...] = ()
    # One per token id, where the request asked for log probabilities (None otherwise): its
    # log probability, and the text it added (what OpenAI's logprobs objects show).
    log_probs: tuple[float, ...] | None = None
    token_texts: tuple[str, ...] | None = None
    # No token follows (the request reached max_tokens or a stop string): only text the
    # detokenizer still held, then the Final. A stream front may send it with the Final.
    last: bool = False

    def __add__(self, later: Delta) -> Delta:
        """This delta and a later one as one (a front that holds back a delta with no text)."""
        probs = texts = None
        if self.log_probs is not None or later.log_probs is not None:
            probs = (self.log_probs or ()) + (later.log_probs or ())
        if self.token_texts is not None or later.token_texts is not None:
            texts = (self.token_texts or ()) + (later.token_texts or ())
        joined = (self.text + later.text, self.token_ids + later.token_ids)
        return Delta(*joined, probs, texts, self.last or later.last)


@dataclass(frozen=True)
class Final:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish: Finish
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float
    total_ms: float
    lane: str
    log_probs: tuple[float, ...] | None = None  # one per token id, where asked
    token_texts: tuple[str, ...] | None = None  # the text each id added, where asked
