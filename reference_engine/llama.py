"""Runs a transformers Llama on the CPU over a paged KV cache.

The model is a real `LlamaForCausalLM` (transformers 5.x) with random weights from a fixed seed.
Its attention is routed, through transformers' attention registry, to `_paged_attention` below,
which writes each layer's new keys and values into a block pool tensor and reads every
sequence's history back through its block table. All sequences of an iteration are packed into
one row of tokens (no padding between them), as TensorRT-LLM's packed in-flight batching does;
static batches bring their own pad tokens, which are computed and masked out of attention.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from reference_engine.batcher import Sampled, Work
from reference_engine.config import EngineConfig
from reference_engine.request import RunningSequence, Sampling

ATTN_NAME = "scheduler_svc_paged"


def _processed(logits: torch.Tensor, seq: RunningSequence) -> torch.Tensor | None:
    """The row's logits after its penalties and bans; None when it has none."""
    sampling = seq.sampling
    banned = seq.banned()
    if not sampling.penalized and not banned:
        return None
    out = logits.clone()
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*seq.prompt, *seq.generated}), dtype=torch.long)
        values = out[seen]
        penalty = sampling.repetition_penalty
        out[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if seq.generated and (sampling.presence_penalty or sampling.frequency_penalty):
        ids, counts = torch.unique(
            torch.tensor(seq.generated, dtype=torch.long), return_counts=True
        )
        out[ids] -= sampling.presence_penalty + sampling.frequency_penalty * counts.float()
    if banned:
        out[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    return out


def step_seed(seed: int, step: int) -> int:
    """The generator seed of one sampling step: any uint64 request seed, folded below 2**63."""
    return (seed * 1_000_003 + step) % (1 << 63)


@dataclass
class _Segment:
    """One sequence's share of the packed step: queries [q0, q1) and their keys."""

    q0: int
    q1: int
    read_slots: torch.Tensor
    mask: torch.Tensor | None
    causal: bool


@dataclass
class _Decode:
    """All single-token works of a step, attended in one batched call."""

    q_index: torch.Tensor  # positions of these queries in the packed step
    block_index: torch.Tensor  # [S, max_blocks] block ids (padded with 0)
    mask: torch.Tensor  # [S, 1, 1, max_blocks * block] keys each query may see


@dataclass
class _StepMeta:
    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    write_slots: torch.Tensor
    segments: list[_Segment]
    decode: _Decode | None
    block_size: int


def _paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    meta: _StepMeta = kwargs["paged_step"]
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]
    # query/key/value: [1, heads, T, head_dim]; the pool is [slots, heads, head_dim].
    k_cache.index_copy_(0, meta.write_slots, key[0].transpose(0, 1))
    v_cache.index_copy_(0, meta.write_slots, value[0].transpose(0, 1))
    num_tokens, heads, dim = query.shape[2], query.shape[1], query.shape[3]
    out = query.new_empty(num_tokens, heads, dim)
    for seg in meta.segments:
        q = query[:, :, seg.q0 : seg.q1]
        k = k_cache[seg.read_slots].transpose(0, 1).unsqueeze(0)
        v = v_cache[seg.read_slots].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seg.mask, is_causal=seg.causal, scale=scaling
        )
        out[seg.q0 : seg.q1] = o[0].transpose(0, 1)
    if meta.decode is not None:
        dec = meta.decode
        blocks = dec.block_index
        shape = (blocks.shape[0], blocks.shape[1] * meta.block_size, heads, dim)
        k = k_cache.view(-1, meta.block_size, heads, dim)[blocks].reshape(shape).transpose(1, 2)
        v = v_cache.view(-1, meta.block_size, heads, dim)[blocks].reshape(shape).transpose(1, 2)
        q = query[0][:, dec.q_index].transpose(0, 1).unsqueeze(2)  # [S, heads, 1, dim]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=dec.mask, scale=scaling)
        out[dec.q_index] = o.squeeze(2)
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # masks are built per sequence in `_paged_attention`


AttentionInterface.register(ATTN_NAME, _paged_attention)
AttentionMaskInterface.register(ATTN_NAME, _no_mask)


