"""Chunked context: how one engine step's token budget is split between prompts being prefilled.

One rule for the reference engine (engine/batcher.py) and the simulator's engine
(sim/engine.py), so both model the same thing; the names are TensorRT-LLM's
`ContextChunkingPolicy`. Pure: lists of token counts in, token counts out.

Invariants: 0 <= sizes[i] <= wants[i]; sum(sizes) <= budget; the budget is used up whenever the
prompts want that much.
"""

from __future__ import annotations


def split_budget(wants: list[int], budget: int, policy: str) -> list[int]:
    """Tokens each prompt in its context phase feeds this step (`wants`: what each has left,
    oldest first). `first_come_first_served`: the oldest take what they need; `equal_progress`:
    equal shares in rounds (a prompt needing less than its share leaves the rest to the others;
    what does not divide goes to the oldest)."""
    sizes = [0] * len(wants)
    if policy == "first_come_first_served":
        for i, want in enumerate(wants):
            sizes[i] = max(0, min(want, budget))
            budget -= sizes[i]
        return sizes
    while budget > 0:
        open_ = [i for i, size in enumerate(sizes) if size < wants[i]]
        if not open_:
            break
        share = max(1, budget // len(open_))
        for i in open_:
            take = min(share, wants[i] - sizes[i], budget)
            sizes[i] += take
            budget -= take
    return sizes
