"""Sidecar config: YAML plus overrides, frozen, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_svc.config import load_config
from scheduler_svc.errors import ConfigError


def test_defaults_yaml_and_overrides_merge(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text("queue:\n  max_queued: 7\nserver:\n  port: 6000\n")
    cfg = load_config(path, {"server": {"port": 0}, "triton": {"url": "triton:8001"}})
    assert cfg.queue.max_queued == 7
    assert cfg.queue.max_in_flight == 16  # untouched default
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
