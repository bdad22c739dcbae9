"""TensorRT-LLM's `tensorrt_llm` contract as Triton's protobuf messages, for the Triton adapter:
the requests it sends (one row, a padded batch, a stop), what it reads from the responses (ids,
log probabilities, the row, the end) and the engine profile a model config describes.

The facts themselves (which inputs exist, their datatypes, the word-list layout) are
contracts/trtllm.py's; this module only puts them into and reads them out of messages. A
malformed output is BackendFailedError naming it, never a crash. No I/O here: the adapter
(triton.py) owns the stream and the calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import model_config_pb2, service_pb2

from scheduler_svc.contracts.trtllm import (
    IDENTIFYING_INPUTS,
    IDENTIFYING_OUTPUTS,
    INPUTS,
    word_lists,
)
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.errors import BackendFailedError
from scheduler_svc.profiles import load_profile
from scheduler_svc.serving.backends.base import GenerationInput


def is_engine_contract(meta: service_pb2.ModelMetadataResponse) -> bool:
    """Whether a model's metadata has TensorRT-LLM's tensor contract (token ids in and out)."""
    inputs = {(i.name, i.datatype) for i in meta.inputs}
    return inputs >= IDENTIFYING_INPUTS and {o.name for o in meta.outputs} >= IDENTIFYING_OUTPUTS


def is_text_contract(meta: service_pb2.ModelMetadataResponse) -> bool:
    """Whether a model's metadata has the ensemble's text contract (text_input and max_tokens
    in, text_output out)."""
    inputs = {(i.name, i.datatype) for i in meta.inputs}
    wanted = {("text_input", "BYTES"), ("max_tokens", "INT32")}
    return wanted <= inputs and "text_output" in {o.name for o in meta.outputs}


def _tensor(request: service_pb2.ModelInferRequest, name: str, value: npt.NDArray[Any]) -> None:
    """Input `name` of the contract, with its datatype there, as raw little-endian bytes."""
    tensor = request.inputs.add()
    tensor.name = name
    tensor.datatype = INPUTS[name].datatype
    tensor.shape.extend(value.shape)
    request.raw_input_contents.append(value.tobytes())


def _message(model: str, request_id: str) -> service_pb2.ModelInferRequest:
    """A request to `model` whose end always reaches us: asked for empty final responses, Triton
    forwards an engine's bare end flag (a stopped request's, the stop's own) instead of dropping
    it. Without it a stop's two ends never came, and the stopped row was held STOP_GRACE_S."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def build_request(model: str, inp: GenerationInput) -> service_pb2.ModelInferRequest:
    """The ModelInferRequest for one row of the `tensorrt_llm` contract."""
    request = _message(model, inp.request_id)
    ids = np.asarray([list(inp.prompt_ids)], dtype="<i4")
    _tensor(request, "input_ids", ids)
    _tensor(request, "input_lengths", np.asarray([[ids.shape[1]]], dtype="<i4"))
    _tensor(request, "request_output_len", np.asarray([[inp.max_tokens]], dtype="<i4"))
    _tensor(request, "end_id", np.asarray([[inp.end_id]], dtype="<i4"))
    _tensor(request, "pad_id", np.asarray([[inp.pad_id]], dtype="<i4"))
    _tensor(request, "streaming", np.asarray([[True]], dtype=np.bool_))
    sampling = inp.sampling
    if sampling.temperature > 0:
        # TensorRT-LLM decodes greedily when top_k and top_p are both 0: a temperature alone
        # must still sample, so it goes with the full nucleus.
        top_p = sampling.top_p if sampling.top_p > 0 else 1.0
        _tensor(request, "temperature", np.asarray([[sampling.temperature]], dtype="<f4"))
        _tensor(request, "runtime_top_k", np.asarray([[sampling.top_k]], dtype="<i4"))
        _tensor(request, "runtime_top_p", np.asarray([[top_p]], dtype="<f4"))
        _tensor(request, "random_seed", np.asarray([[sampling.seed]], dtype="<u8"))
    _word_tensors(request, [inp])
    return request


