"""The `tensorrt_llm` engine contract on the KServe front: token ids in, token ids out.

TensorRT-LLM clients that talk to the engine model itself (`input_ids`, `input_lengths`,
`request_output_len`, ...) point at the sidecar unchanged: each row becomes a request of the
same `GenerationService` (the same lanes, quotas and KV admission as text requests) and the
answer has the engine's shape: `output_ids` [1, 1, tokens], `sequence_length` [1, 1],
`output_log_probs` [1, 1, tokens] and `cum_log_probs` [1, 1] where `return_log_probs` asks, and
`batch_index` / `sequence_index` for the rows of a batched request; streamed (`streaming` true)
one response per chunk of new tokens, else one per row.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import service_pb2 as kserve_pb

from scheduler_svc.contracts.generation import Delta, Final, GenerationParams
from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.contracts.trtllm import INPUTS, read_word_lists
from scheduler_svc.errors import BadRequestError, clip
from scheduler_svc.serving.fronts.kserve_params import (
    INDEX_OUTPUTS,
    LOG_PROB_OUTPUTS,
    MAX_ROWS,
    add_log_probs,
    add_output,
    add_row_index,
    raw_dtype,
    refuse_what_the_engine_cannot_do,
    request_parameter,
    route_parameters,
    triton_urgency,
    typed_contents,
)

MAX_DIMS = 4  # the contract's tensors have at most three ([rows, 2, n] word lists)
MAX_ELEMENTS = 2**32  # far above any message the server accepts


OUTPUTS = ("output_ids", "sequence_length", *LOG_PROB_OUTPUTS, *INDEX_OUTPUTS)


def _array(request: kserve_pb.ModelInferRequest, index: int) -> npt.NDArray[np.generic]:
    tensor = request.inputs[index]
    spec = INPUTS[tensor.name]
    if tensor.datatype != spec.datatype:
        raise BadRequestError(
            f"input '{tensor.name}' has data type {tensor.datatype[:32]}, expected {spec.datatype}"
        )
    shape = list(tensor.shape)
    # Checked before numpy sees it: a negative or huge dimension (whose product overflows
    # numpy's 64 bits) must be the client's error, never a failed reshape.
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise BadRequestError(
            f"input '{tensor.name}': shape {shape[: MAX_DIMS + 1]} needs at most {MAX_DIMS} "
            "dimensions, none negative"
        )
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:  # numpy refuses even an empty one
        raise BadRequestError(f"input '{tensor.name}': shape {shape} is too large")
    dtype = raw_dtype(spec.datatype)
    if index < len(request.raw_input_contents):
        raw = request.raw_input_contents[index]
        if len(raw) % dtype.itemsize:
            raise BadRequestError(
                f"input '{tensor.name}': {len(raw)} raw bytes are not whole {spec.datatype} values"
            )
        flat = np.frombuffer(raw, dtype=dtype)
    else:
        flat = np.asarray(typed_contents(tensor, spec.datatype), dtype=dtype)
    if math.prod(shape) != flat.size:
        raise BadRequestError(
            f"input '{tensor.name}': {flat.size} values do not fill {shape[: MAX_DIMS + 1]}"
        )
    return flat.reshape(shape)


def _word_lists(
    arrays: dict[str, npt.NDArray[np.generic]], rows: int
) -> dict[str, list[tuple[tuple[int, ...], ...]]]:
    """Each row's stop and bad words, in TensorRT-LLM's layout (contracts/trtllm.py)."""
    none: list[tuple[tuple[int, ...], ...]] = [()] * rows
    words = {}
    for name in ("stop_words_list", "bad_words_list"):
        try:
            words[name] = read_word_lists(arrays[name], rows, name) if name in arrays else none
        except ValueError as exc:
            raise BadRequestError(str(exc)) from None
    return words


def parse_engine_request(
    request: kserve_pb.ModelInferRequest, time_remaining_s: float | None
) -> tuple[list[GenerationParams], bool]:
    """Each row's generation parameters, and whether the answer streams."""
    arrays: dict[str, npt.NDArray[np.generic]] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name not in INPUTS:
            known = ", ".join(INPUTS)
            raise BadRequestError(
                f"unknown input {clip(tensor.name)} for model '{request.model_name}' ({known})"
            )
        arrays[tensor.name] = _array(request, index)
    for name, spec in INPUTS.items():
        if spec.required and name not in arrays:
            raise BadRequestError(f"missing required input '{name}'")
    for output in request.outputs:
        if output.name not in OUTPUTS:
            raise BadRequestError(f"unknown output {clip(output.name)} (this model has {OUTPUTS})")
    ids = arrays["input_ids"]
    ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
    if ids.ndim != 2 or not 1 <= ids.shape[0] <= MAX_ROWS:
        raise BadRequestError(
            f"input_ids: expected shape [rows, tokens], at most {MAX_ROWS} rows, got "
            f"{list(arrays['input_ids'].shape)}"
        )
    rows = ids.shape[0]
    one: dict[str, npt.NDArray[np.generic]] = {}
    for name, array in arrays.items():
        if INPUTS[name].shape != "one":
            continue
        flat = array.reshape(-1)
        if flat.size not in (1, rows):
            raise BadRequestError(f"input '{name}': {flat.size} values for {rows} rows")
        one[name] = flat
    if "stop" in one and bool(one["stop"].any()):
        raise BadRequestError(
            "stop: request ids are labels here, not handles; cancel the call (or close the "
            "stream) to stop a request"
        )

    def value(name: str, r: int) -> object | None:
        flat = one.get(name)
        return None if flat is None else flat[r if flat.size > 1 else 0].item()

    words = _word_lists(arrays, rows)
    priority = request_parameter(request, "priority")
    timeout_us = request_parameter(request, "timeout")
    session, precision = route_parameters(request)
    if timeout_us is not None and timeout_us < 0:
        raise BadRequestError(f"parameter timeout: {timeout_us} is negative")
    out = []
    for r in range(rows):
        row = {name: value(name, r) for name in one}
        refuse_what_the_engine_cannot_do({k: v for k, v in row.items() if v is not None})
        length = int(row["input_lengths"])  # type: ignore[call-overload]
        if not 1 <= length <= ids.shape[1]:
            raise BadRequestError(
                f"input_lengths: row {r} claims {length} tokens; input_ids rows hold {ids.shape[1]}"
            )
        top_k = int(row.get("runtime_top_k") or 0)  # type: ignore[call-overload]
        top_p = float(row.get("runtime_top_p") or 0.0)  # type: ignore[arg-type]
        temperature = float(row.get("temperature", 1.0) or 0.0)  # type: ignore[arg-type]
        if top_k == 0 and top_p == 0.0:
            temperature = 0.0  # TensorRT-LLM decodes greedily then, whatever the temperature

        def number(name: str, default: float, row: dict[str, object] = row) -> float:
            got = row.get(name)
            return default if got is None else float(got)  # type: ignore[arg-type]

        end_id, pad_id = row.get("end_id"), row.get("pad_id")
        out.append(
            GenerationParams(
                request_id=request.id,
                token_ids=tuple(int(t) for t in ids[r, :length]),
                sampling=Sampling(
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    seed=int(row.get("random_seed") or 0),  # type: ignore[call-overload]
                    min_length=int(row.get("min_length") or 0),  # type: ignore[call-overload]
                    repetition_penalty=number("repetition_penalty", 1.0),
                    presence_penalty=number("presence_penalty", 0.0),
                    frequency_penalty=number("frequency_penalty", 0.0),
                ),
                max_tokens=int(row["request_output_len"]),  # type: ignore[call-overload]
                end_id=None if end_id is None else int(end_id),  # type: ignore[call-overload]
                pad_id=None if pad_id is None else int(pad_id),  # type: ignore[call-overload]
                stop_word_ids=words["stop_words_list"][r],
                bad_word_ids=words["bad_words_list"][r],
                return_log_probs=bool(row.get("return_log_probs") or False),
                urgency=triton_urgency(priority),
                queue_timeout_s=timeout_us / 1e6 if timeout_us else None,
                time_remaining_s=time_remaining_s,
                session=session,
                precision=precision,
            )
        )
    return out, bool(value("streaming", 0) or False)


