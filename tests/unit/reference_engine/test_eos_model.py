"""The reference engine's synthetic end-of-sequence model (reference_engine/eos.py):
deterministic per prompt, distributed as configured, and honoured by the batcher like a trained
model's end."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from reference_engine.batcher import Batcher
from reference_engine.config import EngineConfig
from reference_engine.eos import natural_length
from reference_engine.request import FinishReason, RowSpec, Sampling
from tests.unit.reference_engine.test_batcher import cfg, run_to_end


def prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(129_000) for _ in range(rng.randint(1, 300))) for _ in range(n)]


def test_the_same_prompt_always_gets_the_same_length_and_the_seed_moves_it() -> None:
    sample = prompts(200)
    first = [natural_length(p, 40.0, 0.8, seed=0) for p in sample]
    assert first == [natural_length(p, 40.0, 0.8, seed=0) for p in sample]
    other = [natural_length(p, 40.0, 0.8, seed=1) for p in sample]
    assert sum(a != b for a, b in zip(first, other, strict=True)) > 150
    assert min(first) >= 1


@pytest.mark.parametrize(("mean", "sigma"), [(40.0, 0.8), (200.0, 0.5), (8.0, 1.2)])
def test_lengths_follow_the_configured_lognormal(mean: float, sigma: float) -> None:
    lengths = [natural_length(p, mean, sigma, seed=3) for p in prompts(4000, seed=1)]
    # The mean, and the median exp(mu) of a lognormal with that mean and sigma, within a few
    # percent over 4,000 prompts (rounding to whole tokens moves small means a little).
    median = math.exp(math.log(mean) - sigma * sigma / 2)
    assert statistics.fmean(lengths) == pytest.approx(mean, rel=0.08)
    assert statistics.median(lengths) == pytest.approx(median, rel=0.08, abs=1)
    logs = [math.log(n) for n in lengths if n > 2]
    if mean > 20:
        assert statistics.stdev(logs) == pytest.approx(sigma, rel=0.1)


def test_the_batcher_ends_each_row_at_its_drawn_length_as_an_end_token() -> None:
    config = cfg(
        eos_model="lognormal", eos_mean_tokens=6.0, eos_sigma=0.5, max_tokens_in_paged_kv_cache=4096
    )
    rows = [tuple(range(1, n + 1)) for n in (3, 5, 8, 13)]
    batcher = Batcher(config)
    specs = [RowSpec(p, 40, end_id=7, pad_id=0) for p in rows]
    specs.append(RowSpec(rows[0], 2, end_id=7, pad_id=0))  # max tokens still caps a row
    specs.append(RowSpec(rows[1], 40, end_id=-1, pad_id=0))  # no end asked: none given
    specs.append(RowSpec(rows[2], 40, end_id=7, pad_id=0, min_length=30))
    batcher.add("r", specs, streaming=True, sampling=Sampling(), handle=None)
    seqs = batcher.requests[0].rows
    run_to_end(batcher)
    for seq in seqs[:4]:
        drawn = natural_length(seq.prompt, 6.0, 0.5, 0)
        assert len(seq.generated) == drawn and seq.finish == FinishReason.END_ID
    assert len(seqs[4].generated) == 2 and seqs[4].finish == FinishReason.LENGTH
    assert len(seqs[5].generated) == 40 and seqs[5].finish == FinishReason.LENGTH
    assert len(seqs[6].generated) == max(30, natural_length(rows[2], 6.0, 0.5, 0))


def test_the_model_is_off_unless_configured_and_its_parameters_are_checked() -> None:
    assert EngineConfig().eos_model == "none"
    on = EngineConfig.from_parameters({"eos_model": "lognormal", "eos_mean_tokens": "40"})
    assert on.eos_model == "lognormal" and on.eos_mean_tokens == 40.0
    with pytest.raises(ValueError, match="eos_model"):
        EngineConfig.from_parameters({"eos_model": "gamma"})
    with pytest.raises(ValueError, match="eos_mean_tokens"):
        EngineConfig.from_parameters({"eos_model": "lognormal", "eos_mean_tokens": "0"})