def _word_tensors(request: service_pb2.ModelInferRequest, rows: list[GenerationInput]) -> None:
    """stop_words_list and bad_words_list, when any row has words; min_length and the
    penalties, when any row sets one."""
    column = np.asarray
    if any(r.sampling.min_length for r in rows):
        _tensor(request, "min_length", column([[r.sampling.min_length] for r in rows], "<i4"))
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        default = 1.0 if name == "repetition_penalty" else 0.0
        if any(getattr(r.sampling, name) != default for r in rows):
            values = column([[getattr(r.sampling, name)] for r in rows], "<f4")
            _tensor(request, name, values)
    if any(r.stop_words for r in rows):
        _tensor(request, "stop_words_list", word_lists([r.stop_words for r in rows]))
    if any(r.bad_words for r in rows):
        _tensor(request, "bad_words_list", word_lists([r.bad_words for r in rows]))
    if any(r.return_log_probs for r in rows):
        flags = column([[r.return_log_probs] for r in rows], np.bool_)
        _tensor(request, "return_log_probs", flags)


def build_batch_request(
    model: str, request_id: str, rows: list[GenerationInput]
) -> service_pb2.ModelInferRequest:
    """One ModelInferRequest carrying every row: `input_ids` padded with each row's pad id to
    the longest prompt, `input_lengths` telling the engine where each row really ends."""
    request = _message(model, request_id)
    width = max(len(r.prompt_ids) for r in rows)
    ids = np.asarray(
        [list(r.prompt_ids) + [r.pad_id] * (width - len(r.prompt_ids)) for r in rows], dtype="<i4"
    )

    def column(values: list[Any], dtype: Any) -> npt.NDArray[Any]:
        return np.asarray([[v] for v in values], dtype=dtype)

    _tensor(request, "input_ids", ids)
    _tensor(request, "input_lengths", column([len(r.prompt_ids) for r in rows], "<i4"))
    _tensor(request, "request_output_len", column([r.max_tokens for r in rows], "<i4"))
    _tensor(request, "end_id", column([r.end_id for r in rows], "<i4"))
    _tensor(request, "pad_id", column([r.pad_id for r in rows], "<i4"))
    # Every input carries the batch dimension, `streaming` included.
    _tensor(request, "streaming", column([True] * len(rows), np.bool_))
    samplings = [r.sampling for r in rows]
    if any(s.temperature > 0 for s in samplings):
        _tensor(request, "temperature", column([s.temperature for s in samplings], "<f4"))
        _tensor(request, "runtime_top_k", column([s.top_k for s in samplings], "<i4"))
        top_p = [s.top_p if s.top_p > 0 or s.temperature == 0 else 1.0 for s in samplings]
        _tensor(request, "runtime_top_p", column(top_p, "<f4"))
        _tensor(request, "random_seed", column([s.seed for s in samplings], "<u8"))
    _word_tensors(request, rows)
    return request


def build_stop_request(model: str, request_id: str) -> service_pb2.ModelInferRequest:
    """TensorRT-LLM's `stop`: ends the in-flight request with the same id. The contract's
    required inputs ride along; the engine ignores them."""
    request = _message(model, request_id)
    _tensor(request, "input_ids", np.asarray([[0]], dtype="<i4"))
    _tensor(request, "input_lengths", np.asarray([[1]], dtype="<i4"))
    _tensor(request, "request_output_len", np.asarray([[1]], dtype="<i4"))
    _tensor(request, "stop", np.asarray([[True]], dtype=np.bool_))
    return request


