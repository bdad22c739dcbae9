"""benchmarks/gpu_profile.py, the re-measuring script, on the CPU with a tiny shape: it writes a
profile the engine and the simulator accept, and its fit is the project's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from reference_engine.config import EngineConfig
from scheduler_svc.profiles import StepPoint, fit_steps, load_profile

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_profile.py"
TINY = [
    "--layers", "2", "--hidden", "64", "--inter", "128", "--heads", "4", "--kv-heads", "2",
    "--head-dim", "16", "--vocab", "512", "--dtype", "fp32", "--device", "cpu",
    "--groups", "0:0,2:16,4:64", "--prompts", "0,8,32", "--decode-only", "1:16,8:16",
    "--repeats", "3", "--gpu-bytes", "1e9", "--reserved-bytes", "0",
    "--max-num-sequences", "8", "--max-num-tokens", "64",
]  # fmt: skip


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_profile", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_profile"] = module
    spec.loader.exec_module(module)
    return module


def test_the_script_imports_only_torch_and_the_standard_library() -> None:
    import ast  # noqa: PLC0415

    tree = ast.parse(SCRIPT.read_text())
    tops = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert tops - {"torch", "__future__"} <= set(sys.stdlib_module_names)


def test_a_tiny_cpu_run_writes_a_profile_the_engine_and_simulator_read(
    script: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "tiny.json"
    assert script.main([*TINY, "--out", str(out), "--name", "tiny-cpu"]) == 0
    data = json.loads(out.read_text())
    points = data["measurements"]["points"]
    assert len(points) == 8 + 2  # (3 groups x 3 chunks) less the empty step, + decode-only
    assert all(p["s"] > 0 for p in points)
    profile = load_profile(str(out))  # validated as any profile file is
    assert (profile.name, profile.kind, profile.max_num_sequences) == ("tiny-cpu", "measured", 8)
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, layers, heads, fp32
    ours = fit_steps([StepPoint(p["rows"], p["context"], p["prompt"], p["s"]) for p in points])
    for key, value in (
        ("floor_s", ours.floor_s),
        ("per_row_s", ours.per_row_s),
        ("per_context_token_s", ours.per_context_token_s),
        ("per_prompt_token_s", ours.per_prompt_token_s),
    ):
        assert data["step"][key] == pytest.approx(value, rel=1e-6, abs=1e-12)
    engine = EngineConfig.from_parameters({"timing": "emulated", "cost_profile": str(out)})
    assert engine.max_num_sequences == 8 and engine.num_blocks == profile.total_blocks


def test_both_fits_hold_a_negative_cost_at_zero_alike(script: ModuleType) -> None:
    """Noise on a small shape can make a term fit below zero; both fits hold it at zero."""
    raw = [
        (0, 0, 8, 0.0050),
        (0, 0, 32, 0.0056),
        (2, 16, 0, 0.0049),
        (8, 16, 0, 0.0047),
        (16, 16, 0, 0.0046),
        (4, 64, 8, 0.0053),
    ]
    ours = fit_steps([StepPoint(*r) for r in raw])
    theirs = script.fit([{"rows": b, "context": c, "prompt": p, "s": s} for b, c, p, s in raw])
    assert ours.per_row_s == theirs["per_row_s"] == 0.0
    assert ours.floor_s == pytest.approx(theirs["floor_s"], rel=1e-9)
    assert ours.per_prompt_token_s == pytest.approx(theirs["per_prompt_token_s"], rel=1e-9)
