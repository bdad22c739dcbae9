"""KServe v2 requests on the text contract: what is accepted and how refusals read."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as kserve_pb

from scheduler_svc.contracts.trtllm import INPUTS as ENGINE_INPUTS
from scheduler_svc.core.types import Urgency
from scheduler_svc.errors import BadRequestError, UnknownModelError
from scheduler_svc.serving.fronts.kserve import parse_infer_request
from scheduler_svc.serving.fronts.kserve_engine import parse_engine_request
from scheduler_svc.serving.fronts.kserve_params import MAX_ROWS


def stock_request(**tensors: tuple[str, np.ndarray]) -> kserve_pb.ModelInferRequest:
    """Build the request exactly as tritonclient would put it on the wire."""
    inputs = []
    for name, (datatype, value) in tensors.items():
        item = grpcclient.InferInput(name, list(value.shape), datatype)
        item.set_data_from_numpy(value)
        inputs.append(item)
    request = kserve_pb.ModelInferRequest(model_name="ensemble", id="r1")
    for item in inputs:
        request.inputs.append(item._get_tensor())
        request.raw_input_contents.append(item._get_content())
    return request


def text(value: bytes | str = "hello") -> tuple[str, np.ndarray]:
    return "BYTES", np.array([[value]], dtype=np.object_)


def int32(v: int) -> tuple[str, np.ndarray]:
    return "INT32", np.array([[v]], dtype=np.int32)


def test_stock_request_parses_with_sampling_and_parameters() -> None:
    request = stock_request(
        text_input=text("你好"),
        max_tokens=int32(9),
        stream=("BOOL", np.array([[True]])),
        temperature=("FP32", np.array([[0.7]], dtype=np.float32)),
        random_seed=("UINT64", np.array([[5]], dtype=np.uint64)),
    )
    request.parameters["priority"].int64_param = 1
    request.parameters["timeout"].int64_param = 250_000
    [params], stream = parse_infer_request(request, "ensemble", None)
    assert stream
    assert params.prompt == "你好" and params.max_tokens == 9 and params.sampling.seed == 5
    assert params.sampling.temperature == pytest.approx(0.7)
    assert params.urgency == Urgency.INTERACTIVE
    assert params.queue_timeout_s == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("tensors", "needle"),
    [
        ({"max_tokens": int32(3)}, "missing required input 'text_input'"),
        (
            {"text_input": text(), "max_tokens": int32(3), "colour": int32(1)},
            "unknown input 'colour'",
        ),
        (
            {"text_input": text(), "max_tokens": ("INT64", np.array([[3]], dtype=np.int64))},
            "input 'max_tokens' has data type INT64, expected INT32",
        ),
        ({"text_input": text(b"\xff\xfe"), "max_tokens": int32(3)}, "text_input: not valid UTF-8"),
        (
            {
                "text_input": ("BYTES", np.array([[b"a"], [b"b"]], dtype=np.object_)),
                "max_tokens": ("INT32", np.array([[3], [4], [5]], dtype=np.int32)),
            },
            "input 'max_tokens' has 3 rows; text_input has 2",
        ),
        (
            {"text_input": ("BYTES", np.array([[b"a", b"b"]], dtype=np.object_))},
            r"expected \[rows, 1\]",
        ),
    ],
)
def test_bad_requests_name_the_problem(
    tensors: dict[str, tuple[str, np.ndarray]], needle: str
) -> None:
    with pytest.raises(BadRequestError, match=needle):
        parse_infer_request(stock_request(**tensors), "ensemble", None)


def test_unknown_model_and_parameter_types() -> None:
    request = stock_request(text_input=text(), max_tokens=int32(3))
    request.model_name = "llama"
    with pytest.raises(UnknownModelError, match="'llama' is not served here"):
        parse_infer_request(request, "ensemble", None)
    request.model_name = "ensemble"
    request.parameters["priority"].string_param = "high"
    with pytest.raises(BadRequestError, match="parameter priority: expected an integer"):
        parse_infer_request(request, "ensemble", None)


def test_end_id_and_pad_id_are_part_of_the_contract_as_in_the_ensemble() -> None:
    request = stock_request(
        text_input=text("hi"), max_tokens=int32(4), end_id=int32(7), pad_id=int32(0)
    )
    [params], _ = parse_infer_request(request, "ensemble", None)
    assert (params.end_id, params.pad_id) == (7, 0)
    [plain], _ = parse_infer_request(
        stock_request(text_input=text(), max_tokens=int32(4)), "ensemble", None
    )
    assert (plain.end_id, plain.pad_id) == (None, None)  # the model's own


def test_the_full_ensemble_contract_parses_and_refuses_what_the_engine_cannot_do() -> None:
    request = stock_request(
        text_input=text(),
        max_tokens=int32(9),
        stop_words=("BYTES", np.array([["\n\n", "User:", ""]], dtype=np.object_)),
        bad_words=("BYTES", np.array([["damn"]], dtype=np.object_)),
        min_length=int32(3),
        repetition_penalty=("FP32", np.array([[1.2]], dtype=np.float32)),
        length_penalty=("FP32", np.array([[0.5]], dtype=np.float32)),
        beam_width=int32(1),
        return_log_probs=("BOOL", np.array([[True]])),
    )
    [params], _ = parse_infer_request(request, "ensemble", None)
    assert params.stop_words == ("\n\n", "User:") and params.bad_words == ("damn",)
    assert params.sampling.min_length == 3 and params.sampling.repetition_penalty == pytest.approx(
        1.2
    )
    assert params.return_log_probs
    for name, value, needle in (
        ("beam_width", int32(4), "beam_width: 4; this engine decodes one beam"),
        ("return_context_logits", ("BOOL", np.array([[True]])), "return_context_logits: con"),
        ("exclude_input_in_output", ("BOOL", np.array([[False]])), "exclude_input_in_output"),
        ("stop_words", ("BYTES", np.array([["a"], ["b"]], dtype=np.object_)), "has 2 rows"),
    ):
        bad = stock_request(text_input=text(), max_tokens=int32(9), **{name: value})
        with pytest.raises(BadRequestError, match=needle):
            parse_infer_request(bad, "ensemble", None)


def test_a_batched_request_is_one_set_of_parameters_per_row() -> None:
    request = stock_request(
        text_input=("BYTES", np.array([[b"one"], [b"two"], [b"three"]], dtype=np.object_)),
        max_tokens=("INT32", np.array([[3], [4], [5]], dtype=np.int32)),
        temperature=("FP32", np.array([[0.5]], dtype=np.float32)),  # one value: every row
        stop_words=("BYTES", np.array([["a", ""], ["b", "c"], ["", ""]], dtype=np.object_)),
    )
    rows, _ = parse_infer_request(request, "ensemble", None)
    assert [r.prompt for r in rows] == ["one", "two", "three"]
    assert [r.max_tokens for r in rows] == [3, 4, 5]
    assert [r.sampling.temperature for r in rows] == [0.5] * 3
    assert [r.stop_words for r in rows] == [("a",), ("b", "c"), ()]
    assert {r.request_id for r in rows} == {"r1"}  # the client's id is a label of each


# -- the engine contract, fuzzed -------------------------------------------------------------

_ENGINE_NAMES = sorted(ENGINE_INPUTS)
_DATATYPES = ("INT32", "FP32", "BOOL", "UINT64", "BYTES")


@st.composite
def _engine_tensors(draw: st.DrawFn) -> kserve_pb.ModelInferRequest:
    """A request on the engine contract: the right names (and a stranger now and then), data
    types mostly right, any shape (negative and huge dimensions included), raw bytes of any
    length or typed contents."""
    request = kserve_pb.ModelInferRequest(model_name="tensorrt_llm", id="fuzz")
    names = draw(st.lists(st.sampled_from(_ENGINE_NAMES), min_size=0, max_size=6))
    for name in ["input_ids", "input_lengths", "request_output_len", *names]:
        tensor = request.inputs.add()
        tensor.name = name
        right = ENGINE_INPUTS[name].datatype
        tensor.datatype = draw(st.sampled_from((right, right, right, *_DATATYPES)))
        dims = st.one_of(st.integers(-3, 8), st.sampled_from((2**32, 2**62, 2**63 - 1)))
        tensor.shape.extend(draw(st.lists(dims, min_size=0, max_size=6)))
        request.raw_input_contents.append(draw(st.binary(max_size=48)))
    return request


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_engine_tensors())
def test_any_engine_contract_request_parses_or_is_invalid_argument(
    request: kserve_pb.ModelInferRequest,
) -> None:
    """Whatever shapes and bytes a client sends, the answer is parameters or BadRequestError
    naming the problem; never another exception (it would reach the client as INTERNAL)."""
    try:
        rows, _ = parse_engine_request(request, None)
    except BadRequestError as exc:
        assert str(exc)
        return
    assert 1 <= len(rows) <= MAX_ROWS


@pytest.mark.parametrize(
    ("shape", "raw", "needle"),
    [
        ([-2, -3], np.arange(6, dtype="<i4").tobytes(), "none negative"),
        ([2**32, 2**32], b"", "too large"),
        ([0, 2**62], b"", "too large"),
        ([1, 1, 1, 1, 1, 1], np.arange(1, dtype="<i4").tobytes(), "at most 4 dimensions"),
        ([1, 2], b"\x01\x02\x03", "not whole INT32 values"),
    ],
)
def test_engine_contract_shapes_are_checked_before_use(
    shape: list[int], raw: bytes, needle: str
) -> None:
    request = kserve_pb.ModelInferRequest(model_name="tensorrt_llm", id="shape")
    for name, values in (
        ("input_ids", raw),
        ("input_lengths", np.asarray([[1]], dtype="<i4").tobytes()),
        ("request_output_len", np.asarray([[4]], dtype="<i4").tobytes()),
    ):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, "INT32"
        tensor.shape.extend(shape if name == "input_ids" else [1, 1])
        request.raw_input_contents.append(values)
    with pytest.raises(BadRequestError, match=needle):
        parse_engine_request(request, None)
