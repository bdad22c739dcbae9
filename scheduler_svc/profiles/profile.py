"""A cost profile: one engine step's modelled time, and the engine's shape on that GPU.

Step time = floor + per_row x decode rows + per_context_token x KV tokens the step reads
            + per_prompt_token x prompt tokens it feeds.

`rows` are the sequences that decode one token in the step; `context_tokens` the tokens already
in the KV cache that the step reads (each decode row's context, and each prompt chunk's earlier
chunks); `prompt_tokens` the prompt tokens fed (every chunk of this step). The reference engine's
emulated timing and the simulator count a step the same way (`step_s`).

The KV pool comes from the GPU's memory arithmetic: kv_cache_fraction x (GPU memory - weights -
reserved), in blocks of `tokens_per_block` tokens of `kv_bytes_per_token` each (TensorRT-LLM's
kv_cache_free_gpu_mem_fraction reading).

Profiles are JSON (`data/<name>.json` for the bundled ones, or a file of the user's, the format
`benchmarks/gpu_profile.py` writes): `step`, `engine`, `memory`, and free text on where the
numbers come from. Unknown keys are refused, so a typo cannot pass as a default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

# The bundled profiles; a name not listed here is read as a path to a profile file.
BUNDLED = ("h200-8b-bf16", "a100-8b-awq")
DEFAULT_PROFILE = "h200-8b-bf16"
CHUNKING_POLICIES = ("first_come_first_served", "equal_progress")
KINDS = ("measured", "estimate")
FORMAT = "scheduler-svc cost profile 1"
_TOP_KEYS = {
    "format",
    "name",
    "kind",
    "description",
    "provenance",
    "step",
    "fit",
    "engine",
    "memory",
    "measurements",
}
_STEP_KEYS = ("floor_s", "per_row_s", "per_context_token_s", "per_prompt_token_s")
_ENGINE_KEYS = {
    "max_num_sequences",
    "max_num_tokens",
    "tokens_per_block",
    "context_chunking_policy",
    "max_seq_len",
    "max_queue_size",
}
_MEMORY_KEYS = {
    "gpu_bytes",
    "weight_bytes",
    "reserved_bytes",
    "kv_cache_fraction",
    "kv_bytes_per_token",
    "how",
}


@dataclass(frozen=True)
class CostProfile:
    """What one engine step costs on one GPU, and the engine's shape there."""

    name: str
    kind: str  # measured (fitted to a table kept in the file) or estimate
    step_floor_s: float
    per_row_s: float
    per_context_token_s: float
    per_prompt_token_s: float
    kv_bytes_per_token: int
    kv_pool_bytes: int
    tokens_per_block: int = 16
    max_num_sequences: int = 256
    max_num_tokens: int = 8192  # tokens one step feeds (decode rows + prompt chunks)
    # How prompts in their context phase share a step (TensorRT-LLM's ContextChunkingPolicy;
    # its default is first come, first served).
    context_chunking_policy: str = "first_come_first_served"
    max_seq_len: int = 8192
    max_queue_size: int = 512  # the engine's own queue (TensorRT-LLM's max_queue_size)
    description: str = ""

    @property
    def total_blocks(self) -> int:
        """KV blocks in the pool."""
        return self.kv_pool_bytes // (self.kv_bytes_per_token * self.tokens_per_block)

    def step_s(self, rows: int, context_tokens: int, prompt_tokens: int) -> float:
        """One step: `rows` decode rows reading `context_tokens` cached tokens in all, plus
        `prompt_tokens` prompt tokens fed."""
        return (
            self.step_floor_s
            + self.per_row_s * rows
            + self.per_context_token_s * context_tokens
            + self.per_prompt_token_s * prompt_tokens
        )

    def prefill_s(self, prompt_tokens: int) -> float:
        """A lone prompt's time to its first token on an idle engine: its chunks of at most
        max_num_tokens, each reading the chunks before it."""
        total, done = 0.0, 0
        while True:
            chunk = min(self.max_num_tokens, prompt_tokens - done)
            total += self.step_s(0, done, chunk)
            done += chunk
            if done >= prompt_tokens:
                return total

    def with_pool_blocks(self, blocks: int) -> CostProfile:
        """The same GPU with a KV pool of `blocks` blocks."""
        if blocks < 1:
            raise ValueError(f"the KV pool must hold at least one block (got {blocks})")
        return replace(self, kv_pool_bytes=blocks * self.kv_bytes_per_token * self.tokens_per_block)


