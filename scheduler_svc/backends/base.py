"""What the sidecar needs from a backend: stream the tokens of one request, and say if ready."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GenerationInput:
    """One request as the engine sees it: token ids in, token ids out."""

    request_id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    end_id: int
    pad_id: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    # Seconds the client still waits; the backend call is cut off then.
    timeout_s: float | None = None


class Backend(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ready(self) -> bool:
        """Whether the backend and its model are ready now."""
        ...

    def stream(self, request: GenerationInput) -> AsyncGenerator[list[int], None]:
        """Yield newly generated ids as they come; closing the iterator cancels the request."""
        ...
