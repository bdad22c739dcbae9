"""Ensemble step 3: decode `TOKENS_BATCH` [rows, beams, tokens] into one string per beam."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from scheduler_svc.serving.tokenizer import load_tokenizer


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = json.loads(args["model_config"]).get("parameters", {})
        tokenizer_dir = params.get("tokenizer_dir", {}).get("string_value", "deepseek-v4")
        skip = params.get("skip_special_tokens", {}).get("string_value", "true")
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.skip_special = skip.lower() == "true"

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        rows, beams = tokens.shape[0], tokens.shape[1]
        lengths = lengths.reshape(rows, beams)
        texts = [
            [
                self.tokenizer.decode(
                    tokens[r, b, : lengths[r, b]].tolist(),
                    skip_special_tokens=self.skip_special,
                ).encode("utf-8")
                for b in range(beams)
            ]
            for r in range(rows)
        ]
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_))]
        )
