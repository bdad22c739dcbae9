"""The reference engine's logit processing: penalties and bans, as TensorRT-LLM applies them."""

from __future__ import annotations

import torch

from reference_engine.llama import _processed
from reference_engine.request import EngineRequest, RunningSequence, Sampling


def seq(generated: list[int], **fields: object) -> RunningSequence:
    request = EngineRequest(key="k", streaming=True, sampling=Sampling(), handle=None)
    row = RunningSequence(0, request, 0, (1, 2), 10, end_id=5, pad_id=0, **fields)  # type: ignore[arg-type]
    row.generated = list(generated)
    return row


def test_nothing_to_do_leaves_the_logits_alone() -> None:
    assert _processed(torch.zeros(8), seq([3])) is None


def test_repetition_presence_and_frequency_penalties() -> None:
    logits = torch.tensor([1.0, 2.0, -2.0, 4.0, 0.5, 0.0, 1.0, 1.0])
    repeated = _processed(logits, seq([3, 3], sampling=Sampling(repetition_penalty=2.0)))
    assert repeated is not None
    # Seen: the prompt (1, 2) and the output (3): positive logits halve, negative ones double.
    assert repeated.tolist() == [1.0, 1.0, -4.0, 2.0, 0.5, 0.0, 1.0, 1.0]
    counted = _processed(
        logits, seq([3, 3, 4], sampling=Sampling(presence_penalty=0.5, frequency_penalty=0.25))
    )
    assert counted is not None
    assert counted[3].item() == 4.0 - 0.5 - 0.5 and counted[4].item() == 0.5 - 0.5 - 0.25
    assert counted[1].item() == 2.0  # the prompt is not counted


def test_bad_words_and_min_length_ban_tokens() -> None:
    logits = torch.zeros(8)
    banned = _processed(logits, seq([6, 3], bad_words=((7,), (3, 4), (6, 2)), min_length=4))
    assert banned is not None
    inf = float("-inf")
    # 7 always; 4 because the output ends with 3; not 2 (the output does not end with 6);
    # the end token 5 while under min_length.
    assert [i for i, v in enumerate(banned.tolist()) if v == inf] == [4, 5, 7]
    assert seq([6, 3, 1, 1], min_length=4).banned() == []
