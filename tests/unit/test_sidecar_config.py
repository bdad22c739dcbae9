"""Sidecar config: YAML plus overrides, frozen, and errors that name the field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2

from scheduler_svc.config import load_config
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.errors import ConfigError
from scheduler_svc.profiles import load_profile
from scheduler_svc.serving.backends.codec import profile_from_config


def test_defaults_yaml_and_overrides_merge(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text("queue:\n  max_queued: 7\nserver:\n  port: 6000\n")
    cfg = load_config(path, {"server": {"port": 0}, "triton": {"url": "triton:8001"}})
    assert cfg.queue.max_queued == 7
    assert cfg.queue.max_in_flight is None  # untouched default: as many as the engine runs
    assert cfg.server.port == 0  # the override wins
    assert cfg.triton.url == "triton:8001"
    with pytest.raises(Exception, match="frozen"):
        cfg.queue.max_queued = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("queue:\n  max_queued: -1\n", "queue.max_queued"),
        ("queue:\n  max_in_flight: zero\n", "queue.max_in_flight"),
        ("server:\n  port: 70000\n", "server.port"),
        ("server:\n  colour: blue\n", "server.colour"),
        ("model:\n  default_max_tokens: 4096\n  max_output_tokens: 10\n", "default_max_tokens"),
        ("- a list\n", "mapping at the top level"),
        ("queue: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, yaml_text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=needle):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")


def test_the_example_config_documents_the_defaults() -> None:
    example = Path(__file__).resolve().parents[2] / "config.example.yaml"
    assert load_config(example) == load_config(None)


def test_the_engine_profile_is_read_from_the_models_config() -> None:
    config = model_config_pb2.ModelConfig(max_batch_size=64)
    config.instance_group.add(count=2)
    for key, value in [
        ("gpt_model_type", "V1"),
        ("max_num_sequences", "16"),
        ("max_num_tokens", "${max_num_tokens}"),  # an unrendered template: unknown
        ("max_tokens_in_paged_kv_cache", "16384"),
        ("tokens_per_block", "16"),
    ]:
        config.parameters[key].string_value = value
    profile = profile_from_config(config, "auto")
    assert profile == EngineProfile(
        Batching.STATIC,
        max_batch_size=64,
        batches_at_once=2,
        max_num_sequences=16,
        max_num_tokens=None,
        kv_total_blocks=1024,
    )
    config.parameters["gpt_model_type"].string_value = "inflight_fused_batching"
    assert profile_from_config(config, "auto").batching is Batching.INFLIGHT
    assert profile_from_config(config, "static").batching is Batching.STATIC  # the override
    # How the engine allocates KV: guaranteed_no_evict (TensorRT-LLM's default) reserves
    # prompt + max_tokens; max_utilization allocates as tokens come.
    assert profile.reserves_max_tokens
    config.parameters["batch_scheduler_policy"].string_value = "max_utilization"
    assert not profile_from_config(config, "auto").reserves_max_tokens
    # How a chunking engine shares a step between prompts: TensorRT-LLM's default where the
    # config leaves it unrendered, nothing where the engine does not chunk.
    assert profile.context_chunking is None
    config.parameters["enable_chunked_context"].string_value = "true"
    config.parameters["context_chunking_policy"].string_value = "${context_chunking_policy}"
    assert profile_from_config(config, "auto").context_chunking == "first_come_first_served"
    config.parameters["context_chunking_policy"].string_value = "equal_progress"
    assert profile_from_config(config, "auto").context_chunking == "equal_progress"
    config.parameters["enable_chunked_context"].string_value = "false"
    assert profile_from_config(config, "auto").context_chunking is None
    # KV block reuse: off unless the config says "true" (an unrendered template reads as off).
    assert not profile.kv_cache_reuse
    config.parameters["enable_kv_cache_reuse"].string_value = "${enable_kv_cache_reuse}"
    assert not profile_from_config(config, "auto").kv_cache_reuse
    config.parameters["enable_kv_cache_reuse"].string_value = "true"
    assert profile_from_config(config, "auto").kv_cache_reuse


def test_the_engine_profile_sets_the_batching_rules_unless_the_config_pins_them() -> None:
    static = EngineProfile(Batching.STATIC, max_batch_size=8, batches_at_once=1)
    inflight = EngineProfile(Batching.INFLIGHT, max_batch_size=64, max_num_sequences=16)
    cfg = load_config(None, {"queue": {"max_in_flight": 32}})
    base = cfg.policy_config()
    held = cfg.policy_for_engine(base, static)
    assert (held.continuous_batching, held.max_batches_in_flight) == (False, 1)
    assert held.kv.max_in_flight == 8  # one batch of at most max_batch_size rows
    flowing = cfg.policy_for_engine(base, inflight)
    assert (flowing.continuous_batching, flowing.max_batches_in_flight) == (True, None)
    assert flowing.kv.max_in_flight == 32  # an in-flight engine queues the rest itself
    assert flowing.prefill_budget_tokens is None  # the engine did not say its step budget
    stepped = EngineProfile(Batching.INFLIGHT, max_batch_size=64, max_num_tokens=512)
    assert cfg.policy_for_engine(base, stepped).prefill_budget_tokens == 1024  # two steps
    # An engine that shares each step equally between prompts needs no budget; one that
    # serves them first come first served does.
    equal = replace(stepped, context_chunking="equal_progress")
    assert cfg.policy_for_engine(base, equal).prefill_budget_tokens is None
    fcfs = replace(stepped, context_chunking="first_come_first_served")
    assert cfg.policy_for_engine(base, fcfs).prefill_budget_tokens == 1024
    assert held.prefill_budget_tokens is None  # a static engine prefills whole batches
    pinned = load_config(None, {"policy": {"max_batches_in_flight": 2}})
    assert pinned.policy_for_engine(pinned.policy_config(), static).max_batches_in_flight == 2
    # The KV mirror reserves as an in-flight engine allocates, unless the config pins it.
    assert flowing.kv.reserve_max_tokens
    allocating = EngineProfile(Batching.INFLIGHT, max_batch_size=64, reserves_max_tokens=False)
    assert not cfg.policy_for_engine(base, allocating).kv.reserve_max_tokens
    # ... and reserves the median output there, the 90th percentile elsewhere, unless pinned.
    assert cfg.policy_for_engine(base, allocating).predict.quantile == 0.5
    assert cfg.policy_for_engine(base, inflight).predict.quantile == 0.9
    chosen = load_config(None, {"policy": {"predict": {"quantile": 0.8}}})
    assert chosen.policy_for_engine(chosen.policy_config(), allocating).predict.quantile == 0.8
    assert not held.kv.reserve_max_tokens  # static batches: as before
    mine = load_config(None, {"policy": {"kv": {"reserve_max_tokens": False}}})
    assert not mine.policy_for_engine(mine.policy_config(), inflight).kv.reserve_max_tokens


def test_an_engine_that_states_its_step_cost_sets_lane_targets_and_the_prefill_budget() -> None:
    h200 = load_profile("h200-8b-bf16")
    emulated = EngineProfile(
        Batching.INFLIGHT, max_batch_size=256, max_num_tokens=8192, step_cost=h200, time_scale=4.0
    )
    cfg = load_config(None, {})
    policy = cfg.policy_for_engine(cfg.policy_config(), emulated)
    targets = {lane.name: lane.ttft_target_s for lane in policy.lanes}
    # The one SLO rule on the profile's unloaded times, at the engine's time scale: hot sits
    # on the 250 ms floor (5 x 4 x 9 ms is below it); warm and cold are 5 x their prefill.
    assert targets["hot"] == 0.25
    assert targets["warm"] == pytest.approx(5 * 4.0 * h200.prefill_s(512))
    assert targets["cold"] == pytest.approx(5 * 4.0 * h200.prefill_s(2048))
    # A quarter of hot's target in prompt tokens at 4 x 24.4 us each.
    assert policy.prefill_budget_tokens == int(0.25 * 0.25 / (4.0 * h200.per_prompt_token_s))
    pinned = load_config(None, {"policy": {"lanes": [{"name": "cold", "ttft_target_s": 9.0}]}})
    mine = pinned.policy_for_engine(pinned.policy_config(), emulated)
    assert [lane.ttft_target_s for lane in mine.lanes][2] == 9.0  # a pinned target stays
    # A real engine does not say: the defaults stay.
    real = cfg.policy_for_engine(cfg.policy_config(), EngineProfile(Batching.INFLIGHT, 64))
    assert [lane.ttft_target_s for lane in real.lanes] == [0.25, 0.35, 1.5]


def test_requests_in_flight_follow_the_engine_unless_pinned() -> None:
    """queue.max_in_flight null: as many requests in flight as the engine runs sequences (a
    256-sequence engine is not held to 16); a pinned number, in queue or policy.kv, stays."""
    big = EngineProfile(Batching.INFLIGHT, max_batch_size=64, max_num_sequences=256)
    trtllm = EngineProfile(Batching.INFLIGHT, max_batch_size=64, batches_at_once=2)
    static = EngineProfile(Batching.STATIC, max_batch_size=8, max_num_sequences=16)
    cfg = load_config(None)
    base = cfg.policy_config()
    assert base.kv.max_in_flight == 16  # until the engine's profile is read
    assert cfg.policy_for_engine(base, big).kv.max_in_flight == 256
    # TensorRT-LLM states no max_num_sequences: its engine batch is Triton's max_batch_size.
    assert cfg.policy_for_engine(base, trtllm).kv.max_in_flight == 128
    assert cfg.policy_for_engine(base, static).kv.max_in_flight == 8  # one batch's rows
    for pinned in ({"queue": {"max_in_flight": 24}}, {"policy": {"kv": {"max_in_flight": 24}}}):
        mine = load_config(None, pinned)
        assert mine.policy_for_engine(mine.policy_config(), big).kv.max_in_flight == 24
