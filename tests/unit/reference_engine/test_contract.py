"""TensorRT-LLM tensor contract: bad input is refused with the tensor named."""

from __future__ import annotations

import numpy as np
import pytest

from reference_engine.config import EngineConfig
from reference_engine.contract import parse_request
from reference_engine.errors import InvalidRequestError
from scheduler_svc.contracts.trtllm import word_lists
from scheduler_svc.serving.backends.base import GenerationInput

CFG = EngineConfig(max_output_len=100)


def good(**changes: object) -> dict[str, np.ndarray]:
    tensors = {
        "input_ids": np.array([[5, 6, 7, 0], [8, 9, 10, 11]], dtype=np.int32),
        "input_lengths": np.array([[3], [4]], dtype=np.int32),
        "request_output_len": np.array([[10], [20]], dtype=np.int32),
    }
    tensors.update(changes)  # type: ignore[arg-type]
    return {k: v for k, v in tensors.items() if v is not None}


def test_parses_rows_with_defaults() -> None:
    parsed = parse_request(good(streaming=np.array([[True], [True]])), CFG)
    assert [r.prompt for r in parsed.rows] == [(5, 6, 7), (8, 9, 10, 11)]
    assert [r.max_new_tokens for r in parsed.rows] == [10, 20]
    assert parsed.rows[0].end_id == CFG.end_id
    assert parsed.streaming
    assert parsed.sampling.greedy


