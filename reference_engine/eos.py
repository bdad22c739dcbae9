"""A synthetic end-of-sequence model: random weights never choose to stop, a trained model does.

With `eos_model: lognormal`, each row ends with its end id after a number of generated tokens
drawn, deterministically from the prompt's tokens and `eos_seed`, from a lognormal distribution
whose mean is `eos_mean_tokens` and whose log has standard deviation `eos_sigma`. The same
prompt always gets the same length (greedy outputs stay reproducible); different prompts spread
as real outputs do, most short, a few long. `max_tokens` still caps a row; `min_length` still
holds the end back; a request with end id -1 asked for no end and gets none.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from statistics import NormalDist

_UNIT = NormalDist()


def natural_length(prompt: Sequence[int], mean_tokens: float, sigma: float, seed: int) -> int:
    """Generated tokens after which this prompt's row would end (at least 1)."""
    digest = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little"))
    for token in prompt:
        digest.update(token.to_bytes(4, "little", signed=True))
    # A uniform draw in (0, 1), never 0 or 1, from the hash.
    u = (int.from_bytes(digest.digest(), "little") + 0.5) / 2**64
    mu = math.log(mean_tokens) - sigma * sigma / 2  # the lognormal's mean is then mean_tokens
    return max(1, round(math.exp(mu + sigma * _UNIT.inv_cdf(u))))
