"""The bounds on a request, checked before any work is done on it: sizes of what the client
sent, the sampling fields as the engine will see them, word lists and ids within the
vocabulary. Each refusal is BadRequestError naming the field and the allowed range."""

from __future__ import annotations

import math
import struct
from collections.abc import Set

from scheduler_svc.config import ModelConfig
from scheduler_svc.contracts.generation import GenerationParams
from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.errors import BadRequestError, clip
from scheduler_svc.serving import auth

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_WORD_TOKENS = 64
MAX_WORDS = 64  # stop or bad words per request (the engine's own bound)
MAX_REQUEST_ID_CHARS = 256
MAX_TENANT_CHARS = auth.MAX_TENANT_CHARS


def float32(value: float) -> float:
    """`value` as the engine receives it (a 32-bit float): too large becomes infinite, too small
    becomes 0, NaN stays NaN."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def check_sizes(params: GenerationParams, model: ModelConfig, precisions: Set[str]) -> None:
    """Bounds on what the client sent, checked before any work is done on it."""
    if len(params.request_id) > MAX_REQUEST_ID_CHARS:
        raise BadRequestError(
            f"request_id: {len(params.request_id)} characters, at most {MAX_REQUEST_ID_CHARS}"
        )
    if len(params.tenant) > MAX_TENANT_CHARS:
        raise BadRequestError(
            f"tenant: {len(params.tenant)} characters, at most {MAX_TENANT_CHARS}"
        )
    for name in ("session", "precision"):
        if len(getattr(params, name)) > MAX_TENANT_CHARS:
            raise BadRequestError(
                f"{name}: {len(getattr(params, name))} characters, at most {MAX_TENANT_CHARS}"
            )
    if params.precision and params.precision not in precisions:
        known = ", ".join(sorted(precisions)) or "none (no route names a precision)"
        raise BadRequestError(
            f"precision: {clip(params.precision)!r} is not routed; known: {known}"
        )
    if params.prompt is not None:
        limit = model.prompt_bytes_limit
        # Every character is at least one byte: a prompt longer in characters is refused
        # without encoding it.
        too_long = len(params.prompt) > limit
        if too_long or len(params.prompt.encode("utf-8", "surrogatepass")) > limit:
            raise BadRequestError(
                f"prompt: more than {limit} bytes (model.max_prompt_bytes, derived from "
                f"max_input_tokens {model.max_input_tokens})"
            )


def check_sampling(sampling: Sampling, max_tokens: int, vocab_size: int) -> None:
    """Each field within what the engine takes. Floats are checked as the engine will see
    them (32-bit): 1e39 is finite here and infinite there, where it would fail every row
    batched with it."""
    temperature = float32(sampling.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise BadRequestError(
            f"temperature: {sampling.temperature} is not a finite 32-bit number >= 0"
        )
    if not 0 <= sampling.top_p <= 1:
        raise BadRequestError(f"top_p: {sampling.top_p} is outside 0..1")
    if not 0 <= sampling.top_k <= vocab_size:
        raise BadRequestError(
            f"top_k: {sampling.top_k} is outside 0..{vocab_size} (the vocabulary)"
        )
    if not 0 <= sampling.seed < 2**64:
        raise BadRequestError(f"seed: {sampling.seed} is outside 0..2**64-1")
    if not 0 <= sampling.min_length <= max_tokens:
        raise BadRequestError(
            f"min_length: {sampling.min_length}, allowed 0..{max_tokens} (max_tokens)"
        )
    penalty = float32(sampling.repetition_penalty)
    if not (math.isfinite(penalty) and penalty > 0):
        raise BadRequestError(
            f"repetition_penalty: {sampling.repetition_penalty} is not a positive 32-bit number"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(float32(getattr(sampling, name))):
            raise BadRequestError(
                f"{name}: {getattr(sampling, name)} is not a finite 32-bit number"
            )


def check_request(
    params: GenerationParams, model: ModelConfig, vocab_size: int, precisions: Set[str]
) -> int:
    """Validate what does not need the tokenizer; return the effective max_tokens."""
    check_sizes(params, model, precisions)
    max_tokens = model.default_max_tokens if params.max_tokens is None else params.max_tokens
    if not 1 <= max_tokens <= model.max_output_tokens:
        raise BadRequestError(
            f"max_tokens: {params.max_tokens}, allowed 1..{model.max_output_tokens}"
        )
    check_sampling(params.sampling, max_tokens, vocab_size)
    if len(params.stop) > MAX_STOP_STRINGS:
        raise BadRequestError(f"stop: {len(params.stop)} strings, at most {MAX_STOP_STRINGS}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in params.stop):
        raise BadRequestError(f"stop: each string needs 1..{MAX_STOP_CHARS} characters")
    for name in ("stop_words", "bad_words"):
        words = getattr(params, name)
        if len(words) > MAX_WORDS:
            raise BadRequestError(f"{name}: {len(words)} words, at most {MAX_WORDS}")
        if any(len(w) > MAX_STOP_CHARS for w in words):
            raise BadRequestError(f"{name}: each word needs 1..{MAX_STOP_CHARS} characters")
    for name in ("stop_word_ids", "bad_word_ids"):
        words = getattr(params, name)
        if len(words) > MAX_WORDS or any(not 0 < len(w) <= MAX_WORD_TOKENS for w in words):
            raise BadRequestError(
                f"{name}: at most {MAX_WORDS} words of 1..{MAX_WORD_TOKENS} tokens"
            )
        if any(not 0 <= t < vocab_size for w in words for t in w):
            raise BadRequestError(f"{name}: a token is outside the vocabulary")
    if params.end_id is not None and not -1 <= params.end_id < vocab_size:
        raise BadRequestError(f"end_id: {params.end_id} is outside -1..{vocab_size - 1}")
    if params.pad_id is not None and not 0 <= params.pad_id < vocab_size:
        raise BadRequestError(f"pad_id: {params.pad_id} is outside 0..{vocab_size - 1}")
    if params.queue_timeout_s is not None and params.queue_timeout_s <= 0:
        raise BadRequestError(f"timeout: {params.queue_timeout_s} s is not positive")
    return max_tokens
