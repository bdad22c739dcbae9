"""The speculative-decoding gate: does a draft model agree with its target often enough?

The source document lets the cold path use speculative decoding only when the draft and the
target model's n-gram overlap is above 92 %. `scheduler-svc spec-gate` runs both engine
models greedily on a prompt set (the same prompt ids, the same max_tokens) and measures, for
n = 1..4, the share of the target's n-grams that the draft's output also has (counted with
multiplicity, summed over every prompt). The gate passes when the smallest of them (the
4-gram one, in practice) is at least the threshold: a draft that agrees token by token but
not in sequence would have its proposals refused by the target anyway.

The result is a small JSON file; a sidecar with `spec_gate` configured reads it again every
`check_interval_s` and sends its gated lane to the speculative group only while it says
passed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from scheduler_svc.config import TritonConfig
from scheduler_svc.contracts.gate_result import GateResult
from scheduler_svc.errors import ConfigError
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.triton import TritonBackend

DEFAULT_THRESHOLD = 0.92  # the source document's figure
MAX_N = 4
MAX_PROMPTS = 10_000


def ngrams(ids: Sequence[int], n: int) -> Counter[tuple[int, ...]]:
    return Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))


def overlap(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_n: int = MAX_N
) -> dict[str, float]:
    """For each n: the target's n-grams the draft also produced (clipped counts) over all the
    target's n-grams, summed over the (draft, target) pairs. An n with no target n-gram at all
    counts as no overlap."""
    out = {}
    for n in range(1, max_n + 1):
        shared = total = 0
        for draft, target in pairs:
            theirs = ngrams(target, n)
            shared += sum((ngrams(draft, n) & theirs).values())
            total += sum(theirs.values())
        out[str(n)] = shared / total if total else 0.0
    return out


def judge(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    threshold: float,
    draft: str,
    target: str,
) -> GateResult:
    shares = overlap(pairs)
    return GateResult(
        passed=bool(pairs) and min(shares.values()) >= threshold,
        threshold=threshold,
        overlap=shares,
        prompts=len(pairs),
        draft=draft,
        target=target,
        at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


@dataclass(frozen=True)
class ModelAddress:
    url: str
    model: str

    @classmethod
    def parse(cls, text: str) -> ModelAddress:
        url, slash, model = text.rpartition("/")
        if not slash or not url or not model or ":" not in url:
            raise ConfigError(f"{text!r}: expected HOST:PORT/MODEL")
        return cls(url, model)

    def __str__(self) -> str:
        return f"{self.url}/{self.model}"


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; blank lines skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompts: cannot read {path}: {exc}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts: {path} has no prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ConfigError(f"--prompts: {len(prompts)} prompts, at most {MAX_PROMPTS}")
    return prompts


async def greedy_outputs(
    address: ModelAddress,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    end_id: int,
    pad_id: int,
    concurrency: int = 4,
) -> list[list[int]]:
    """Each prompt's greedy output from one engine model (tokens, end token excluded)."""
    backend = TritonBackend(TritonConfig(url=address.url, engine_model=address.model))
    await backend.start()
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, ids: Sequence[int]) -> list[int]:
        row = GenerationInput(f"spec-gate-{index}", ids, max_tokens, end_id, pad_id)
        out: list[int] = []
        async with gate, contextlib.aclosing(backend.stream(row)) as answers:
            async for tokens in answers:
                out += tokens.ids
        return [t for t in out if t != end_id]

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await backend.close()
