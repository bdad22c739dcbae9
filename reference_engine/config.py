"""Configuration of the CPU reference engine.

The engine reads its settings from the `parameters` of its Triton `config.pbtxt`, under the
names TensorRT-LLM's `tensorrt_llm` model uses where one exists (`gpt_model_type`,
`batch_scheduler_policy`, `max_tokens_in_paged_kv_cache`, `max_queue_size`, ...), so the same
knobs mean the same thing on both engines.

`timing: emulated` keeps a GPU's time instead of computing a model (engine/emulated.py): the
engine's shape parameters that the config leaves out (sequences, token budget, KV pool, chunking,
queue) then come from the cost profile, so an emulated engine is the profile's GPU by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scheduler_svc.profiles import DEFAULT_PROFILE, CostProfile, load_profile

BatchingStrategy = Literal["inflight", "static"]
SchedulerPolicy = Literal["guaranteed_no_evict", "max_utilization"]
ChunkingPolicy = Literal["first_come_first_served", "equal_progress"]
EosModel = Literal["none", "lognormal"]
Timing = Literal["real", "emulated"]

# TensorRT-LLM spells the strategies this way in `gpt_model_type`; both spellings are accepted.
_STRATEGY_ALIASES: dict[str, BatchingStrategy] = {
    "inflight": "inflight",
    "inflight_fused_batching": "inflight",
    "inflight_batching": "inflight",
    "static": "static",
    "v1": "static",
}

# DeepSeek-V4's tokenizer: 129,280 ids, <｜end▁of▁sentence｜> = 1, <｜▁pad▁｜> = 2.
DEEPSEEK_V4_VOCAB_SIZE = 129_280
DEEPSEEK_V4_END_ID = 1
DEEPSEEK_V4_PAD_ID = 2


class ModelSpec(BaseModel):
    """Shape of the decoder-only model (a transformers Llama) with random weights."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(DEEPSEEK_V4_VOCAB_SIZE, ge=16, description="Vocabulary size.")
    hidden_size: int = Field(64, ge=8, le=8192, description="Model width.")
    num_layers: int = Field(6, ge=1, le=128, description="Decoder layers.")
    num_heads: int = Field(2, ge=1, le=128, description="Attention heads (K/V heads equal).")
    head_dim: int = Field(64, ge=8, le=256, description="Width of one attention head.")
    intermediate_size: int = Field(1024, ge=8, description="MLP inner width.")
    seed: int = Field(0, ge=0, description="Seed of the random weights.")


