"""What the KServe front's two contracts (the ensemble's text, the engine's token ids) share:
Triton's request parameters, the row bound, and what the engine cannot do."""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as kserve_pb
from tritonclient.utils import triton_to_np_dtype

from scheduler_svc.contracts.trtllm import refusal
from scheduler_svc.core.types import Urgency
from scheduler_svc.errors import BadRequestError


def raw_dtype(datatype: str) -> np.dtype[Any]:
    """A KServe datatype as numpy reads its raw contents (little-endian, whatever the host)."""
    return np.dtype(triton_to_np_dtype(datatype)).newbyteorder("<")


def typed_contents(
    tensor: kserve_pb.ModelInferRequest.InferInputTensor, datatype: str
) -> list[object]:
    """A tensor's values sent as typed contents (not raw bytes)."""
    contents = tensor.contents
    field = {
        "BYTES": contents.bytes_contents,
        "INT32": contents.int_contents,
        "FP32": contents.fp32_contents,
        "UINT64": contents.uint64_contents,
        "BOOL": contents.bool_contents,
    }[datatype]
    return list(field)


MAX_ROWS = 64  # rows of one batched request (the ensemble's max_batch_size)
# Outputs both contracts answer beside their own: log probabilities where a row asked, and
# which row (batch_index) and which of its sequences (sequence_index: one beam, 0).
LOG_PROB_OUTPUTS = ("cum_log_probs", "output_log_probs")
INDEX_OUTPUTS = ("batch_index", "sequence_index")


def request_parameter(request: kserve_pb.ModelInferRequest, key: str) -> int | None:
    if key not in request.parameters:
        return None
    param = request.parameters[key]
    which = param.WhichOneof("parameter_choice")
    if which in ("int64_param", "uint64_param"):
        return int(getattr(param, which))
    raise BadRequestError(f"parameter {key}: expected an integer, got {which}")


# Request parameters that route a request among backend groups (docs/operations.md).
ROUTE_PARAMETERS = ("session_id", "precision")


def route_parameters(request: kserve_pb.ModelInferRequest) -> tuple[str, str]:
    """(session, precision) from the request's `session_id` and `precision` parameters
    (strings; "" where not given)."""
    out = []
    for key in ROUTE_PARAMETERS:
        if key not in request.parameters:
            out.append("")
            continue
        param = request.parameters[key]
        which = param.WhichOneof("parameter_choice")
        if which != "string_param":
            raise BadRequestError(f"parameter {key}: expected a string, got {which}")
        out.append(param.string_param)
    return out[0], out[1]


def triton_urgency(priority: int | None) -> Urgency:
    """Triton's priority: 1 is the most urgent level, 0 means the default."""
    if priority is None or priority == 0:
        return Urgency.STANDARD
    if priority < 0:
        raise BadRequestError(f"parameter priority: {priority} is negative")
    return {1: Urgency.INTERACTIVE, 2: Urgency.STANDARD}.get(priority, Urgency.BATCH)


def add_output(
    response: kserve_pb.ModelInferResponse,
    name: str,
    datatype: str,
    shape: tuple[int, ...] | list[int],
    raw: bytes,
) -> None:
    """One output tensor: its name, datatype and shape, and its raw contents in the same
    position of `raw_output_contents`."""
    out = response.outputs.add()
    out.name, out.datatype = name, datatype
    out.shape.extend(shape)
    response.raw_output_contents.append(raw)


def add_log_probs(
    response: kserve_pb.ModelInferResponse,
    rows: list[tuple[float, ...] | None],
    cums: list[float],
) -> None:
    """TensorRT-LLM's log-probability outputs for one beam, FP32: `output_log_probs`
    [rows, 1, n] (each row's tokens in this response, padded with 0.0 to the longest) and
    `cum_log_probs` [rows, 1] (each row's sum so far). Added when any row asked; a row that
    did not reads 0.0."""
    if all(r is None for r in rows):
        return
    width = max(1, *(len(r or ()) for r in rows))
    values = np.zeros((len(rows), 1, width), dtype="<f4")
    for i, row in enumerate(rows):
        values[i, 0, : len(row or ())] = row or ()
    cum = np.asarray([[c] for c in cums], dtype="<f4")
    for name, data in (("cum_log_probs", cum), ("output_log_probs", values)):
        add_output(response, name, "FP32", data.shape, data.tobytes())


def add_row_index(response: kserve_pb.ModelInferResponse, row: int) -> None:
    """batch_index and sequence_index [1, 1]: which row of a batched request this answers."""
    for name, value in (("batch_index", row), ("sequence_index", 0)):
        add_output(response, name, "INT32", [1, 1], np.asarray([[value]], dtype="<i4").tobytes())


def refuse_what_the_engine_cannot_do(values: dict[str, object]) -> None:
    """Beams, logits and prompts in the output: refused by name, as the engine itself refuses
    them (the text and the engine contracts name these inputs alike; contracts/trtllm.py)."""
    why = refusal(values)
    if why is not None:
        raise BadRequestError(why)
