"""Strict policy input: UpdatePolicy and the config file are typed and bounded."""

from __future__ import annotations

import math

import pytest

from scheduler_svc.config import SidecarConfig, load_config
from scheduler_svc.core.config import PolicyConfig, from_mapping, to_mapping
from scheduler_svc.errors import (
    BadRequestError,
    ConfigError,
)
from scheduler_svc.serving.fronts.controls import parse_policy_json

# -- strict policy input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"kv": {"max_in_flight": 1.5}}', "kv.max_in_flight: must be an integer"),
        ('{"kv": {"max_in_flight": true}}', "not a boolean"),
        ('{"retry_after_s": Infinity}', "Infinity is not a number"),
        ('{"retry_after_s": 1e308}', "retry_after_s: must be in"),
        ('{"lanes": [{"name": ["x"]}]}', "lanes[0].name: must be a string"),
        ('{"lanes": [{"name": "hot", "share": 5e-324}]}', "share: must be in"),
        ('{"quantum_tokens": "8"}', "quantum_tokens: must be an integer"),
        ("[" * 100 + "]" * 100, "nested 100 deep"),
        ('{"a": "' + "x" * 100_000 + '"}', "characters, at most"),
        ("{not json", "not JSON"),
    ],
)
def test_policy_updates_are_strictly_typed_and_bounded(text: str, needle: str) -> None:
    cfg = SidecarConfig()
    with pytest.raises((BadRequestError, ValueError)) as caught:
        cfg.policy_override(cfg.policy_config(), parse_policy_json(text))
    assert needle in str(caught.value)


def test_the_config_file_is_strictly_typed_too() -> None:
    for overrides, needle in (
        ({"queue": {"max_in_flight": 1.5}}, "queue.max_in_flight"),
        ({"queue": {"retry_after_s": math.inf}}, "finite"),
        ({"server": {"drain_grace_s": "30"}}, "server.drain_grace_s"),
        ({"policy": {"kv": {"max_in_flight": 2.5}}}, "kv.max_in_flight"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, overrides)
    assert from_mapping(to_mapping(PolicyConfig())) == PolicyConfig()