def test_stop_request_needs_nothing_else() -> None:
    parsed = parse_request({"stop": np.array([[True]])}, CFG)
    assert parsed.stop and not parsed.rows


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"input_lengths": np.array([[3], [9]], dtype=np.int32)}, "input_lengths: row 1 claims 9"),
        (
            {"input_lengths": np.array([[0], [4]], dtype=np.int32)},
            "input_lengths: row 0 has length 0",
        ),
        ({"input_lengths": np.array([[-2], [4]], dtype=np.int32)}, "input_lengths"),
        (
            {"input_lengths": np.array([[1], [2], [3]], dtype=np.int32)},
            "input_lengths: expected one value per row",
        ),
        (
            {"request_output_len": np.array([[0], [1]], dtype=np.int32)},
            "request_output_len: row 0 asks for 0",
        ),
        (
            {"request_output_len": np.array([[1], [101]], dtype=np.int32)},
            "request_output_len: row 1",
        ),
        (
            {"input_ids": np.array([[5, -1, 7, 0], [1, 2, 3, 4]], dtype=np.int32)},
            "input_ids: row 0 holds token id -1",
        ),
        (
            {
                "input_ids": np.array([[5, 6, 7, 999_999], [1, 2, 3, 4]], dtype=np.int32),
                "input_lengths": np.array([[4], [4]], dtype=np.int32),
            },
            "outside the vocabulary",
        ),
        ({"input_ids": np.zeros((2, 0), dtype=np.int32)}, "input_ids: expected shape"),
        ({"input_ids": np.zeros((2, 4), dtype=np.float32)}, "input_ids: unexpected data type"),
        ({"input_lengths": None}, "input_lengths: missing"),
        ({"request_output_len": None}, "request_output_len: missing"),
        ({"end_id": np.array([[10**9], [1]], dtype=np.int64)}, "end_id"),
        ({"pad_id": np.array([[-5], [1]], dtype=np.int32)}, "pad_id"),
        ({"runtime_top_p": np.array([[1.5], [1.5]], dtype=np.float32)}, "runtime_top_p"),
        ({"temperature": np.array([[-1.0], [0.0]], dtype=np.float32)}, "temperature"),
    ],
)
def test_bad_input_names_the_tensor(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        parse_request(good(**changes), CFG)


def test_stop_words_list_per_row_as_tensorrt_llm_lays_it_out() -> None:
    rows = [
        GenerationInput("a", (5, 6, 7), 10, 1, 2, stop_words=((40,), (41, 42))),
        GenerationInput("b", (8, 9, 10, 11), 20, 1, 2, stop_words=((43,),)),
    ]
    tensor = word_lists([r.stop_words for r in rows])
    assert tensor.tolist() == [[[40, 41, 42], [1, 3, -1]], [[43, -1, -1], [1, -1, -1]]]
    parsed = parse_request(good(stop_words_list=tensor), CFG)
    assert [r.stop_words for r in parsed.rows] == [((40,), (41, 42)), ((43,),)]
    one = parse_request(good(stop_words_list=tensor[:1]), CFG)  # one row's words for all
    assert [r.stop_words for r in one.rows] == [((40,), (41, 42))] * 2
    assert parse_request(good(), CFG).rows[0].stop_words == ()


@pytest.mark.parametrize(
    ("tensor", "needle"),
    [
        (np.array([[[40, 41], [2, 1]]], dtype=np.int32), "offsets must rise"),
        (np.array([[[40, 41], [3, -1]]], dtype=np.int32), "offsets must rise"),
        (np.array([[[-5], [1]]], dtype=np.int32), "outside the vocabulary"),
        (np.array([[40, 41, 42]], dtype=np.int32), "expected shape"),
        (np.array([[[40.0], [1.0]]], dtype=np.float32), "unexpected data type"),
    ],
)
def test_a_malformed_stop_words_list_is_refused(tensor: np.ndarray, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"stop_words_list: .*{needle}"):
        parse_request(good(stop_words_list=tensor), CFG)


def test_penalties_bad_words_and_min_length_per_row() -> None:
    parsed = parse_request(
        good(
            repetition_penalty=np.array([[1.3], [1.0]], dtype=np.float32),
            presence_penalty=np.array([[0.5], [0.0]], dtype=np.float32),
            frequency_penalty=np.array([[0.0], [0.25]], dtype=np.float32),
            temperature=np.array([[0.0], [0.7]], dtype=np.float32),
            min_length=np.array([[4], [0]], dtype=np.int32),
            bad_words_list=np.array([[[7, 8, 9], [1, 3, -1]]], dtype=np.int32),
            beam_width=np.array([[1], [1]], dtype=np.int32),
            len_penalty=np.array([[0.8], [0.8]], dtype=np.float32),
            exclude_input_in_output=np.array([[True], [True]]),
        ),
        CFG,
    )
    first, second = parsed.rows
    assert first.sampling is not None and second.sampling is not None
    assert (first.sampling.repetition_penalty, first.sampling.presence_penalty) == (
        pytest.approx(1.3),
        0.5,
    )
    # Each row its own sampling.
    assert (first.sampling.temperature, second.sampling.temperature) == (0, pytest.approx(0.7))
    assert second.sampling.frequency_penalty == 0.25
    assert (first.min_length, second.min_length) == (4, 0)
    assert first.bad_words == second.bad_words == ((7,), (8, 9))


def test_log_probs_are_asked_for_per_row() -> None:
    first, second = parse_request(good(return_log_probs=np.array([[True], [False]])), CFG).rows
    assert (first.return_log_probs, second.return_log_probs) == (True, False)
    assert not any(r.return_log_probs for r in parse_request(good(), CFG).rows)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"beam_width": np.array([[2], [2]], dtype=np.int32)}, "beam_width: 2; this engine"),
        ({"return_context_logits": np.array([[True], [False]])}, "return_context_logits"),
        ({"return_generation_logits": np.array([[True], [True]])}, "return_generation_logits"),
        ({"exclude_input_in_output": np.array([[False], [False]])}, "exclude_input_in_output"),
        ({"repetition_penalty": np.array([[0.0], [1.0]], dtype=np.float32)}, "repetition_"),
        ({"presence_penalty": np.array([[np.inf], [0]], dtype=np.float32)}, "presence_penalty"),
        ({"min_length": np.array([[11], [0]], dtype=np.int32)}, "min_length: row 0"),
        ({"bad_words_list": np.array([[[7], [2]]], dtype=np.int32)}, "bad_words_list"),
    ],
)
def test_what_the_engine_cannot_honour_is_refused_by_name(
    changes: dict[str, object], needle: str
) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        parse_request(good(**changes), CFG)
