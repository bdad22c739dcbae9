"""What the KServe front's two contracts (the ensemble's text, the engine's token ids) share:
Triton's request parameters, the row bound, and what the engine cannot do."""

from __future__ import annotations

from tritonclient.grpc import service_pb2 as kv

from scheduler_svc.core.types import Urgency
from scheduler_svc.errors import BadRequestError

# KServe datatypes as numpy reads their raw little-endian bytes.
NUMPY_DTYPES = {"INT32": "<i4", "FP32": "<f4", "UINT64": "<u8", "BOOL": "?"}


def typed_contents(tensor: kv.ModelInferRequest.InferInputTensor, datatype: str) -> list[object]:
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
# What the engine cannot produce: refused by name, as the engine itself refuses it.
_NOT_PRODUCED = {
    "return_log_probs": "log probabilities are not produced by this engine",
    "return_context_logits": "context logits are not produced by this engine",
    "return_generation_logits": "generation logits are not produced by this engine",
}


def request_parameter(request: kv.ModelInferRequest, key: str) -> int | None:
    if key not in request.parameters:
        return None
    param = request.parameters[key]
    which = param.WhichOneof("parameter_choice")
    if which in ("int64_param", "uint64_param"):
        return int(getattr(param, which))
    raise BadRequestError(f"parameter {key}: expected an integer, got {which}")


def triton_urgency(priority: int | None) -> Urgency:
    """Triton's priority: 1 is the most urgent level, 0 means the default."""
    if priority is None or priority == 0:
        return Urgency.STANDARD
    if priority < 0:
        raise BadRequestError(f"parameter priority: {priority} is negative")
    return {1: Urgency.INTERACTIVE, 2: Urgency.STANDARD}.get(priority, Urgency.BATCH)


def refuse_what_the_engine_cannot_do(values: dict[str, object]) -> None:
    """Beams, log probs, logits and prompts in the output: refused by name (the text and the
    engine contracts name these inputs alike)."""
    beams = values.get("beam_width", 1)
    if beams != 1:
        raise BadRequestError(f"beam_width: {beams}; this engine decodes one beam (beam_width 1)")
    for name, why in _NOT_PRODUCED.items():
        if values.get(name, False):
            raise BadRequestError(f"{name}: {why}")
    if not values.get("exclude_input_in_output", True):
        raise BadRequestError(
            "exclude_input_in_output: false is not supported; this engine returns the "
            "generated tokens only"
        )
