"""How a request's tokens are chosen: one type from every front to the backend.

Each front reads its wire's names into a `Sampling` (OpenAI's `temperature`, KServe's
`random_seed`, ...), the service checks it once, and the Triton client writes it as
TensorRT-LLM's tensors; adding a parameter adds a field here, its parsing on each wire that
carries it, its check and its tensor. The reference engine, on the far side of Triton, reads
its own from the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """With TensorRT-LLM's meaning; the defaults decode greedily and change nothing."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 0.0  # 0: no nucleus cut
    seed: int = 0
    # The fewest tokens before an end token may end the answer.
    min_length: int = 0
    # Repetition divides a positive logit of every token seen (prompt included); presence and
    # frequency subtract from the logits of tokens generated so far, once and per occurrence.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