def _output(
    response: service_pb2.ModelInferResponse, name: str, fp32: bool = False
) -> list[Any] | None:
    """An INT32 (or FP32) output's values, None when absent; a malformed one (a length that
    is not a multiple of 4, say) is BackendFailedError naming it, never a crash."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name != name:
            continue
        if index < len(response.raw_output_contents):
            raw = response.raw_output_contents[index]
            if len(raw) % 4:
                kind = "FP32" if fp32 else "INT32"
                raise BackendFailedError(
                    f"Triton sent a malformed '{name}' output ({len(raw)} bytes of {kind})"
                )
            return list(np.frombuffer(raw, dtype="<f4" if fp32 else "<i4"))
        contents = tensor.contents.fp32_contents if fp32 else tensor.contents.int_contents
        return list(contents)
    return None


def _int32s(response: service_pb2.ModelInferResponse, name: str) -> list[int] | None:
    values = _output(response, name)
    return None if values is None else [int(v) for v in values]


def batch_index(response: service_pb2.ModelInferResponse) -> int:
    """Which row of a multi-row request a response belongs to (0 when absent)."""
    values = _int32s(response, "batch_index")
    if values is None:
        return 0
    if not values:
        raise BackendFailedError("Triton sent an empty 'batch_index' output")
    return values[0]


def output_ids(response: service_pb2.ModelInferResponse) -> list[int]:
    """The generated ids in one response ([] for an empty final response)."""
    return _int32s(response, "output_ids") or []


def output_log_probs(response: service_pb2.ModelInferResponse, count: int) -> list[float]:
    """The log probabilities of a response's `count` ids (TensorRT-LLM's `output_log_probs`,
    FP32 [1, 1, n]); a missing or short one is BackendFailedError naming it."""
    values = _output(response, "output_log_probs", fp32=True)
    if values is None:
        raise BackendFailedError(
            "Triton sent no 'output_log_probs' output (return_log_probs asked)"
        )
    if len(values) < count:
        raise BackendFailedError(
            f"Triton sent {len(values)} 'output_log_probs' values for {count} ids"
        )
    # The last `count` values are this response's ids' (an engine that repeats the earlier
    # ones in a streamed response sends them first).
    return [float(v) for v in values[len(values) - count :]]


def _config_int_parameter(config: model_config_pb2.ModelConfig, key: str) -> int | None:
    param = config.parameters.get(key)
    try:
        value = int(param.string_value) if param is not None else None
    except ValueError:  # an unrendered template value such as ${max_num_tokens}
        return None
    return value if value is not None and value > 0 else None


def profile_from_config(config: model_config_pb2.ModelConfig, override: str) -> EngineProfile:
    """The profile a `tensorrt_llm` model config describes (`override`: auto, or a batching)."""
    if override != "auto":
        batching = Batching(override)
    else:
        model_type = config.parameters.get("gpt_model_type")
        static = model_type is not None and model_type.string_value.lower() == "v1"
        batching = Batching.STATIC if static else Batching.INFLIGHT
    instances = sum(group.count or 1 for group in config.instance_group) or 1
    paged_tokens = _config_int_parameter(config, "max_tokens_in_paged_kv_cache")
    per_block = _config_int_parameter(config, "tokens_per_block")
    policy = config.parameters.get("batch_scheduler_policy")
    # TensorRT-LLM's default is guaranteed_no_evict; an unfilled template value reads as it.
    allocates_as_it_goes = policy is not None and policy.string_value == "max_utilization"
    chunked = config.parameters.get("enable_chunked_context")
    chunking = config.parameters.get("context_chunking_policy")
    reuse = config.parameters.get("enable_kv_cache_reuse")  # off unless "true" (its default)
    # TensorRT-LLM's default policy is first_come_first_served; an unfilled template value
    # (`${...}`) reads as it.
    chunk_policy = (
        chunking.string_value
        if chunking is not None and not chunking.string_value.startswith("$")
        else "first_come_first_served"
    )
    return EngineProfile(
        batching=batching,
        max_batch_size=max(1, config.max_batch_size),
        batches_at_once=instances,
        max_num_sequences=_config_int_parameter(config, "max_num_sequences"),
        max_num_tokens=_config_int_parameter(config, "max_num_tokens"),
        kv_total_blocks=paged_tokens // per_block if paged_tokens and per_block else None,
        reserves_max_tokens=not allocates_as_it_goes,
        context_chunking=(
            chunk_policy if chunked is not None and chunked.string_value.lower() == "true" else None
        ),
        kv_cache_reuse=reuse is not None and reuse.string_value.lower() == "true",
        **_step_cost(config),
    )


def _step_cost(config: model_config_pb2.ModelConfig) -> dict[str, Any]:
    """An emulated engine's cost profile and time scale (EngineProfile fields); nothing for a
    real engine or a profile this process cannot read."""
    timing = config.parameters.get("timing")
    name = config.parameters.get("cost_profile")
    if timing is None or timing.string_value != "emulated" or name is None:
        return {}
    scale = config.parameters.get("time_scale")
    try:
        factor = float(scale.string_value) if scale is not None else 1.0
        return {"step_cost": load_profile(name.string_value), "time_scale": factor}
    except (OSError, ValueError):
        return {}


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    param = response.parameters.get("triton_final_response")
    return bool(param is not None and param.bool_param)
