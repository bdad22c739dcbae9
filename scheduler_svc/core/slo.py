"""The one SLO rule every measurement uses (the bench, the simulator, the docs' tables).

A lane's P99 time to first token must be within `lane_slo_s` of its unloaded median on that
engine: SLO_FACTOR times it, at least SLO_FLOOR_S (below that one long step decides a P99).
A run meets the SLO when every lane with served requests does and at most MAX_REFUSED of its
requests were refused or failed; QPS at the SLO is the highest offered rate that meets it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

SLO_FACTOR = 5.0
SLO_FLOOR_S = 0.25
MAX_REFUSED = 0.01


def lane_slo_s(unloaded_median_s: float) -> float:
    """A lane's bound on P99 TTFT from its unloaded median TTFT on the engine."""
    return max(SLO_FLOOR_S, SLO_FACTOR * unloaded_median_s)


def typical_prompt(min_prompt_tokens: int) -> int:
    """The prompt a lane stands for when its unloaded time is computed rather than measured:
    twice its lower bound, at least 128 tokens (hot 128, warm 512, cold 2,048 by default)."""
    return max(128, 2 * min_prompt_tokens)


def lane_targets(
    lanes: Iterable[tuple[str, int]], prefill_s: Callable[[int], float]
) -> dict[str, float]:
    """Each lane's TTFT target by this rule where the engine's unloaded time is known
    (`prefill_s`: an idle engine's time to first token for a prompt; `lanes`: (name, lower
    bound in prompt tokens))."""
    return {name: lane_slo_s(prefill_s(typical_prompt(low))) for name, low in lanes}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def meets(
    ttft_s: Mapping[str, Sequence[float]], slo_s: Mapping[str, float], requests: int, served: int
) -> bool:
    """Every lane's P99 TTFT (`ttft_s`: the served requests' TTFTs per lane) within its bound,
    and at most MAX_REFUSED of `requests` not served."""
    if requests <= 0:
        return False
    for lane, values in ttft_s.items():
        worst = percentile(values, 99)
        if worst is not None and worst > slo_s[lane]:
            return False
    return (requests - served) / requests <= MAX_REFUSED
