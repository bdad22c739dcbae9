"""Emulated timing: the engine keeps a GPU's time instead of computing a model.

With `timing: emulated` everything of the engine runs as it does with the model (batcher, paged
KV accounting, chunked context, max_utilization pauses, the synthetic end of sequence, stop
words, queue limits); only the model forward is replaced, by two things:

- `TokenSource`, a cheap deterministic stand-in for the model: every ordinary token of the
  vocabulary (no special ids) gets the same logit, and each step's token is a seeded draw from
  that uniform distribution, keyed by the row's prompt and position (and, for a sampled row, its
  random_seed), so the same request always gets the same tokens, however it is batched.
  What logits would change is given its exact meaning on that distribution: bad words and the
  end token under min_length are never drawn; presence and frequency penalties lower a
  generated token's weight to exp(-(presence + frequency x count)); a repetition penalty leaves
  equal (zero) logits as they are, so it changes nothing; log probabilities are the drawn
  token's under that distribution. Temperature, top_k and top_p only pick among tied logits:
  they change which token the seed picks, not the reported log probability.
- `StepPacer`, which makes a step last its modelled time: the cost profile's step time for the
  step's rows, context tokens read and prompt tokens fed, times `time_scale`. The wait runs from
  the step's start, so the engine's own work (planning, committing, answering the previous step)
  counts inside the step; back-to-back steps are chained (one starts where the last ended). A
  step whose real work overruns its modelled time is counted, not stretched further.

It times a GPU; it does not compute a model: its text is random ids, not language.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reference_engine.batcher import Sampled, Work
from reference_engine.config import EngineConfig
from reference_engine.request import RunningSequence as Row
from scheduler_svc.profiles import CostProfile

# DeepSeek-V4's tokenizer: ids 0-2 (begin, end, pad) and 128,000 and above are special.
FIRST_ORDINARY_ID = 3
FIRST_SPECIAL_ABOVE = 128_000
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of a 64-bit value."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class StepShape:
    """What a step costs on a GPU, counted as the cost profile counts it."""

    rows: int  # sequences that decode a token
    context_tokens: int  # cached tokens the step reads
    prompt_tokens: int  # prompt tokens fed (every chunk)


def step_shape(works: Sequence[Work]) -> StepShape:
    rows = context = prompt = 0
    for work in works:
        context += work.start
        if work.is_context:
            prompt += len(work.tokens)
        else:
            rows += 1
    return StepShape(rows, context, prompt)


def weighted_pick(u: float, lo: int, hi: int, weights: dict[int, float]) -> tuple[int, float]:
    """The token at cumulative share `u` (in [0, 1)) of ids [lo, hi), each of weight 1 but those
    in `weights`, and its probability."""
    inside = {t: w for t, w in weights.items() if lo <= t < hi}
    plain = (hi - lo) - len(inside)
    total = plain + sum(inside.values())
    r = u * total
    adjusted = sorted(inside)
    if r < plain:
        token = lo + int(r)
        for a in adjusted:  # the int(r)-th id of weight 1: step over the adjusted ones
            if a <= token:
                token += 1
            else:
                break
        return token, 1.0 / total
    r -= plain
    chosen = next(t for t in reversed(adjusted) if inside[t] > 0)
    for t in adjusted:
        r -= inside[t]
        if r < 0 and inside[t] > 0:
            chosen = t
            break
    return chosen, inside[chosen] / total


class TokenSource:
    """The emulated engine's model: seeded uniform draws over the ordinary vocabulary."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.lo = FIRST_ORDINARY_ID
        self.hi = min(cfg.model.vocab_size, FIRST_SPECIAL_ABOVE)
        self._keep = 4 * cfg.max_num_sequences
        self._prompt_keys: dict[int, int] = {}  # seq id -> its prompt's hash (a cache)

    def step(self, works: Sequence[Work], tables: Sequence[list[int]]) -> Sampled:
        """One token per emitting work, in order, with its log probability where asked."""
        tokens: list[int] = []
        log_probs: list[float | None] = []
        for work in works:
            if work.emits:
                token, probability = self.draw(work.seq)
                tokens.append(token)
                log_probs.append(math.log(probability) if work.seq.return_log_probs else None)
        if len(self._prompt_keys) > self._keep:
            running = {w.seq.seq_id for w in works}
            self._prompt_keys = {k: v for k, v in self._prompt_keys.items() if k in running}
        return Sampled(tokens, log_probs)

    def draw(self, seq: Row) -> tuple[int, float]:
        """The row's next token and its probability under the uniform source."""
        key = self._prompt_keys.get(seq.seq_id)
        if key is None:
            key = self._prompt_keys[seq.seq_id] = hash(seq.prompt) & _MASK  # ints: unsalted
        sampling = seq.sampling
        position = len(seq.generated)
        salt = 0 if sampling.greedy else _mix(sampling.seed + 1)
        u = _mix(key ^ _mix(position) ^ salt) / 2.0**64
        weights = self._weights(seq)
        if not weights:
            span = self.hi - self.lo
            return self.lo + int(u * span), 1.0 / span
        return weighted_pick(u, self.lo, self.hi, weights)

    def _weights(self, seq: Row) -> dict[int, float]:
        """Ids whose weight is not 1: banned ones 0, penalised generated ones below 1 (or above,
        for a negative penalty)."""
        sampling = seq.sampling
        weights: dict[int, float] = {}
        if seq.generated and (sampling.presence_penalty or sampling.frequency_penalty):
            counts: dict[int, int] = {}
            for token in seq.generated:
                counts[token] = counts.get(token, 0) + 1
            for token, count in counts.items():
                penalty = sampling.presence_penalty + sampling.frequency_penalty * count
                weights[token] = math.exp(-penalty)
        for token in seq.banned():
            weights[token] = 0.0
        return weights


class StepPacer:
    """Holds each step to its modelled time x `time_scale`, on an injected clock."""

    def __init__(
        self,
        profile: CostProfile,
        time_scale: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if time_scale < 1:
            raise ValueError(f"time_scale must be at least 1 (got {time_scale})")
        self.profile = profile
        self.time_scale = time_scale
        self._clock = clock
        self._sleep = sleep
        self._start: float | None = None
        self._chained_end: float | None = None  # where the last step ended, while busy
        self.steps = 0
        self.overruns = 0
        self.modelled_s = 0.0  # the sum of modelled (unscaled) step times
        self.work_s = 0.0  # wall time the engine's own work took inside its steps

    def begin(self) -> None:
        """A turn of the engine loop begins: the next step starts now, or where the last one
        ended if the engine has not been idle since."""
        now = self._clock()
        self._start = self._chained_end if self._chained_end is not None else now

    def idle(self) -> None:
        """The engine found nothing to run: the next step starts afresh."""
        self._chained_end = None

    def finish(self, works: Sequence[Work]) -> float:
        """Wait until the step's modelled time has passed since its start; return that time
        (unscaled). A step already past it is counted as an overrun."""
        if self._start is None:
            raise RuntimeError("finish() before begin()")
        shape = step_shape(works)
        modelled = self.profile.step_s(shape.rows, shape.context_tokens, shape.prompt_tokens)
        deadline = self._start + modelled * self.time_scale
        now = self._clock()
        self.steps += 1
        self.modelled_s += modelled
        self.work_s += now - self._start
        if now > deadline:
            self.overruns += 1
            self._chained_end = now
        else:
            self._sleep(deadline - now)
            self._chained_end = deadline
        self._start = None
        return modelled
