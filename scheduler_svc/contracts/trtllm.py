"""TensorRT-LLM's `tensorrt_llm` tensor contract, written once: the sidecar's Triton client, its
KServe engine front, the ensemble's preprocessing and the reference engine all read it here.

What is here is the contract itself (which inputs exist, their datatypes and shapes, the
word-list layout, what this engine refuses); each side checks what only it knows (the engine
its vocabulary and limits, the front its row bound) and raises its own error type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# numpy dtype kinds that carry each KServe datatype (integers may come signed or not).
_KINDS = {"INT32": "iu", "UINT64": "iu", "FP32": "f", "BOOL": "b"}


@dataclass(frozen=True)
class Input:
    datatype: str  # KServe's
    shape: str  # ids: [rows, tokens]; one: a value per row; words: [rows, 2, n]
    required: bool = False
    lenient: bool = False  # an integer is taken where a float is declared (penalties)

    @property
    def numpy_kinds(self) -> str:
        """The numpy dtype kinds the engine accepts for it."""
        return _KINDS[self.datatype] + ("iu" if self.lenient else "")


INPUTS: dict[str, Input] = {
    "input_ids": Input("INT32", "ids", required=True),
    "input_lengths": Input("INT32", "one", required=True),
    "request_output_len": Input("INT32", "one", required=True),
    "end_id": Input("INT32", "one"),
    "pad_id": Input("INT32", "one"),
    "streaming": Input("BOOL", "one"),
    "stop": Input("BOOL", "one"),
    "temperature": Input("FP32", "one"),
    "runtime_top_k": Input("INT32", "one"),
    "runtime_top_p": Input("FP32", "one"),
    "random_seed": Input("UINT64", "one"),
    "stop_words_list": Input("INT32", "words"),
    "bad_words_list": Input("INT32", "words"),
    "min_length": Input("INT32", "one"),
    "repetition_penalty": Input("FP32", "one", lenient=True),
    "presence_penalty": Input("FP32", "one", lenient=True),
    "frequency_penalty": Input("FP32", "one", lenient=True),
    "len_penalty": Input("FP32", "one", lenient=True),
    "beam_width": Input("INT32", "one"),
    "return_log_probs": Input("BOOL", "one"),
    "return_context_logits": Input("BOOL", "one"),
    "return_generation_logits": Input("BOOL", "one"),
    "exclude_input_in_output": Input("BOOL", "one"),
}

# What a model's metadata must list to be TensorRT-LLM's engine (token ids in and out): the
# tensors the sidecar sends and reads, with their datatypes.
IDENTIFYING_INPUTS = frozenset(
    (name, INPUTS[name].datatype) for name in ("input_ids", "input_lengths", "request_output_len")
)
IDENTIFYING_OUTPUTS = frozenset({"output_ids"})

# What this engine cannot produce, refused by name. (Log probabilities it produces.)
NOT_PRODUCED = {
    "return_context_logits": "context logits are not produced by this engine",
    "return_generation_logits": "generation logits are not produced by this engine",
}


def refusal(row: Mapping[str, object]) -> str | None:
    """Why one row's values ask for what this engine cannot do (more than one beam, logits,
    the prompt in the output), or None. `len_penalty` only ranks beams: with one beam any
    value is accepted."""
    beams = row.get("beam_width")
    if beams is not None and beams != 1:
        return f"beam_width: {beams}; this engine decodes one beam (beam_width 1)"
    for name, why in NOT_PRODUCED.items():
        if row.get(name):
            return f"{name}: {why}"
    exclude = row.get("exclude_input_in_output")
    if exclude is not None and not exclude:
        return (
            "exclude_input_in_output: false is not supported; this engine returns the "
            "generated tokens only"
        )
    return None


def word_lists(rows: list[tuple[tuple[int, ...], ...]]) -> npt.NDArray[np.int32]:
    """The `stop_words_list` / `bad_words_list` layout, [rows, 2, n]: each row's words' ids
    end to end, then each word's end offset; both padded with -1 to the longest row."""
    flat = [[t for word in words for t in word] for words in rows]
    width = max(1, *(len(f) for f in flat))
    out = np.full((len(rows), 2, width), -1, dtype=np.int32)
    for i, words in enumerate(rows):
        out[i, 0, : len(flat[i])] = flat[i]
        end = 0
        for j, word in enumerate(words):
            end += len(word)
            out[i, 1, j] = end
    return out


def read_word_lists(
    array: npt.NDArray[np.generic], rows: int, name: str
) -> list[tuple[tuple[int, ...], ...]]:
    """Each of `rows` rows' words from the layout `word_lists` writes ([rows, 2, n], or [1, 2, n]
    or [2, n] for every row alike). ValueError names the tensor and what is wrong."""
    if array.ndim == 2:
        array = array.reshape(1, *array.shape)
    if array.ndim != 3 or array.shape[0] not in (1, rows) or array.shape[1] != 2:
        raise ValueError(
            f"{name}: expected shape [rows, 2, n] ({rows} rows), got {list(array.shape)}"
        )
    out: list[tuple[tuple[int, ...], ...]] = []
    for r, (ids, offsets) in enumerate(array.astype(np.int64)):
        words, start = [], 0
        for end in (int(o) for o in offsets if o >= 0):
            if not start < end <= len(ids):
                raise ValueError(f"{name}: offsets must rise within the {len(ids)} ids (row {r})")
            words.append(tuple(int(t) for t in ids[start:end]))
            start = end
        out.append(tuple(words))
    return out * rows if len(out) == 1 else out
