"""How the KServe front cuts one row's events into streamed responses, with log probabilities.

The service here is a stub that replays fixed events, so the cut is exact; the live tests
(tests/integration/test_dropin_live.py) send the same contract through the real stack.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as kserve_pb

from scheduler_svc.contracts.generation import Delta, Final, Finish, GenerationParams
from scheduler_svc.serving.fronts.kserve import KServeFront

PROBS = (-0.1, -0.2, -0.3, -0.4)
# Ids 5 and 8 complete no character on their own: their text comes with the next delta (8's
# with the tail the detokenizer flushes at the end). Id 8 is the last (max_tokens 4), as the
# service marks it.
EVENTS = [
    Delta("", (5,), (-0.1,)),
    Delta("ab", (6,), (-0.2,)),
    Delta("c", (7,), (-0.3,)),
    Delta("", (8,), (-0.4,), last=True),
    Delta("d", (), (), last=True),
    Final("r", "abcd", (5, 6, 7, 8), Finish.LENGTH, 2, 4, 0.0, 0.0, 0.0, "hot", PROBS),
]


class Replay:
    def __init__(self, events: list[Delta | Final] = EVENTS) -> None:
        self.events = events
        self.out: asyncio.Queue[Any] | None = None
        self.sent_before: list[int] = []  # responses out when each event was asked for

    async def generate(self, params: GenerationParams) -> AsyncGenerator[Delta | Final, None]:
        for event in self.events:
            self.sent_before.append(self.out.qsize() if self.out else 0)
            yield event


def _outputs(response: kserve_pb.ModelInferResponse) -> dict[str, np.ndarray[Any, Any]]:
    dtypes = {"FP32": "<f4", "INT32": "<i4"}
    got = {}
    for out, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if out.datatype in dtypes:
            got[out.name] = np.frombuffer(raw, dtype=dtypes[out.datatype]).reshape(out.shape)
        else:
            got[out.name] = np.asarray([raw[4:].decode()])
    return got


def _stream(
    engine: bool, stream: bool, replay: Replay | None = None
) -> list[kserve_pb.ModelInferResponse]:
    replay = replay or Replay()
    front = KServeFront(replay)  # type: ignore[arg-type]
    request = kserve_pb.ModelInferRequest(model_name="m", id="r")
    params = GenerationParams("r", prompt="x", max_tokens=4, return_log_probs=True)

    async def run() -> list[kserve_pb.ModelInferResponse]:
        out: asyncio.Queue[kserve_pb.ModelStreamInferResponse | None] = asyncio.Queue()
        replay.out = out
        streamed = front._engine_row_streamed if engine else front._row_streamed
        await streamed(request, params, stream, None, [1], out)
        return [out.get_nowait().infer_response for _ in range(out.qsize())]

    return asyncio.run(run())


def test_every_log_probability_goes_out_once_with_the_text_it_made() -> None:
    responses = [_outputs(r) for r in _stream(engine=False, stream=True)]
    assert [str(r["text_output"][0]) for r in responses] == ["ab", "c", "d"]
    pieces = [r["output_log_probs"].reshape(-1).tolist() for r in responses]
    assert pieces == [pytest.approx([-0.1, -0.2]), pytest.approx([-0.3]), pytest.approx([-0.4])]
    cums = [float(r["cum_log_probs"][0, 0]) for r in responses]
    assert cums == pytest.approx([-0.3, -0.6, -1.0])


def test_engine_rows_stream_ids_with_their_log_probabilities() -> None:
    responses = _stream(engine=True, stream=True)
    got = [_outputs(r) for r in responses]
    assert [r["output_ids"].reshape(-1).tolist() for r in got] == [[5], [6], [7], [8]]
    assert [r["output_log_probs"].shape for r in got] == [(1, 1, 1)] * 4
    assert [float(r["cum_log_probs"][0, 0]) for r in got] == pytest.approx([-0.1, -0.3, -0.6, -1.0])
    assert [r.parameters["triton_final_response"].bool_param for r in responses] == [
        False,
        False,
        False,
        True,
    ]


def test_a_whole_answer_carries_every_log_probability() -> None:
    for engine in (False, True):
        [response] = _stream(engine=engine, stream=False)
        got = _outputs(response)
        assert got["output_log_probs"].reshape(-1).tolist() == pytest.approx(list(PROBS))
        assert float(got["cum_log_probs"][0, 0]) == pytest.approx(sum(PROBS))


def test_each_piece_goes_out_before_the_next_token_and_the_last_rides_with_the_end() -> None:
    replay = Replay()
    responses = _stream(engine=False, stream=True, replay=replay)
    # "ab" is out before "c" is asked for, "c" before id 8: nothing waits on a later token.
    assert replay.sent_before == [0, 0, 1, 2, 2, 2]
    finals = [r.parameters["triton_final_response"].bool_param for r in responses]
    assert finals == [False, False, True]  # "d", the last piece, carries the final flag


def test_an_end_the_engine_did_not_announce_is_an_empty_final_response() -> None:
    unmarked = [
        Delta("ab", (6,), (-0.2,)),
        Final("r", "ab", (6,), Finish.STOP, 2, 1, 0.0, 0.0, 0.0, "hot", (-0.2,)),
    ]
    responses = _stream(engine=False, stream=True, replay=Replay(unmarked))
    got = [_outputs(r) for r in responses]
    assert [str(r["text_output"][0]) for r in got] == ["ab", ""]
    assert [r.parameters["triton_final_response"].bool_param for r in responses] == [False, True]