def engine_response(
    request: kserve_pb.ModelInferRequest, piece: Delta, cum: float, final: bool, row: int | None
) -> kserve_pb.ModelInferResponse:
    """output_ids [1, 1, tokens] and sequence_length [1, 1] (one beam), the log-probability
    outputs where the row asked, and batch_index / sequence_index for a row of a batched
    request."""
    response = kserve_pb.ModelInferResponse(
        model_name=request.model_name, model_version="1", id=request.id
    )
    tokens = piece.token_ids
    for name, shape, data in (
        ("output_ids", [1, 1, len(tokens)], np.asarray(tokens, dtype="<i4")),
        ("sequence_length", [1, 1], np.asarray([len(tokens)], dtype="<i4")),
    ):
        add_output(response, name, "INT32", shape, data.tobytes())
    if piece.log_probs is not None:
        add_log_probs(response, [piece.log_probs], [cum])
    if row is not None:
        add_row_index(response, row)
    response.parameters["triton_final_response"].bool_param = final
    return response


def engine_batch_response(
    request: kserve_pb.ModelInferRequest, finals: list[Final], pad_id: int
) -> kserve_pb.ModelInferResponse:
    """Every row at once (unary): output_ids [rows, 1, longest] padded with `pad_id`,
    sequence_length [rows, 1], and the log-probability outputs where a row asked."""
    rows = [f.token_ids for f in finals]
    width = max(1, *(len(r) for r in rows))
    ids = np.full((len(rows), 1, width), pad_id, dtype="<i4")
    for r, tokens in enumerate(rows):
        ids[r, 0, : len(tokens)] = tokens
    lengths = np.asarray([[len(r)] for r in rows], dtype="<i4")
    response = kserve_pb.ModelInferResponse(
        model_name=request.model_name, model_version="1", id=request.id
    )
    for name, data in (("output_ids", ids), ("sequence_length", lengths)):
        add_output(response, name, "INT32", data.shape, data.tobytes())
    add_log_probs(response, [f.log_probs for f in finals], [sum(f.log_probs or ()) for f in finals])
    return response