class ModelRunner:
    """Owns the model weights and the KV pool tensors; turns planned works into tokens."""

    def __init__(self, cfg: EngineConfig) -> None:
        spec = cfg.model
        torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(spec.seed)
        llama = LlamaConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=cfg.max_input_len + cfg.max_output_len,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=cfg.end_id if cfg.end_id >= 0 else None,
            pad_token_id=cfg.pad_id,
        )
        llama._attn_implementation = ATTN_NAME
        self.model = LlamaForCausalLM(llama).eval()  # type: ignore[no-untyped-call]
        self.block_size = cfg.tokens_per_block
        slots = cfg.num_blocks * cfg.tokens_per_block
        self.k_cache = [
            torch.zeros(slots, spec.num_heads, spec.head_dim) for _ in range(spec.num_layers)
        ]
        self.v_cache = [
            torch.zeros(slots, spec.num_heads, spec.head_dim) for _ in range(spec.num_layers)
        ]

    @torch.inference_mode()
    def step(self, works: Seq[Work], tables: Seq[list[int]]) -> Sampled:
        """Run one packed iteration; return one sampled token per emitting work, in order,
        with its log probability where the row asks for it."""
        ids: list[int] = []
        positions: list[int] = []
        write: list[int] = []
        segments: list[_Segment] = []
        dec_q: list[int] = []
        dec_rows: list[tuple[list[int], int, int]] = []
        last_index: list[int] = []
        for work, table in zip(works, tables, strict=True):
            seq = work.seq
            q0 = len(ids)
            ids.extend(work.tokens)
            end = work.start + len(work.tokens)
            for slot in range(work.start, end):
                positions.append(max(slot - seq.pad, 0))
                write.append(
                    table[slot // self.block_size] * self.block_size + slot % self.block_size
                )
            if len(work.tokens) == 1:
                dec_q.append(q0)
                dec_rows.append((table[: -(-end // self.block_size)], end, seq.pad))
            else:
                segments.append(self._segment(q0, len(ids), work.start, end, seq.pad, table))
            if work.emits:
                last_index.append(len(ids) - 1)
        meta = _StepMeta(
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            write_slots=torch.tensor(write, dtype=torch.long),
            segments=segments,
            decode=self._decode(dec_q, dec_rows) if dec_q else None,
            block_size=self.block_size,
        )
        hidden = self.model.model(
            input_ids=torch.tensor([ids], dtype=torch.long),
            position_ids=torch.tensor([positions], dtype=torch.long),
            paged_step=meta,
        ).last_hidden_state[0]
        if not last_index:
            return Sampled([], [])
        logits = self.model.lm_head(hidden[torch.tensor(last_index)])
        emitting = [w for w in works if w.emits]
        chosen = logits.argmax(dim=-1).tolist()  # plain greedy rows, all in one call
        log_probs: list[float | None] = [None] * len(emitting)
        for i, work in enumerate(emitting):
            seq = work.seq
            sampling = seq.sampling
            row = _processed(logits[i], seq)
            if sampling.greedy:
                if row is not None:
                    chosen[i] = int(row.argmax().item())
                if seq.return_log_probs:
                    scores = logits[i] if row is None else row
                    log_probs[i] = float(torch.log_softmax(scores, dim=-1)[chosen[i]].item())
            else:
                row = logits[i] if row is None else row
                chosen[i], log_probs[i] = self._sample(row, sampling, len(seq.generated))
                if not seq.return_log_probs:
                    log_probs[i] = None
        return Sampled([int(token) for token in chosen], log_probs)

    def _segment(
        self, q0: int, q1: int, start: int, end: int, pad: int, table: list[int]
    ) -> _Segment:
        slots = torch.tensor(
            [
                table[s // self.block_size] * self.block_size + s % self.block_size
                for s in range(end)
            ],
            dtype=torch.long,
        )
        if start == 0 and pad == 0:
            return _Segment(q0, q1, slots, None, causal=True)
        q_slots = torch.arange(start, end).unsqueeze(1)
        k_slots = torch.arange(end).unsqueeze(0)
        # A real query sees real keys up to itself; a pad query sees pads up to itself.
        mask = (k_slots <= q_slots) & ((k_slots >= pad) | (q_slots < pad))
        return _Segment(q0, q1, slots, mask, causal=False)

    def _decode(self, q_index: list[int], rows: list[tuple[list[int], int, int]]) -> _Decode:
        width = max(len(blocks) for blocks, _, _ in rows)
        block_index = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), 1, 1, width * self.block_size, dtype=torch.bool)
        for i, (blocks, length, pad) in enumerate(rows):
            block_index[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            mask[i, 0, 0, pad:length] = True
        return _Decode(torch.tensor(q_index, dtype=torch.long), block_index, mask)

    def _sample(self, logits: torch.Tensor, sampling: Sampling, step: int) -> tuple[int, float]:
        """The sampled token and its log probability under the distribution it was drawn from
        (after temperature, top_k and top_p)."""
        scores = logits / max(sampling.temperature, 1e-5)
        if sampling.top_k > 0:
            kth = torch.topk(scores, min(sampling.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if 0.0 < sampling.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        # Seeded per request and per step, so a sampled request is reproducible on its own.
        # random_seed is a uint64; torch takes a seed below 2**63 (found by `scheduler-svc
        # chaos`: a seed above it failed the engine's whole step).
        generator = torch.Generator().manual_seed(step_seed(sampling.seed, step))
        token = int(torch.multinomial(probs, 1, generator=generator).item())
        return token, float(torch.log(probs[token]).item())
