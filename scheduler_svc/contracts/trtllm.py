"""TensorRT-LLM's `tensorrt_llm` tensor contract, where the sidecar, the ensemble's
preprocessing and the reference engine must agree on one layout."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

# What a model's metadata must list to be TensorRT-LLM's engine (token ids in and out): the
# tensors the sidecar sends and reads, with their datatypes.
IDENTIFYING_INPUTS = frozenset(
    {("input_ids", "INT32"), ("input_lengths", "INT32"), ("request_output_len", "INT32")}
)
IDENTIFYING_OUTPUTS = frozenset({"output_ids"})


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
