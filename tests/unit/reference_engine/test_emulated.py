"""Emulated timing: the token source's determinism and meaning, the pacer on an injected clock,
and the engine running on both (batcher, KV accounting, end of sequence) without a model."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reference_engine.batcher import Batcher, Work
from reference_engine.config import EngineConfig
from reference_engine.emulated import (
    FIRST_ORDINARY_ID,
    FIRST_SPECIAL_ABOVE,
    StepPacer,
    StepShape,
    TokenSource,
    step_shape,
    weighted_pick,
)
from reference_engine.engine import Engine, EngineStats
from reference_engine.eos import natural_length
from reference_engine.errors import EngineError
from reference_engine.request import EngineRequest, RowSpec, RunningSequence, Sampling
from scheduler_svc.profiles import load_profile

ROOT = Path(__file__).resolve().parents[3]
H200 = load_profile("h200-8b-bf16")
END, PAD = 1, 2


def _row(prompt: tuple[int, ...], out: int, **kw: object) -> RowSpec:
    return RowSpec(prompt, out, END, PAD, **kw)  # type: ignore[arg-type]


def _drive(cfg: EngineConfig, rows: dict[str, RowSpec]) -> dict[str, RunningSequence]:
    """Every request to its end on a batcher fed by the token source (no clock, no thread)."""
    batcher, source = Batcher(cfg), TokenSource(cfg)
    requests = {
        key: batcher.add(key, [spec], streaming=True, sampling=Sampling(), handle=None)
        for key, spec in rows.items()
    }
    while not batcher.idle():
        plan = batcher.schedule()
        sampled = source.step(plan.works, [])
        batcher.commit(plan, sampled.tokens, sampled.log_probs)
    return {key: r.rows[0] for key, r in requests.items()}


def _collect(cfg: EngineConfig, rows: dict[str, RowSpec]) -> dict[str, list[int]]:
    return {key: list(seq.generated) for key, seq in _drive(cfg, rows).items()}


def test_the_same_prompt_gets_the_same_tokens_however_it_is_batched() -> None:
    prompt = tuple(range(10, 400))
    alone = _collect(EngineConfig(), {"a": _row(prompt, 12)})["a"]
    crowd = {f"r{i}": _row(tuple(range(20 + i, 300 + i)), 12) for i in range(6)}
    chunked_cfg = EngineConfig(max_num_tokens=64, enable_chunked_context=True, max_num_sequences=8)
    chunked = _collect(chunked_cfg, {**crowd, "a": _row(prompt, 12)})
    assert chunked["a"] == alone and len(alone) == 12
    assert len({tuple(v) for v in chunked.values()}) == 7  # other prompts, other tokens
    # Sampled rows mix their seed in: another seed, other tokens; the same seed, the same.
    seeded = [
        _collect(EngineConfig(), {"s": _row(prompt, 12, sampling=Sampling(0.8, 0, 0.9, seed))})
        for seed in (7, 7, 8)
    ]
    assert seeded[0] == seeded[1] != seeded[2] and seeded[0]["s"] != alone


def test_tokens_are_ordinary_ids_and_ends_come_from_the_eos_model_only() -> None:
    cfg = EngineConfig()
    rows = {f"r{i}": _row(tuple(range(i, i + 30)), 40) for i in range(50)}
    out = _collect(cfg, rows)
    tokens = [t for v in out.values() for t in v]
    assert all(FIRST_ORDINARY_ID <= t < FIRST_SPECIAL_ABOVE for t in tokens)
    assert all(len(v) == 40 for v in out.values())  # no end id drawn: every row runs to max
    assert len(set(tokens)) > 1900  # spread over the vocabulary, not a handful of ids
    eos = EngineConfig(eos_model="lognormal", eos_mean_tokens=10)
    ended = _collect(eos, {k: _row(v.prompt, 200) for k, v in list(rows.items())[:10]})
    for key, tokens_out in ended.items():
        assert len(tokens_out) == min(200, natural_length(rows[key].prompt, 10.0, 0.8, 0))


def test_bans_and_penalties_act_on_the_uniform_source() -> None:
    prompt = tuple(range(50, 90))
    free = _collect(EngineConfig(), {"a": _row(prompt, 6)})["a"]
    # Banning the first token the row would draw makes it draw another (bad_words_list).
    banned = _collect(EngineConfig(), {"a": _row(prompt, 6, bad_words=((free[0],),))})["a"]
    assert banned[0] != free[0] and free[0] not in banned
    # A small vocabulary shows penalties: ordinary ids 3..15, thirteen of them.
    small = EngineConfig(model={"vocab_size": 16})
    plain = _collect(small, {"p": _row(prompt, 13)})["p"]
    assert len(set(plain)) < 13  # uniform draws repeat
    penalised = Sampling(0.0, 0, 0.0, 0, presence_penalty=30.0)
    out = _collect(small, {"p": _row(prompt, 13, sampling=penalised)})["p"]
    assert sorted(out) == list(range(3, 16))  # a generated id is all but excluded


def test_weighted_pick_follows_the_weights_exactly() -> None:
    lo, hi = 3, 9
    weights = {4: 0.0, 6: 0.5, 8: 2.0}  # 3,5,7 weigh 1
    total = 3 + 0.5 + 2.0
    mass: dict[int, float] = {}
    steps = 11_000
    for i in range(steps):
        token, probability = weighted_pick((i + 0.5) / steps, lo, hi, weights)
        mass[token] = mass.get(token, 0.0) + 1 / steps
        assert probability == pytest.approx(weights.get(token, 1.0) / total)
    assert 4 not in mass
    for token in (3, 5, 6, 7, 8):
        assert mass[token] == pytest.approx(weights.get(token, 1.0) / total, abs=2e-4)


def test_log_probabilities_are_the_drawn_tokens_under_the_source() -> None:
    seq = _drive(EngineConfig(), {"lp": _row(tuple(range(30)), 3, return_log_probs=True)})["lp"]
    uniform = -math.log(FIRST_SPECIAL_ABOVE - FIRST_ORDINARY_ID)
    assert len(seq.generated) == 3 and seq.log_probs == pytest.approx([uniform] * 3)


class FakeClock:
    """Time that moves only when slept through, or by `work_s` at every reading."""

    def __init__(self, work_s: float = 0.0) -> None:
        self.now = 100.0
        self.work_s = work_s
        self.slept: list[float] = []
        self.lock = threading.Lock()

    def clock(self) -> float:
        with self.lock:
            self.now += self.work_s
            return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.slept.append(seconds)
            self.now += seconds


def _works(rows: int, context: int, prompt: int) -> list[Work]:
    seq = RunningSequence(0, EngineRequest("k", True, Sampling(), None), 0, (5,), 4, END, PAD)
    works = [Work(seq, (7,), context, emits=True) for _ in range(rows)]
    if prompt:
        works.append(Work(seq, (7,) * prompt, 0, emits=True, is_context=True))
    return works


def test_the_pacer_holds_each_step_to_its_modelled_time_from_its_start() -> None:
    fake = FakeClock()
    pacer = StepPacer(H200, 10.0, fake.clock, fake.sleep)
    works = _works(64, 512, 128)
    assert step_shape(works) == StepShape(64, 64 * 512, 128)
    modelled = H200.step_s(64, 64 * 512, 128)
    pacer.begin()
    assert pacer.finish(works) == pytest.approx(modelled)
    assert fake.slept == [pytest.approx(modelled * 10)]
    # The engine's work between steps (delivery, planning) counts inside the next step.
    fake.now += 0.004
    pacer.begin()
    pacer.finish(_works(1, 100, 0))
    assert fake.slept[-1] == pytest.approx(H200.step_s(1, 100, 0) * 10 - 0.004)
    assert fake.now == pytest.approx(100 + 10 * (modelled + H200.step_s(1, 100, 0)))
    # After an idle turn the next step starts afresh, when its turn begins.
    pacer.idle()
    fake.now += 5.0
    start = fake.now
    pacer.begin()
    pacer.finish(_works(2, 10, 0))
    assert fake.now == pytest.approx(start + 10 * H200.step_s(2, 20, 0))
    assert (pacer.steps, pacer.overruns) == (3, 0)


def test_a_step_whose_work_overruns_is_counted_and_not_stretched() -> None:
    fake = FakeClock()
    pacer = StepPacer(H200, 2.0, fake.clock, fake.sleep)
    pacer.begin()
    fake.now += 1.0  # far beyond any step's modelled time
    pacer.finish(_works(4, 100, 0))
    assert pacer.overruns == 1 and fake.slept == []
    late = fake.now
    pacer.begin()  # chained from where the overrun step really ended
    pacer.finish(_works(4, 100, 0))
    assert fake.now == pytest.approx(late + 2 * H200.step_s(4, 400, 0))
    assert (pacer.steps, pacer.overruns) == (2, 1)
    with pytest.raises(ValueError, match="at least 1"):
        StepPacer(H200, 0.5)


@dataclass
class ListSink:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    stats: EngineStats | None = None
    changed: threading.Condition = field(default_factory=threading.Condition)

    def emit(
        self,
        request: EngineRequest,
        seq: RunningSequence,
        tokens: list[int],
        log_probs: list[float] | None,
        final: bool,
    ) -> None:
        with self.changed:
            self.tokens.setdefault(request.key, []).extend(tokens)
            if final:
                self.done.add(request.key)
            self.changed.notify_all()

    def close(self, request: EngineRequest) -> None:
        raise AssertionError("nothing is cancelled here")

    def fail(self, request: EngineRequest, error: EngineError) -> None:
        raise AssertionError(f"failed: {error}")

    def is_cancelled(self, request: EngineRequest) -> bool:
        return False

    def publish(self, stats: EngineStats) -> None:
        with self.changed:
            self.stats = stats
            self.changed.notify_all()


@pytest.fixture
def emulated() -> Iterator[tuple[Engine, ListSink, FakeClock, StepPacer]]:
    cfg = EngineConfig.from_parameters(
        {"timing": "emulated", "eos_model": "lognormal", "eos_mean_tokens": "20"}
    )
    fake, sink = FakeClock(work_s=1e-6), ListSink()
    pacer = StepPacer(cfg.profile(), 20.0, fake.clock, fake.sleep)
    engine = Engine(cfg, sink, lambda: TokenSource(cfg), pacer)
    engine.start()
    yield engine, sink, fake, pacer
    engine.shutdown()


def test_the_emulated_engine_serves_under_real_batching_on_the_injected_clock(
    emulated: tuple[Engine, ListSink, FakeClock, StepPacer],
) -> None:
    engine, sink, fake, pacer = emulated
    prompts = {f"r{i}": tuple(range(7 * i, 7 * i + 100 + 37 * i)) for i in range(24)}
    started = fake.now
    for key, prompt in prompts.items():
        engine.submit(key, [_row(prompt, 64)], streaming=True, sampling=Sampling(), handle=None)
    with sink.changed:
        assert sink.changed.wait_for(lambda: len(sink.done) == len(prompts), timeout=30)
        assert sink.changed.wait_for(
            lambda: sink.stats is not None and sink.stats.active_requests == 0, timeout=30
        )
        stats = sink.stats
    assert stats is not None
    for key, prompt in prompts.items():  # the synthetic end of sequence, as with the model
        assert len(sink.tokens[key]) == min(64, natural_length(prompt, 20.0, 0.8, 0))
    assert stats.kv_free_blocks == stats.kv_max_blocks == 51_894  # every block back
    assert stats.iteration == pacer.steps and stats.overrun_steps == 0
    assert stats.rows_total >= sum(len(t) for t in sink.tokens.values())
    # Chained steps: the fake time that passed is the modelled time x 20 of every step (the
    # engine's own readings of the clock, 1 us each, fall inside the steps).
    elapsed = fake.now - started
    assert elapsed >= pacer.modelled_s * 20
    assert elapsed == pytest.approx(pacer.modelled_s * 20, abs=0.001 + 20 * H200.step_floor_s)


def test_emulated_timing_takes_the_engine_shape_from_the_profile() -> None:
    cfg = EngineConfig.from_parameters({"timing": "emulated"})
    assert (cfg.max_num_sequences, cfg.max_num_tokens, cfg.num_blocks) == (256, 8192, 51_894)
    assert cfg.enable_chunked_context and cfg.max_queue_size == 512
    assert cfg.context_chunking_policy == "first_come_first_served"
    mine = EngineConfig.from_parameters(
        {"timing": "emulated", "cost_profile": "a100-8b-awq", "max_num_sequences": "32"}
    )
    assert mine.max_num_sequences == 32 and mine.num_blocks == 29_304  # given beats profile
    with pytest.raises(ValueError, match="parameter cost_profile: cannot read cost profile"):
        EngineConfig.from_parameters({"timing": "emulated", "cost_profile": "/no/such.json"})
    with pytest.raises(ValueError, match="time_scale"):
        EngineConfig.from_parameters({"timing": "emulated", "time_scale": "0.5"})
    with pytest.raises(ValueError, match="timing"):
        EngineConfig.from_parameters({"timing": "fast"})


def test_the_shipped_emulated_repository_states_the_profile_shape() -> None:
    text = (ROOT / "model_repo/emulated/tensorrt_llm/config.pbtxt").read_text()
    params = dict(re.findall(r'key: "(\w+)"\s+value: \{ string_value: "([^"]*)" \}', text))
    cfg = EngineConfig.from_parameters(params)
    profile = cfg.profile()
    assert (cfg.timing, cfg.cost_profile, cfg.time_scale) == ("emulated", "h200-8b-bf16", 1.0)
    assert cfg.max_num_sequences == profile.max_num_sequences
    assert cfg.max_num_tokens == profile.max_num_tokens
    assert cfg.num_blocks == profile.total_blocks
    assert cfg.context_chunking_policy == profile.context_chunking_policy
    assert cfg.max_queue_size == profile.max_queue_size
