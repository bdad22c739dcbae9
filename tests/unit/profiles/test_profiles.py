"""Cost profiles: the bundled ones load, the H200 constants are what its raw points fit, and a
bad profile is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scheduler_svc.profiles import (
    BUNDLED,
    StepPoint,
    fit_steps,
    load_profile,
    profile_from_mapping,
)
from scheduler_svc.profiles.profile import bundled_data

ROOT = Path(__file__).resolve().parents[3]


def _points(data: dict[str, Any]) -> list[StepPoint]:
    return [
        StepPoint(p["rows"], p["context"], p["prompt"], p["s"])
        for p in data["measurements"]["points"]
    ]


def test_the_h200_constants_are_the_fit_of_its_committed_measurements() -> None:
    data = bundled_data("h200-8b-bf16")
    fit = fit_steps(_points(data))
    profile = load_profile("h200-8b-bf16")
    assert len(data["measurements"]["points"]) == data["fit"]["points"] == 41
    for ours, theirs in (
        (fit.floor_s, profile.step_floor_s),
        (fit.per_row_s, profile.per_row_s),
        (fit.per_context_token_s, profile.per_context_token_s),
        (fit.per_prompt_token_s, profile.per_prompt_token_s),
    ):
        assert ours == pytest.approx(theirs, rel=1e-9)
    assert fit.median_rel_err == pytest.approx(data["fit"]["median_rel_err"], abs=1e-4)
    assert fit.max_rel_err == pytest.approx(data["fit"]["max_rel_err"], abs=1e-4)
    # The figures ../shared/gpu/README.md states: floor 5.90 ms, 28.1 us a row, 31.4 ns a
    # context token, 24.4 us a prompt token, median error 2.8 %.
    assert round(profile.step_floor_s * 1e3, 2) == 5.90
    assert round(profile.per_row_s * 1e6, 1) == 28.1
    assert round(profile.per_context_token_s * 1e9, 1) == 31.4
    assert round(profile.per_prompt_token_s * 1e6, 1) == 24.4


def test_the_profile_points_are_the_raw_measurement_file() -> None:
    raw = json.loads((ROOT / "docs/benchmarks/gpu/h200-packed-steps.json").read_text())
    ours = bundled_data("h200-8b-bf16")["measurements"]["points"]
    assert [(p["B"], p["C"], p["P"], p["s"]) for p in raw["mixed"]] == [
        (p["rows"], p["context"], p["prompt"], p["s"]) for p in ours
    ]


def test_the_fit_recovers_known_constants_exactly() -> None:
    truth = (0.004, 3e-5, 5e-8, 2e-5)
    points = [
        StepPoint(b, c, p, truth[0] + truth[1] * b + truth[2] * b * c + truth[3] * p)
        for b in (0, 8, 64)
        for c in (512, 4096)
        for p in (0, 256, 2048)
        if b or p
    ]
    fit = fit_steps(points)
    got = (fit.floor_s, fit.per_row_s, fit.per_context_token_s, fit.per_prompt_token_s)
    assert got == pytest.approx(truth, rel=1e-9)
    assert fit.max_rel_err < 1e-9
    with pytest.raises(ValueError, match="at least 4"):
        fit_steps(points[:3])
    with pytest.raises(ValueError, match="determine every term"):
        fit_steps([StepPoint(0, 0, p, 0.01 + p * 1e-5) for p in (64, 128, 256, 512)])


def test_bundled_profiles_load_with_their_shapes_and_memory_arithmetic() -> None:
    assert set(BUNDLED) == {"h200-8b-bf16", "a100-8b-awq"}
    h200, a100 = load_profile("h200-8b-bf16"), load_profile("a100-8b-awq")
    assert (h200.kind, a100.kind) == ("measured", "estimate")
    assert h200.max_num_sequences == 256 and h200.max_num_tokens == 8192
    # 0.9 x (141 GB - 16.08 GB of bf16 weights - 4 GB) / (128 KiB x 16) per block.
    assert h200.total_blocks == 51_894
    assert a100.total_blocks == 29_304  # the simulator's pool since round 1
    # A decode step is nearly flat in rows on the H200: 64 rows cost under 1.5x one row at
    # 512 tokens of context; the A100 estimate's per-row cost makes it 2.2x there.
    assert h200.step_s(64, 64 * 512, 0) / h200.step_s(1, 512, 0) < 1.5
    assert a100.step_s(64, 64 * 512, 0) / a100.step_s(1, 512, 0) > 2


def test_the_packed_fit_predicts_the_separately_measured_decode_steps() -> None:
    """The decode-only graph replays (another file, not fitted) lie within 13 % of the fit."""
    raw = json.loads((ROOT / "docs/benchmarks/gpu/h200-steps-eager-and-graph.json").read_text())
    h200 = load_profile("h200-8b-bf16")
    errors = [
        abs(h200.step_s(d["B"], d["B"] * d["C"], 0) - d["graph_s"]) / d["graph_s"]
        for d in raw["decode"]
    ]
    assert len(errors) == 12 and max(errors) < 0.13


def test_a_long_prompt_prefills_in_chunks_each_reading_the_ones_before() -> None:
    h200 = load_profile("h200-8b-bf16")
    one = h200.step_s(0, 0, 8192)
    assert h200.prefill_s(8192) == pytest.approx(one)
    assert h200.prefill_s(10_000) == pytest.approx(one + h200.step_s(0, 8192, 10_000 - 8192))
    assert h200.with_pool_blocks(100).total_blocks == 100


def _valid() -> dict[str, Any]:
    return json.loads(json.dumps(bundled_data("a100-8b-awq")))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(typo=1), "unknown keys typo"),
        (lambda d: d.update(format="v0"), "format"),
        (lambda d: d.update(kind="guess"), "kind"),
        (lambda d: d["step"].pop("per_row_s"), "step.per_row_s: a number is required"),
        (lambda d: d["step"].update(floor_s=-1), "step.floor_s"),
        (lambda d: d["engine"].update(max_num_sequences=0), "engine.max_num_sequences"),
        (lambda d: d["engine"].update(max_num_tokens=1.5), "whole number"),
        (lambda d: d["engine"].update(context_chunking_policy="lifo"), "context_chunking"),
        (lambda d: d["engine"].update(max_num_tokens=8), "at least max_num_sequences"),
        (lambda d: d["memory"].update(weight_bytes=79.9e9), "no room for a single KV block"),
        (lambda d: d["memory"].update(extra=1), "memory: unknown keys extra"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_field(change: Any, message: str) -> None:
    data = _valid()
    change(data)
    with pytest.raises(ValueError, match=message):
        profile_from_mapping(data)


def test_a_user_profile_file_loads_by_path_and_a_bad_path_is_named(tmp_path: Path) -> None:
    data = _valid()
    data["name"], data["kind"] = "my-gpu", "measured"
    data["step"]["floor_s"] = 0.003
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    mine = load_profile(str(path))
    assert (mine.name, mine.step_floor_s) == ("my-gpu", 0.003)
    with pytest.raises(ValueError, match="cannot read cost profile"):
        load_profile(str(tmp_path / "absent.json"))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(str(path))