def _number(data: Mapping[str, Any], key: str, where: str, lo: float, hi: float) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key}: a number is required")
    if not lo <= value <= hi:
        raise ValueError(f"{where}.{key}: {value} is outside [{lo:g}, {hi:g}]")
    return float(value)


def _integer(data: Mapping[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    value = _number(data, key, where, lo, hi)
    if value != int(value):
        raise ValueError(f"{where}.{key}: a whole number is required")
    return int(value)


def _section(data: Mapping[str, Any], key: str, allowed: set[str]) -> Mapping[str, Any]:
    section = data.get(key)
    if not isinstance(section, Mapping):
        raise ValueError(f"{key}: a mapping is required")
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{key}: unknown keys {', '.join(unknown)}")
    return section


def profile_from_mapping(data: Mapping[str, Any]) -> CostProfile:
    """Validate a profile's JSON; ValueError names the field at fault."""
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {', '.join(unknown)}")
    if data.get("format") != FORMAT:
        raise ValueError(f"format: expected {FORMAT!r} (got {data.get('format')!r})")
    name, kind = data.get("name"), data.get("kind")
    if not isinstance(name, str) or not name:
        raise ValueError("name: a non-empty string is required")
    if kind not in KINDS:
        raise ValueError(f"kind: one of {', '.join(KINDS)} (got {kind!r})")
    step = _section(data, "step", set(_STEP_KEYS))
    floor_s = _number(step, "floor_s", "step", 1e-6, 10.0)
    per_row, per_context, per_prompt = (
        _number(step, key, "step", 0.0, 1.0) for key in _STEP_KEYS[1:]
    )
    engine = _section(data, "engine", _ENGINE_KEYS)
    policy = engine.get("context_chunking_policy", "first_come_first_served")
    if policy not in CHUNKING_POLICIES:
        choices = ", ".join(CHUNKING_POLICIES)
        raise ValueError(f"engine.context_chunking_policy: one of {choices} (got {policy!r})")
    memory = _section(data, "memory", _MEMORY_KEYS)
    gpu = _number(memory, "gpu_bytes", "memory", 1e6, 1e15)
    weights = _number(memory, "weight_bytes", "memory", 0, 1e15)
    reserved = _number(memory, "reserved_bytes", "memory", 0, 1e15)
    fraction = _number(memory, "kv_cache_fraction", "memory", 0.01, 1.0)
    per_token = _integer(memory, "kv_bytes_per_token", "memory", 1, 1 << 30)
    pool = int(fraction * (gpu - weights - reserved))
    profile = CostProfile(
        name=name,
        kind=kind,
        step_floor_s=floor_s,
        per_row_s=per_row,
        per_context_token_s=per_context,
        per_prompt_token_s=per_prompt,
        kv_bytes_per_token=per_token,
        kv_pool_bytes=max(0, pool),
        tokens_per_block=_integer(engine, "tokens_per_block", "engine", 1, 1024),
        max_num_sequences=_integer(engine, "max_num_sequences", "engine", 1, 1 << 16),
        max_num_tokens=_integer(engine, "max_num_tokens", "engine", 1, 1 << 20),
        context_chunking_policy=policy,
        max_seq_len=_integer(engine, "max_seq_len", "engine", 1, 1 << 24),
        max_queue_size=_integer(engine, "max_queue_size", "engine", 0, 1 << 20),
        description=str(data.get("description", "")),
    )
    if profile.total_blocks < 1:
        raise ValueError("memory: the GPU leaves no room for a single KV block")
    if profile.max_num_tokens < profile.max_num_sequences:
        raise ValueError(
            "engine.max_num_tokens must be at least max_num_sequences: every running sequence "
            "decodes a token a step"
        )
    return profile


def read_profile_file(path: str | Path) -> dict[str, Any]:
    """A profile file's JSON, unvalidated (ValueError if it cannot be read)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read cost profile {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"cost profile {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"cost profile {path}: a JSON object is required")
    return data


def bundled_data(name: str) -> dict[str, Any]:
    """A bundled profile's JSON, raw measurements included."""
    if name not in BUNDLED:
        raise ValueError(f"no bundled cost profile {name!r} (bundled: {', '.join(BUNDLED)})")
    text = (resources.files(__package__) / "data" / f"{name}.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def load_profile(spec: str) -> CostProfile:
    """A bundled profile by name, or a profile file by path; ValueError says what is wrong."""
    data = bundled_data(spec) if spec in BUNDLED else read_profile_file(spec)
    try:
        return profile_from_mapping(data)
    except ValueError as exc:
        raise ValueError(f"cost profile {spec}: {exc}") from None
