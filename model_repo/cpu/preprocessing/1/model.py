"""Ensemble step 1: tokenize `QUERY` into padded `INPUT_ID` rows with their lengths."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from reference_engine.config import DEEPSEEK_V4_END_ID, DEEPSEEK_V4_PAD_ID
from scheduler_svc.contracts.trtllm import word_lists
from scheduler_svc.serving.tokenizer import load_tokenizer


def _optional(request: Any, name: str, default: int, rows: int) -> np.ndarray:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return np.full((rows, 1), default, dtype=np.int32)
    return tensor.as_numpy().astype(np.int32).reshape(rows, 1)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = json.loads(args["model_config"]).get("parameters", {})
        tokenizer_dir = params.get("tokenizer_dir", {}).get("string_value", "deepseek-v4")
        self.tokenizer = load_tokenizer(tokenizer_dir)
        # The model's own end and pad ids (a client may still send its own per request).
        self.end_id = int(params.get("end_id", {}).get("string_value", DEEPSEEK_V4_END_ID))
        self.pad_id = int(params.get("pad_id", {}).get("string_value", DEEPSEEK_V4_PAD_ID))
        # Special tokens (BOS) as TensorRT-LLM's preprocessing adds them by default.
        special = params.get("add_special_tokens", {}).get("string_value", "true")
        self.add_special_tokens = special.lower() == "true"
        # Special tokens (BOS) as TensorRT-LLM's preprocessing adds them by default.
        special = params.get("add_special_tokens", {}).get("string_value", "true")
        self.add_special_tokens = special.lower() == "true"

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        queries = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)
        rows = len(queries)
        texts = [q.decode("utf-8") if isinstance(q, bytes) else str(q) for q in queries]
        special = self.add_special_tokens
        encoded = [self.tokenizer.encode(text, add_special_tokens=special).ids for text in texts]
        if any(not ids for ids in encoded):
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(
                    "text_input: the prompt is empty after tokenization",
                    pb_utils.TritonError.INVALID_ARG,
                )
            )
        pad_ids = _optional(request, "PAD_ID", self.pad_id, rows)
        width = max(len(ids) for ids in encoded)
        input_ids = np.empty((rows, width), dtype=np.int32)
        for r, ids in enumerate(encoded):
            input_ids[r] = pad_ids[r, 0]
            input_ids[r, : len(ids)] = ids
        out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("INPUT_ID", input_ids),
                pb_utils.Tensor(
                    "REQUEST_INPUT_LEN",
                    np.asarray([[len(ids)] for ids in encoded], dtype=np.int32),
                ),
                pb_utils.Tensor(
                    "REQUEST_OUTPUT_LEN_OUT", out_len.astype(np.int32).reshape(rows, 1)
                ),
                pb_utils.Tensor("OUT_END_ID", _optional(request, "END_ID", self.end_id, rows)),
                pb_utils.Tensor("OUT_PAD_ID", pad_ids),
                pb_utils.Tensor("BAD_WORDS_IDS", self._words(request, "BAD_WORDS_DICT", rows)),
                pb_utils.Tensor("STOP_WORDS_IDS", self._words(request, "STOP_WORDS_DICT", rows)),
            ]
        )

    def _words(self, request: Any, name: str, rows: int) -> np.ndarray:
        """Each row's words (one per element, as text) as token ids, in TensorRT-LLM's
        word-list layout; a row without words gets an empty list (offsets all -1)."""
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        per_row: list[tuple[tuple[int, ...], ...]] = [()] * rows
        if tensor is not None:
            values = tensor.as_numpy().reshape(rows, -1)
            encode = self.tokenizer.encode
            per_row = [
                tuple(
                    ids
                    for ids in (tuple(encode(_text(w), add_special_tokens=False).ids) for w in row)
                    if ids  # an empty word (a tokenizer that makes nothing of it) is no word
                )
                for row in values
            ]
        return word_lists(per_row)
