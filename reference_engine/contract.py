"""TensorRT-LLM's `tensorrt_llm` tensor contract: parse and check one request's inputs.

Triton itself rejects a missing required tensor or a wrong data type before the model sees the
request; this module checks what only the engine knows (shapes across tensors, lengths, limits,
token ranges) and names the tensor at fault in every error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from reference_engine.config import EngineConfig
from reference_engine.errors import InvalidRequestError
from reference_engine.request import RowSpec, Sampling
from scheduler_svc.contracts.trtllm import INPUTS, NOT_PRODUCED, read_word_lists, refusal

Tensors = Mapping[str, npt.NDArray[np.generic]]

MAX_STOP_WORDS = 64  # per row
MAX_STOP_WORD_TOKENS = 64


@dataclass(frozen=True)
class ParsedRequest:
    rows: list[RowSpec]
    streaming: bool
    stop: bool
    sampling: Sampling


def _per_row(tensors: Tensors, name: str, num_rows: int) -> npt.NDArray[np.generic] | None:
    """One value per row from a [rows] or [rows, 1] tensor (a single value is broadcast)."""
    value = tensors.get(name)
    if value is None:
        return None
    if value.dtype.kind not in INPUTS[name].numpy_kinds:
        raise InvalidRequestError(f"{name}: unexpected data type {value.dtype}")
    flat = np.asarray(value).reshape(-1)
    if flat.size == 1:
        return np.repeat(flat, num_rows)
    if flat.size != num_rows:
        raise InvalidRequestError(
            f"{name}: expected one value per row ({num_rows} rows), got shape {list(value.shape)}"
        )
    return flat


def parse_request(tensors: Tensors, cfg: EngineConfig) -> ParsedRequest:
    """Turn a request's input tensors into rows, or raise `InvalidRequestError`."""
    stop = tensors.get("stop")
    if stop is not None and stop.dtype.kind == "b" and bool(np.asarray(stop).any()):
        # A stop request only names the request to end; its other tensors are ignored.
        return ParsedRequest([], streaming=False, stop=True, sampling=Sampling())
    ids = tensors.get("input_ids")
    if ids is None:
        raise InvalidRequestError("input_ids: missing")
    if ids.dtype.kind not in "iu":
        raise InvalidRequestError(f"input_ids: unexpected data type {ids.dtype}")
    if ids.ndim == 1:
        ids = ids.reshape(1, -1)
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise InvalidRequestError(
            f"input_ids: expected shape [rows, tokens] with at least one token, "
            f"got {list(ids.shape)}"
        )
    num_rows, width = ids.shape
    lengths = _per_row(tensors, "input_lengths", num_rows)
    if lengths is None:
        raise InvalidRequestError("input_lengths: missing")
    out_lens = _per_row(tensors, "request_output_len", num_rows)
    if out_lens is None:
        raise InvalidRequestError("request_output_len: missing")
    end_ids = _per_row(tensors, "end_id", num_rows)
    pad_ids = _per_row(tensors, "pad_id", num_rows)
    vocab = cfg.model.vocab_size
    stop_words = _word_lists(tensors, "stop_words_list", num_rows, vocab)
    bad_words = _word_lists(tensors, "bad_words_list", num_rows, vocab)
    min_lengths = _per_row(tensors, "min_length", num_rows)
    log_flags = _per_row(tensors, "return_log_probs", num_rows)
    samplings = _samplings(tensors, num_rows)
    _refuse_what_cannot_be_done(tensors, num_rows)
    rows: list[RowSpec] = []
    for r in range(num_rows):
        length, out_len = int(lengths[r]), int(out_lens[r])
        if length < 1:
            raise InvalidRequestError(f"input_lengths: row {r} has length {length}, must be >= 1")
        if length > width:
            raise InvalidRequestError(
                f"input_lengths: row {r} claims {length} tokens but input_ids rows hold {width}"
            )
        if out_len < 1 or out_len > cfg.max_output_len:
            raise InvalidRequestError(
                f"request_output_len: row {r} asks for {out_len} tokens, allowed 1.."
                f"{cfg.max_output_len}"
            )
        prompt = ids[r, :length].astype(np.int64)
        bad = prompt[(prompt < 0) | (prompt >= vocab)]
        if bad.size:
            raise InvalidRequestError(
                f"input_ids: row {r} holds token id {int(bad[0])} outside the vocabulary "
                f"0..{vocab - 1}"
            )
        end_id = int(end_ids[r]) if end_ids is not None else cfg.end_id
        pad_id = int(pad_ids[r]) if pad_ids is not None else cfg.pad_id
        if not -1 <= end_id < vocab:
            raise InvalidRequestError(f"end_id: {end_id} is outside the vocabulary")
        if not 0 <= pad_id < vocab:
            raise InvalidRequestError(f"pad_id: {pad_id} is outside the vocabulary")
        min_length = int(min_lengths[r]) if min_lengths is not None else 0
        if not 0 <= min_length <= out_len:
            raise InvalidRequestError(
                f"min_length: row {r} asks for {min_length}, allowed 0..{out_len} "
                "(its request_output_len)"
            )
        rows.append(
            RowSpec(
                tuple(int(t) for t in prompt),
                out_len,
                end_id,
                pad_id,
                stop_words=stop_words[r],
                bad_words=bad_words[r],
                min_length=min_length,
                sampling=samplings[r],
                return_log_probs=bool(log_flags[r]) if log_flags is not None else False,
            )
        )
    return ParsedRequest(
        rows=rows,
        streaming=_first_bool(tensors, "streaming", num_rows),
        stop=False,
        sampling=samplings[0],
    )


