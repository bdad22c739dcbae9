"""TensorRT-LLM's tensor contract, the one copy the sidecar, the ensemble and the engine read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler_svc.contracts.trtllm import (
    IDENTIFYING_INPUTS,
    INPUTS,
    read_word_lists,
    refusal,
    word_lists,
)

_WORD = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5).map(tuple)
_ROWS = st.lists(st.lists(_WORD, max_size=4).map(tuple), min_size=1, max_size=6)


@given(_ROWS)
def test_word_lists_read_back_as_written(rows: list[tuple[tuple[int, ...], ...]]) -> None:
    assert read_word_lists(word_lists(rows), len(rows), "stop_words_list") == rows


def test_one_rows_words_serve_every_row_and_bad_layouts_are_named() -> None:
    one = word_lists([((7,), (8, 9))])
    assert read_word_lists(one, 3, "bad_words_list") == [((7,), (8, 9))] * 3
    assert read_word_lists(one[0], 2, "bad_words_list") == [((7,), (8, 9))] * 2  # [2, n]
    with pytest.raises(ValueError, match=r"bad_words_list: expected shape \[rows, 2, n\]"):
        read_word_lists(word_lists([(), (), ()]), 2, "bad_words_list")
    with pytest.raises(ValueError, match="stop_words_list: offsets must rise"):
        read_word_lists(np.array([[[40, 41], [2, 1]]]), 1, "stop_words_list")
    with pytest.raises(ValueError, match="offsets must rise within the 2 ids"):
        read_word_lists(np.array([[[40, 41], [3, -1]]]), 1, "stop_words_list")


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"beam_width": 2}, "beam_width: 2; this engine decodes one beam"),
        ({"return_context_logits": True}, "return_context_logits: context logits"),
        ({"return_generation_logits": True}, "return_generation_logits"),
        ({"exclude_input_in_output": False}, "exclude_input_in_output: false"),
    ],
)
def test_what_the_engine_cannot_do_is_named(row: dict[str, object], needle: str) -> None:
    why = refusal(row)
    assert why is not None and needle in why


def test_what_it_can_do_passes() -> None:
    fine = {"beam_width": 1, "return_context_logits": False, "exclude_input_in_output": True}
    assert refusal(fine) is None and refusal({}) is None
    assert refusal({"len_penalty": 0.3}) is None  # ranks beams only: with one, any value


def test_the_identifying_inputs_are_required_inputs_of_the_table() -> None:
    for name, datatype in IDENTIFYING_INPUTS:
        assert INPUTS[name].required and INPUTS[name].datatype == datatype
    assert INPUTS["repetition_penalty"].numpy_kinds == "fiu"  # an integer penalty is taken
    assert INPUTS["random_seed"].numpy_kinds == "iu" and INPUTS["streaming"].numpy_kinds == "b"