class EngineConfig(BaseModel):
    """Everything the engine needs to run; frozen and validated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batching_strategy: BatchingStrategy = Field(
        "inflight",
        description="`inflight`: iteration-level continuous batching over the paged KV cache. "
        "`static` (TensorRT-LLM's V1): a batch prefills on the padded [rows x longest] "
        "tensor and decodes in lockstep until its longest row ends.",
    )
    batch_scheduler_policy: SchedulerPolicy = Field(
        "guaranteed_no_evict",
        description="`guaranteed_no_evict` reserves prompt + maximum output at admission; "
        "`max_utilization` allocates as tokens grow and pauses (then recomputes) requests "
        "when the pool runs dry.",
    )
    tokens_per_block: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    max_tokens_in_paged_kv_cache: int = Field(
        16_384, ge=1, description="KV pool size in tokens; the pool has this // tokens_per_block."
    )
    max_num_sequences: int = Field(
        16, ge=1, le=1024, description="Most sequences in flight at once (the engine batch)."
    )
    max_num_tokens: int = Field(
        4_096, ge=1, description="Most tokens one iteration processes (context + generation)."
    )
    enable_chunked_context: bool = Field(
        False,
        description="Split a prompt's context phase across iterations, within max_num_tokens "
        "a step: running sequences keep decoding between its chunks (in-flight batching only).",
    )
    context_chunking_policy: ChunkingPolicy = Field(
        "first_come_first_served",
        description="How chunked context shares a step's token budget between prompts: "
        "`first_come_first_served` (oldest prompt first) or `equal_progress` (equal chunks, so "
        "a short prompt is not held behind a long one).",
    )
    enable_kv_cache_reuse: bool = Field(
        False,
        description="Keep computed prompt blocks cached and share them with later prompts that "
        "start with the same tokens, skipping their prefill; unheld cached blocks are evicted "
        "least recently used (in-flight batching only).",
    )
    max_input_len: int = Field(4_096, ge=1, description="Longest accepted prompt in tokens.")
    max_output_len: int = Field(1_024, ge=1, description="Largest accepted request_output_len.")
    max_queue_size: int = Field(
        0, ge=0, description="Most requests waiting for admission; 0 means unbounded."
    )
    exclude_input_in_output: bool = Field(
        True, description="Return only generated tokens in `output_ids`."
    )
    end_id: int = Field(DEEPSEEK_V4_END_ID, ge=-1, description="Default end id; -1 for none.")
    pad_id: int = Field(DEEPSEEK_V4_PAD_ID, ge=0, description="Default pad id.")
    num_threads: int = Field(1, ge=1, le=256, description="Torch intra-op threads.")
    metrics_interval_ms: int = Field(
        50, ge=0, le=10_000, description="Least time between two metric publications."
    )
    eos_model: EosModel = Field(
        "none",
        description="`lognormal`: each row ends with its end id after a length drawn, per "
        "prompt and deterministically, from a lognormal (as a trained model stops); `none`: "
        "random weights run every row to its max tokens (engine/eos.py).",
    )
    eos_mean_tokens: float = Field(
        40.0, gt=0, le=1_000_000, description="Mean generated length under `lognormal`."
    )
    eos_sigma: float = Field(
        0.8, gt=0, le=4, description="Standard deviation of the log of the length."
    )
    eos_seed: int = Field(0, ge=0, lt=2**63, description="Seed of the length draws.")
    timing: Timing = Field(
        "real",
        description="`real`: run the model (a step takes what it takes on this CPU); "
        "`emulated`: a cheap deterministic token source, and each step lasts what the cost "
        "profile says a GPU takes for it, times `time_scale` (engine/emulated.py).",
    )
    cost_profile: str = Field(
        DEFAULT_PROFILE,
        min_length=1,
        description="Emulated timing's cost profile: a bundled name (h200-8b-bf16, "
        "a100-8b-awq) or a profile file's path.",
    )
    time_scale: float = Field(
        1.0,
        ge=1.0,
        le=1000.0,
        description="Emulated timing: a step takes its modelled time times this of wall time, "
        "so a small machine keeps up with a GPU's rates (loads and SLOs scale with it).",
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="Model shape.")

    @property
    def num_blocks(self) -> int:
        """Blocks in the KV pool."""
        return self.max_tokens_in_paged_kv_cache // self.tokens_per_block

    def profile(self) -> CostProfile:
        """The cost profile emulated timing keeps (ValueError if it cannot be read)."""
        return load_profile(self.cost_profile)

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.num_blocks < 1:
            raise ValueError("max_tokens_in_paged_kv_cache is smaller than one block")
        if self.enable_chunked_context and self.batching_strategy == "static":
            raise ValueError(
                "enable_chunked_context needs in-flight batching (gpt_model_type "
                "inflight_fused_batching); a static batch prefills whole"
            )
        if self.enable_kv_cache_reuse and self.batching_strategy == "static":
            raise ValueError(
                "enable_kv_cache_reuse needs in-flight batching (gpt_model_type "
                "inflight_fused_batching); a static batch pads its prompts, so blocks never line up"
            )
        if self.max_num_tokens < self.max_num_sequences:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least max_num_sequences "
                f"({self.max_num_sequences}): every running sequence decodes a token a step"
            )
        if not self.enable_chunked_context and self.max_num_tokens < self.max_input_len:
            # Without chunked context a whole prompt must fit in one iteration.
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least "
                f"max_input_len ({self.max_input_len})"
            )
        if self.end_id >= self.model.vocab_size or self.pad_id >= self.model.vocab_size:
            raise ValueError("end_id and pad_id must lie inside the vocabulary")
        if self.timing == "emulated":
            self.profile()  # a profile that cannot be read fails the model's load, by name
        return self

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> EngineConfig:
        """Build from `config.pbtxt` string parameters, naming any unknown or bad key."""
        model_keys = set(ModelSpec.model_fields)
        engine_keys = set(cls.model_fields) - {"model", "batching_strategy"}
        top: dict[str, Any] = {}
        model: dict[str, Any] = {}
        for key, raw in params.items():
            value = raw.strip()
            if key == "gpt_model_type":
                strategy = _STRATEGY_ALIASES.get(value.lower())
                if strategy is None:
                    raise ValueError(
                        f"parameter gpt_model_type={value!r}: expected one of "
                        f"{sorted(_STRATEGY_ALIASES)}"
                    )
                top["batching_strategy"] = strategy
            elif key.startswith("model_") and key.removeprefix("model_") in model_keys:
                model[key.removeprefix("model_")] = value
            elif key in engine_keys:
                top[key] = value
            else:
                raise ValueError(f"unknown engine parameter {key!r}")
        if top.get("timing", "real").strip() == "emulated":
            top = {**_profile_shape(top.get("cost_profile", DEFAULT_PROFILE)), **top}
        try:
            return cls(**top, model=ModelSpec(**model))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
            )
            raise ValueError(f"invalid engine parameters: {problems}") from None


def _profile_shape(spec: str) -> dict[str, Any]:
    """The engine parameters a cost profile sets where the config leaves them out."""
    try:
        profile = load_profile(spec.strip())
    except ValueError as exc:
        raise ValueError(f"parameter cost_profile: {exc}") from None
    return {
        "max_num_sequences": profile.max_num_sequences,
        "max_num_tokens": profile.max_num_tokens,
        "tokens_per_block": profile.tokens_per_block,
        "max_tokens_in_paged_kv_cache": profile.total_blocks * profile.tokens_per_block,
        "enable_chunked_context": True,
        "context_chunking_policy": profile.context_chunking_policy,
        "max_queue_size": profile.max_queue_size,
    }
