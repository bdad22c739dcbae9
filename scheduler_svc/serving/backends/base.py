"""What the sidecar needs from a backend: its engine profile (`core/engine.py`, reported once
at start), its rows' tokens, its KV counts."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.core.engine import EngineProfile
from scheduler_svc.core.routing import RouteClass


@dataclass(frozen=True)
class GenerationInput:
    """One request row as the engine sees it: token ids in, token ids out."""

    request_id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    end_id: int
    pad_id: int
    sampling: Sampling = field(default_factory=Sampling)
    # Token sequences that end generation (the model's other end tokens), sent as TensorRT-LLM's
    # stop_words_list; their tokens are part of the output.
    stop_words: tuple[tuple[int, ...], ...] = ()
    # Token sequences never to generate (bad_words_list).
    bad_words: tuple[tuple[int, ...], ...] = ()
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
    # The engine's own end of the request came with these ids (Triton's final flag): no more
    # follow for this row.
    last: bool = False


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
        """The engine's profile (read once, at start); BackendUnavailableError while it cannot
        be read."""
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
