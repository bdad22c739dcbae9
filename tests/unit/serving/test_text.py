"""Detokenizing a stream: never a split character, stop strings cut exactly."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.serving.text import TextStream
from scheduler_svc.serving.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()


def ids_of(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


def stream_all(
    ids: list[int], stop: tuple[str, ...] = (), chunk: int = 1
) -> tuple[list[str], TextStream]:
    text = TextStream(TOKENIZER, stop)
    deltas = [text.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(text.finish())
    return deltas, text


def test_multibyte_characters_are_never_split() -> None:
    source = "狐狸 🦊 naïve café — 敏捷的棕色狐狸"
    ids = ids_of(source)
    deltas, text = stream_all(ids)
    assert "".join(deltas) == source == text.text
    assert all("\ufffd" not in d for d in deltas)
    # Some emoji / CJK need several byte-level tokens: at least one step held text back.
    assert "" in deltas[:-1]


@pytest.mark.parametrize("seed", range(5))
def test_random_token_streams_concatenate_to_the_whole_decode(seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(TOKENIZER.get_vocab_size(with_added_tokens=False)) for _ in range(60)]
    deltas, text = stream_all(ids, chunk=rng.randint(1, 3))
    assert "".join(deltas) == TOKENIZER.decode(ids, skip_special_tokens=True) == text.text


def test_stop_string_split_across_tokens_cuts_before_it() -> None:
    source = "The answer is 42. END of story"
    deltas, text = stream_all(ids_of(source), stop=("END",))
    assert text.stopped
    assert "".join(deltas) == "The answer is 42. " == text.text
    assert not any("E" in d for d in deltas)  # the held-back prefix never leaked


def test_the_earliest_of_several_stop_strings_wins() -> None:
    _, text = stream_all(ids_of("alpha beta gamma delta"), stop=("delta", "beta"))
    assert text.text == "alpha "


def test_a_stop_prefix_that_does_not_complete_is_released() -> None:
    deltas, text = stream_all(ids_of("we stopped at sto and went on"), stop=("stop!",))
    assert not text.stopped
    assert "".join(deltas) == "we stopped at sto and went on"


def test_nothing_is_emitted_after_a_stop() -> None:
    text = TextStream(TOKENIZER, ("b",))
    text.push(ids_of("a b"))
    assert text.stopped
    assert text.push(ids_of(" c d")) == "" and text.finish() == ""
    assert text.text == "a "


def test_each_id_carries_the_text_it_added_once() -> None:
    """What OpenAI's log-probability objects show per token: an id that only begins a character
    adds "", the one that completes it the character; together, the whole text."""
    source = "狐狸 🦊 naïve café"
    ids = ids_of(source)
    _, text = stream_all(ids, chunk=3)
    assert len(text.token_texts) == len(ids)
    assert "".join(text.token_texts) == TOKENIZER.decode(ids) == source
    assert "" in text.token_texts  # the emoji's bytes span ids
