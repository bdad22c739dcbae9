"""The shared-prefix bench's workloads and their arithmetic (issue 32): pure, unit-tested.

Three workloads, token ids drawn from a seed (the emulated engine reads no text):
- `sessions`: multi-turn chat. SYSTEM_PROMPTS distinct system prompts of SYSTEM_TOKENS each,
  each shared by many sessions; a session's turn k resends the system prompt, the k earlier
  user/assistant exchanges and a new user message, TURN_GAP_S after the previous turn.
- `fewshot`: few-shot prompts, FEWSHOT_HEADERS headers of FEWSHOT_TOKENS each shared by many
  requests, a question each; no session id.
- `control`: every prompt its own (nothing to share).

`ideal_reused` is what one replica with an unbounded cache would serve from cache: for each
request, the longest run of leading full blocks any earlier request had (at most the prompt's
length less one token, as the engine always feeds the last one). The hit rates the bench
reports are over it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from scheduler_svc.core.prefix import block_keys

SYSTEM_PROMPTS = 16
SYSTEM_TOKENS = 2_000
USER_TOKENS = 48
ANSWER_TOKENS = 32  # what a turn asks for, and what the next turn resends as the answer
TURNS = 4
TURN_GAP_S = 2.0  # emulated seconds from one turn's send to the next's
FEWSHOT_HEADERS = 8
FEWSHOT_TOKENS = 1_500
QUESTION_TOKENS = 96
CONTROL_TOKENS = 2_100
WORKLOADS = ("sessions", "fewshot", "control")


@dataclass(frozen=True)
class PrefixRequest:
    request_id: str
    at_s: float  # emulated seconds from the run's start
    prompt: tuple[int, ...]
    max_tokens: int
    session: str = ""


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1_000, 100_000) for _ in range(n))


def workload(
    name: str, rate: float, window_s: float, seed: int, content_seed: int | None = None
) -> list[PrefixRequest]:
    """`name`'s requests at `rate` requests per emulated second over `window_s`, in send order
    (Poisson arrivals of sessions or requests). `seed` draws the arrivals and which shared
    prompt each one uses; `content_seed` (default: `seed`) the tokens, so runs can offer the
    same arrivals with prompts no earlier run cached."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    content = seed if content_seed is None else content_seed
    arrivals = random.Random(f"{name}/{seed}")
    tokens = random.Random(f"{name}/{content}/tokens")
    shared = random.Random(f"shared/{content}")  # the same system prompts and headers everywhere
    out: list[PrefixRequest] = []
    if name == "sessions":
        systems = [_tokens(shared, SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
        t, n = 0.0, 0
        while True:
            t += arrivals.expovariate(rate / TURNS)  # sessions start at rate / TURNS
            if t >= window_s:
                break
            history = systems[arrivals.randrange(SYSTEM_PROMPTS)]
            for turn in range(TURNS):
                history = history + _tokens(tokens, USER_TOKENS)
                out.append(
                    PrefixRequest(
                        f"s{n}-t{turn}", t + turn * TURN_GAP_S, history, ANSWER_TOKENS, f"s{n}"
                    )
                )
                history = history + _tokens(tokens, ANSWER_TOKENS)
            n += 1
    else:
        headers = [_tokens(shared, FEWSHOT_TOKENS) for _ in range(FEWSHOT_HEADERS)]
        t, n = 0.0, 0
        while True:
            t += arrivals.expovariate(rate)
            if t >= window_s:
                break
            header = headers[arrivals.randrange(FEWSHOT_HEADERS)]
            if name == "fewshot":
                prompt = header + _tokens(tokens, QUESTION_TOKENS)
            else:
                prompt = _tokens(tokens, CONTROL_TOKENS)
            out.append(PrefixRequest(f"r{n}", t, prompt, ANSWER_TOKENS))
            n += 1
    return sorted(out, key=lambda r: r.at_s)


def ideal_reused(requests: list[PrefixRequest], tokens_per_block: int) -> int:
    """Prompt tokens one replica with an unbounded cache would serve from cache, in send
    order (each request's longest leading run of full blocks that an earlier one had)."""
    seen: set[bytes] = set()
    total = 0
    for r in requests:
        keys = block_keys(r.prompt, tokens_per_block)
        usable = (len(r.prompt) - 1) // tokens_per_block
        run = 0
        while run < usable and keys[run] in seen:
            run += 1
        total += run * tokens_per_block
        seen.update(keys)
    return total
