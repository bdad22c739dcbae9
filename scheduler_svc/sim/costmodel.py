"""What one engine step costs: TensorRT-LLM on one A100 80GB, an 8B-class model, AWQ int4.

Sources (facts, not code):
- TensorRT-LLM's published A100 figures (docs/source/performance.md, v0.5-v0.6), LLaMA 7B FP16:
  first-token latency 16 ms at 128 input tokens and 133 ms at 2,048, so prefill costs about
  (133 - 16) / 1,920 = 61 us per prompt token on top of a ~8 ms step; 1,928 output tokens/s at
  batch 60 with 128 in / 2,048 out, so a decode step at batch 60 takes about 31 ms; 5,586
  tokens/s at batch 384 with 128 / 128, about 69 ms a step: (69 - 8) / 384 = 0.16 ms a row at
  short contexts. The per-row cost below (0.18 ms) sits between the two.
- An 8B-class model (Llama-3-8B shape: 32 layers, 8 KV heads of 128, fp16 KV) holds
  2 x 32 x 8 x 128 x 2 bytes = 128 KiB of KV per token.
- AWQ int4 weights are ~5.7 GB instead of ~16 GB: a decode step at small batch reads a third of
  the bytes, so its floor drops from ~8 ms to ~6.5 ms (kernel launch and attention overheads
  stay); prefill stays compute-bound, so its per-token cost is kept at the FP16 figure + 6 %
  for the larger model.
- KV pool: kv_cache_free_gpu_mem_fraction 0.85 of what is left after weights and activations
  (80 GB - 5.7 GB - ~2 GB) = ~61 GB, i.e. ~29,000 blocks of 16 tokens.
The derived constants are below; `docs/policy.md` repeats them next to the simulator's tables.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class CostModel:
    """Step time = floor + per sequence + per context token read + per prefilled token."""

    name: str = "A100-80GB, 8B-class, AWQ int4, TensorRT-LLM"
    step_floor_s: float = 0.0065
    per_sequence_s: float = 0.00018
    per_context_token_s: float = 8.7e-8  # 128 KiB read at ~1.5 TB/s
    per_prefill_token_s: float = 6.5e-5
    kv_bytes_per_token: int = 128 * 1024
    kv_pool_bytes: int = int(0.85 * (80 - 5.7 - 2.0) * 1e9)
    tokens_per_block: int = 16
    max_num_seqs: int = 64
    max_num_tokens: int = 8192  # tokens prefilled per step (chunked context)
    # How prompts in their context phase share a step (TensorRT-LLM's ContextChunkingPolicy;
    # its default is first come, first served).
    context_chunking_policy: str = "first_come_first_served"
    max_seq_len: int = 8192
    max_queue_size: int = 512  # the backend's own queue (TensorRT-LLM's max_queue_size)

    @property
    def total_blocks(self) -> int:
        return self.kv_pool_bytes // (self.kv_bytes_per_token * self.tokens_per_block)

    def step_s(self, sequences: int, context_tokens: int, prefill_tokens: int) -> float:
        """One engine iteration over `sequences` rows holding `context_tokens` in all."""
        return (
            self.step_floor_s
            + self.per_sequence_s * sequences
            + self.per_context_token_s * context_tokens
            + self.per_prefill_token_s * prefill_tokens
        )


A100_AWQ_8B = CostModel()
