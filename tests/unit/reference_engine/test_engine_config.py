"""Engine config: TensorRT-LLM parameter names, aliases, and clear refusals."""

from __future__ import annotations

import pytest

from reference_engine.config import EngineConfig


def test_trtllm_names_and_aliases() -> None:
    cfg = EngineConfig.from_parameters(
        {
            "gpt_model_type": "V1",
            "batch_scheduler_policy": "max_utilization",
            "max_tokens_in_paged_kv_cache": "1024",
            "tokens_per_block": "32",
            "exclude_input_in_output": "false",
            "model_num_layers": "2",
        }
    )
    assert cfg.batching_strategy == "static"
    assert cfg.batch_scheduler_policy == "max_utilization"
    assert cfg.num_blocks == 32
    assert cfg.exclude_input_in_output is False
    assert cfg.model.num_layers == 2
    assert (
        EngineConfig.from_parameters(
            {"gpt_model_type": "inflight_fused_batching"}
        ).batching_strategy
        == "inflight"
    )


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"gpt_model_type": "turbo"}, "gpt_model_type"),
        ({"no_such_knob": "1"}, "no_such_knob"),
        ({"batch_scheduler_policy": "evict_everyone"}, "batch_scheduler_policy"),
        ({"max_num_tokens": "100", "max_input_len": "200"}, "max_num_tokens"),
        ({"tokens_per_block": "0"}, "tokens_per_block"),
        ({"max_tokens_in_paged_kv_cache": "8", "tokens_per_block": "16"}, "smaller than one block"),
    ],
)
def test_bad_parameters_are_named(params: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_parameters(params)