def _refuse_what_cannot_be_done(tensors: Tensors, num_rows: int) -> None:
    """Beams, logits and the prompt in the output, refused by name (contracts/trtllm.py)."""
    names = ("beam_width", *NOT_PRODUCED, "exclude_input_in_output", "len_penalty")
    columns = {name: _per_row(tensors, name, num_rows) for name in names}
    for r in range(num_rows):
        row = {name: column[r].item() for name, column in columns.items() if column is not None}
        why = refusal(row)
        if why is not None:
            raise InvalidRequestError(why)


def _word_lists(
    tensors: Tensors, name: str, num_rows: int, vocab: int
) -> list[tuple[tuple[int, ...], ...]]:
    """TensorRT-LLM's `stop_words_list` / `bad_words_list` per row, within this engine's
    limits (words per row, tokens per word) and its vocabulary."""
    value = tensors.get(name)
    if value is None:
        return [()] * num_rows
    if value.dtype.kind not in INPUTS[name].numpy_kinds:
        raise InvalidRequestError(f"{name}: unexpected data type {value.dtype}")
    try:
        rows = read_word_lists(np.asarray(value), num_rows, name)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    for r, words in enumerate(rows):
        if len(words) > MAX_STOP_WORDS:
            raise InvalidRequestError(f"{name}: {len(words)} words, at most {MAX_STOP_WORDS}")
        if any(len(word) > MAX_STOP_WORD_TOKENS for word in words):
            raise InvalidRequestError(
                f"{name}: row {r} has a word over {MAX_STOP_WORD_TOKENS} tokens"
            )
        if any(not 0 <= t < vocab for word in words for t in word):
            raise InvalidRequestError(f"{name}: row {r} holds a token outside the vocabulary")
    return rows


def _first_bool(tensors: Tensors, name: str, num_rows: int) -> bool:
    values = _per_row(tensors, name, num_rows)
    return bool(values[0]) if values is not None else False


def _samplings(tensors: Tensors, num_rows: int) -> list[Sampling]:
    """Each row's sampling and penalties (a request's rows may differ, as TensorRT-LLM's)."""
    names = (
        "temperature",
        "runtime_top_k",
        "runtime_top_p",
        "random_seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    )
    columns = {name: _per_row(tensors, name, num_rows) for name in names}

    def value(name: str, r: int, default: float) -> float:
        column = columns[name]
        return float(column[r]) if column is not None else default

    out = []
    for r in range(num_rows):
        seeds = columns["random_seed"]
        sampling = Sampling(
            temperature=value("temperature", r, 1.0),
            top_k=int(value("runtime_top_k", r, 0)),
            top_p=value("runtime_top_p", r, 0.0),
            seed=int(seeds[r]) if seeds is not None else 0,
            repetition_penalty=value("repetition_penalty", r, 1.0),
            presence_penalty=value("presence_penalty", r, 0.0),
            frequency_penalty=value("frequency_penalty", r, 0.0),
        )
        if sampling.temperature < 0:
            raise InvalidRequestError(f"temperature: {sampling.temperature} is negative")
        if sampling.top_k < 0:
            raise InvalidRequestError(f"runtime_top_k: {sampling.top_k} is negative")
        if not 0.0 <= sampling.top_p <= 1.0:
            raise InvalidRequestError(f"runtime_top_p: {sampling.top_p} is outside 0..1")
        penalty = sampling.repetition_penalty
        if not (np.isfinite(penalty) and penalty > 0):
            raise InvalidRequestError(f"repetition_penalty: {penalty} is not a positive number")
        for name in ("presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(sampling, name)):
                raise InvalidRequestError(f"{name}: {getattr(sampling, name)} is not finite")
        out.append(sampling)
    return out
