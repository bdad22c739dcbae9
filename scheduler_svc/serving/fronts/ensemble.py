"""Triton's text ensemble contract, the one both the KServe front (gRPC) and Triton's generate
extension (HTTP) serve: its inputs and their types, its metadata, and the generation
parameters its inputs and Triton's request parameters make."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from scheduler_svc.contracts.generation import GenerationParams
from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.errors import BadRequestError, clip
from scheduler_svc.serving.fronts.kserve_params import (
    INDEX_OUTPUTS,
    LOG_PROB_OUTPUTS,
    refuse_what_the_engine_cannot_do,
    triton_urgency,
)


@dataclass(frozen=True)
class TextInput:
    datatype: str
    config_type: int
    optional: bool
    words: bool = False  # a list of words per request ([1, n]), not one value


INPUTS: dict[str, TextInput] = {
    "text_input": TextInput("BYTES", mc.TYPE_STRING, False),
    "max_tokens": TextInput("INT32", mc.TYPE_INT32, False),
    "stream": TextInput("BOOL", mc.TYPE_BOOL, True),
    "temperature": TextInput("FP32", mc.TYPE_FP32, True),
    "top_k": TextInput("INT32", mc.TYPE_INT32, True),
    "top_p": TextInput("FP32", mc.TYPE_FP32, True),
    "random_seed": TextInput("UINT64", mc.TYPE_UINT64, True),
    "end_id": TextInput("INT32", mc.TYPE_INT32, True),
    "pad_id": TextInput("INT32", mc.TYPE_INT32, True),
    "bad_words": TextInput("BYTES", mc.TYPE_STRING, True, words=True),
    "stop_words": TextInput("BYTES", mc.TYPE_STRING, True, words=True),
    "length_penalty": TextInput("FP32", mc.TYPE_FP32, True),
    "repetition_penalty": TextInput("FP32", mc.TYPE_FP32, True),
    "min_length": TextInput("INT32", mc.TYPE_INT32, True),
    "presence_penalty": TextInput("FP32", mc.TYPE_FP32, True),
    "frequency_penalty": TextInput("FP32", mc.TYPE_FP32, True),
    "beam_width": TextInput("INT32", mc.TYPE_INT32, True),
    "return_log_probs": TextInput("BOOL", mc.TYPE_BOOL, True),
    "return_context_logits": TextInput("BOOL", mc.TYPE_BOOL, True),
    "return_generation_logits": TextInput("BOOL", mc.TYPE_BOOL, True),
    "exclude_input_in_output": TextInput("BOOL", mc.TYPE_BOOL, True),
}

OUTPUT = "text_output"


def ensemble_metadata(model: str) -> dict[str, Any]:
    """The text ensemble's metadata as Triton reports it: what the gRPC and the HTTP front both
    answer for `model` (inputs [rows, n], outputs with each row's batch and sequence index)."""
    return {
        "name": model,
        "versions": ["1"],
        "platform": "ensemble",
        "inputs": [
            {"name": name, "datatype": spec.datatype, "shape": [-1, -1 if spec.words else 1]}
            for name, spec in INPUTS.items()
        ],
        "outputs": [
            {"name": OUTPUT, "datatype": "BYTES", "shape": [-1, -1]},
            {"name": "cum_log_probs", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "output_log_probs", "datatype": "FP32", "shape": [-1, -1, -1]},
            *({"name": name, "datatype": "INT32", "shape": [-1, 1]} for name in INDEX_OUTPUTS),
        ],
    }


TEXT_OUTPUTS = (OUTPUT, *LOG_PROB_OUTPUTS, *INDEX_OUTPUTS)


def params_from_inputs(
    values: dict[str, object],
    request_id: str,
    priority: int | None,
    timeout_us: int | None,
    time_remaining_s: float | None,
) -> GenerationParams:
    """The generation parameters of the ensemble's inputs (checked against INPUTS: names and
    types) and Triton's request parameters `priority` and `timeout`."""
    for name, spec in INPUTS.items():
        if not spec.optional and name not in values:
            raise BadRequestError(f"missing required input '{name}'")
    raw_text = values["text_input"]
    if isinstance(raw_text, str):
        text = raw_text
    else:
        assert isinstance(raw_text, bytes)
        try:
            text = raw_text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequestError(
                f"text_input: not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
    if timeout_us is not None and timeout_us < 0:
        raise BadRequestError(f"parameter timeout: {timeout_us} is negative")
    refuse_what_the_engine_cannot_do(values)
    # length_penalty only ranks beams: with one beam it changes nothing, so it is accepted.

    def number(name: str, default: float) -> float:
        return float(values.get(name, default))  # type: ignore[arg-type]

    return GenerationParams(
        request_id=request_id,
        prompt=text,
        max_tokens=int(values["max_tokens"]),  # type: ignore[call-overload]
        sampling=Sampling(
            temperature=number("temperature", 0.0),
            top_k=int(values.get("top_k", 0)),  # type: ignore[call-overload]
            top_p=number("top_p", 0.0),
            seed=int(values.get("random_seed", 0)),  # type: ignore[call-overload]
            min_length=int(values.get("min_length", 0)),  # type: ignore[call-overload]
            repetition_penalty=number("repetition_penalty", 1.0),
            presence_penalty=number("presence_penalty", 0.0),
            frequency_penalty=number("frequency_penalty", 0.0),
        ),
        end_id=int(values["end_id"]) if "end_id" in values else None,  # type: ignore[call-overload]
        pad_id=int(values["pad_id"]) if "pad_id" in values else None,  # type: ignore[call-overload]
        stop_words=_text_words(values.get("stop_words"), "stop_words"),
        bad_words=_text_words(values.get("bad_words"), "bad_words"),
        return_log_probs=bool(values.get("return_log_probs", False)),
        urgency=triton_urgency(priority),
        queue_timeout_s=timeout_us / 1e6 if timeout_us else None,
        time_remaining_s=time_remaining_s,
    )


def _text_words(value: object, name: str) -> tuple[str, ...]:
    """A words input as text: each element one word (empty ones dropped)."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else [value]
    out = []
    for item in items:
        word = item
        if isinstance(item, bytes):
            try:
                word = item.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequestError(f"{name}: a word is not valid UTF-8") from None
        if not isinstance(word, str):
            raise BadRequestError(f"{name}: expected text, got {clip(repr(word))}")
        if word:
            out.append(word)
    return tuple(out)
