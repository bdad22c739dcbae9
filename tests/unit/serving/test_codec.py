"""TensorRT-LLM's contract in Triton's messages (serving/backends/codec.py): the requests the
adapter builds and what it reads back, malformed responses included."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as kserve_pb

from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.errors import BackendFailedError
from scheduler_svc.serving.backends.base import GenerationInput
from scheduler_svc.serving.backends.codec import (
    batch_index,
    build_batch_request,
    build_request,
    build_stop_request,
    is_final,
    output_ids,
    output_log_probs,
)


def _inputs(request: kserve_pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """Each input as an array of its datatype and shape."""
    dtypes = {"INT32": "<i4", "FP32": "<f4", "UINT64": "<u8", "BOOL": np.bool_}
    return {
        tensor.name: np.frombuffer(raw, dtype=dtypes[tensor.datatype]).reshape(tuple(tensor.shape))
        for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True)
    }


def test_one_row_carries_its_prompt_limits_and_sampling_and_asks_for_every_end() -> None:
    row = GenerationInput(
        "r1",
        (5, 6, 7),
        max_tokens=9,
        end_id=1,
        pad_id=2,
        sampling=Sampling(temperature=0.7, top_k=0, top_p=0.0, seed=11),
        stop_words=((4, 5),),
    )
    request = build_request("tensorrt_llm", row)
    assert request.model_name == "tensorrt_llm" and request.id == "r1"
    assert request.parameters["triton_enable_empty_final_response"].bool_param
    tensors = _inputs(request)
    assert tensors["input_ids"].tolist() == [[5, 6, 7]]
    assert tensors["input_lengths"].tolist() == [[3]]
    assert tensors["request_output_len"].tolist() == [[9]]
    assert tensors["streaming"].tolist() == [[True]]
    # A temperature alone samples over the full nucleus (TensorRT-LLM is greedy at k = p = 0).
    assert tensors["runtime_top_p"].tolist() == [[1.0]]
    assert tensors["random_seed"].tolist() == [[11]]
    assert tensors["stop_words_list"].shape == (1, 2, 2)
    assert "bad_words_list" not in tensors and "min_length" not in tensors
    greedy = _inputs(build_request("m", GenerationInput("g", (5,), 1, end_id=1, pad_id=2)))
    assert "temperature" not in greedy  # greedy: no sampling inputs at all


def test_a_batch_pads_each_row_with_its_pad_id_and_says_where_it_ends() -> None:
    rows = [
        GenerationInput("a", (5, 6, 7, 8), 4, end_id=1, pad_id=2),
        GenerationInput("b", (9,), 3, end_id=1, pad_id=0),
    ]
    tensors = _inputs(build_batch_request("tensorrt_llm", "batch-1", rows))
    assert tensors["input_ids"].tolist() == [[5, 6, 7, 8], [9, 0, 0, 0]]
    assert tensors["input_lengths"].tolist() == [[4], [1]]
    assert tensors["request_output_len"].tolist() == [[4], [3]]
    assert tensors["streaming"].tolist() == [[True], [True]]


def test_a_stop_names_the_request_it_ends() -> None:
    stop = build_stop_request("tensorrt_llm", "r1")
    assert stop.id == "r1" and _inputs(stop)["stop"].tolist() == [[True]]


def test_the_end_is_triton_s_final_response_flag() -> None:
    response = kserve_pb.ModelInferResponse()
    assert not is_final(response)
    response.parameters["triton_final_response"].bool_param = True
    assert is_final(response)


def test_a_malformed_triton_response_is_a_clear_backend_failure() -> None:
    response = kserve_pb.ModelInferResponse()
    response.outputs.add(name="output_ids", datatype="INT32")
    response.raw_output_contents.append(b"\x01\x02\x03")  # 3 bytes of INT32
    with pytest.raises(BackendFailedError, match="malformed 'output_ids'"):
        output_ids(response)
    empty = kserve_pb.ModelInferResponse()
    empty.outputs.add(name="batch_index", datatype="INT32")
    empty.raw_output_contents.append(b"")
    with pytest.raises(BackendFailedError, match="empty 'batch_index'"):
        batch_index(empty)
    good = kserve_pb.ModelInferResponse()
    good.outputs.add(name="output_ids", datatype="INT32")
    good.raw_output_contents.append((7).to_bytes(4, "little") + (9).to_bytes(4, "little"))
    assert output_ids(good) == [7, 9] and batch_index(good) == 0
    # Log probabilities: the last values for the response's ids; missing or short is a failure.
    with pytest.raises(BackendFailedError, match="no 'output_log_probs'"):
        output_log_probs(good, 2)
    good.outputs.add(name="output_log_probs", datatype="FP32")
    good.raw_output_contents.append(struct.pack("<3f", -0.5, -1.5, -2.5))
    assert output_log_probs(good, 2) == [-1.5, -2.5]
    with pytest.raises(BackendFailedError, match="3 'output_log_probs' values for 4 ids"):
        output_log_probs(good, 4)
    typed = kserve_pb.ModelInferResponse()
    typed.outputs.add(name="output_log_probs", datatype="FP32").contents.fp32_contents.extend([-1])
    assert output_log_probs(typed, 1) == [-1.0]
