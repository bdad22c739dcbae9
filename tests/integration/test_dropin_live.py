"""A stock tritonclient program pointed at the sidecar instead of Triton: the calls beyond
inference pass through to Triton, shared memory is refused clearly, request ids are labels."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.serving.tokenizer import load_tokenizer
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.conftest import CPU_REPO, _start
from tests.integration.sidecar import SidecarProcess
from tests.integration.tritonio import engine_request, infer, make_inputs, text_request


def test_metadata_statistics_and_the_repository_pass_through_to_triton(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    through = grpcclient.InferenceServerClient(sidecar.url)
    direct = grpcclient.InferenceServerClient(triton.grpc_url)
    server = through.get_server_metadata()
    assert server.name == "scheduler_svc" and server.extensions
    assert not [e for e in server.extensions if "shared_memory" in e]
    assert set(server.extensions) <= set(direct.get_server_metadata().extensions)
    for model in ("tensorrt_llm", "preprocessing", "postprocessing"):
        assert through.is_model_ready(model)
        assert through.get_model_metadata(model) == direct.get_model_metadata(model)
        assert through.get_model_config(model) == direct.get_model_config(model)
    assert through.get_model_metadata("ensemble").name == "ensemble"  # served here
    index = {m.name for m in through.get_model_repository_index().models}
    assert {"ensemble", "tensorrt_llm", "preprocessing", "postprocessing"} <= index
    through.infer("ensemble", make_inputs(text_request("hello", 2)))
    stats = through.get_inference_statistics("tensorrt_llm")
    assert stats.model_stats and stats.model_stats[0].name == "tensorrt_llm"
    assert stats.model_stats[0].inference_stats.success.count >= 1
    with pytest.raises(InferenceServerException, match=r"NOT_FOUND|not found|unknown"):
        through.get_model_metadata("no_such_model")  # Triton's own answer, its own class


def test_repository_management_and_settings_need_the_admin_role(
    sidecar: SidecarProcess,
) -> None:
    client = grpcclient.InferenceServerClient(sidecar.url)
    for call in (
        lambda: client.load_model("tensorrt_llm"),
        lambda: client.unload_model("tensorrt_llm"),
        client.get_log_settings,
        client.get_trace_settings,
    ):
        with pytest.raises(InferenceServerException, match="PERMISSION_DENIED"):
            call()
    # The local operator, on the admin listener: Triton's own answer (explicit model control
    # is off in the embedded Triton, so it refuses the load with its reason).
    local = grpcclient.InferenceServerClient(sidecar.admin_url)
    assert local.get_log_settings().settings
    with pytest.raises(InferenceServerException, match="explicit model load / unload"):
        local.load_model("tensorrt_llm")


def test_shared_memory_is_refused_with_the_reason(sidecar: SidecarProcess) -> None:
    client = grpcclient.InferenceServerClient(sidecar.url)
    with pytest.raises(InferenceServerException, match="cannot see the client's memory") as caught:
        client.register_system_shared_memory("region", "/key", 1024)
    assert "UNIMPLEMENTED" in str(caught.value)
    with pytest.raises(InferenceServerException, match="UNIMPLEMENTED"):
        client.get_cuda_shared_memory_status()


def test_request_ids_are_labels_clients_may_reuse(sidecar: SidecarProcess) -> None:
    stub = sidecar.scheduler()
    request = pb.GenerateRequest(request_id="7", prompt="hello there", max_tokens=3)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: stub.Generate(request, timeout=60), range(8)))
    assert all(a.request_id == "7" and a.usage.completion_tokens == 3 for a in answers)
    client = grpcclient.InferenceServerClient(sidecar.url)
    errors: list[Exception] = []

    def kserve() -> None:
        try:
            result = client.infer("ensemble", make_inputs(text_request("hi", 2)), request_id="7")
            assert result.get_response().id == "7"
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=kserve) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_the_sidecars_ensemble_contract_is_within_tritons_and_lists_end_and_pad_ids(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    ours = grpcclient.InferenceServerClient(sidecar.url).get_model_metadata("ensemble")
    theirs = grpcclient.InferenceServerClient(triton.grpc_url).get_model_metadata("ensemble")
    names = {i.name for i in ours.inputs}
    assert {"end_id", "pad_id"} <= names <= {i.name for i in theirs.inputs}
    tensors = {
        **text_request("hello", 3),
        "end_id": np.array([[5]], dtype=np.int32),
        "pad_id": np.array([[0]], dtype=np.int32),
    }
    result = grpcclient.InferenceServerClient(sidecar.url).infer("ensemble", make_inputs(tensors))
    assert result.as_numpy("text_output") is not None


def test_the_models_other_end_tokens_end_generation_as_stop_words(
    sidecar: SidecarProcess, triton: TritonServer, tmp_path: Path
) -> None:
    """`model.stop_token_ids` goes to the engine as TensorRT-LLM's stop_words_list: the real
    engine ends the row on the token, which is output, and the answer finishes STOP."""
    request = pb.GenerateRequest(prompt="The weather today", max_tokens=16)
    free = [t for chunk in sidecar.scheduler().GenerateStream(request) for t in chunk.token_ids]
    assert len(free) == 16
    k = next(i for i in range(3, 16) if free[i] not in free[:i])  # its first occurrence
    config = {"model": {"stop_token_ids": [free[k]]}}
    stopping = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    try:
        chunks = list(stopping.scheduler().GenerateStream(request))
        ids = [t for chunk in chunks for t in chunk.token_ids]
        assert ids == free[: k + 1]
        assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
        assert chunks[-1].usage.completion_tokens == k + 1
    finally:
        stopping.stop()


def _text(url: str, tensors: dict[str, np.ndarray]) -> tuple[str | None, str | None]:
    """The ensemble's whole text from one request on a stream (Triton serves the decoupled
    ensemble there only), or its error."""
    answer = infer(url, "ensemble", tensors)
    if answer.error is not None:
        return None, answer.error
    return "".join(
        t.decode() for out in answer.outputs for t in out["text_output"].reshape(-1)
    ), None


def test_the_full_ensemble_contract_answers_as_triton_does(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    """Stop and bad words, min_length and the penalties reach the engine through Triton's own
    ensemble and through the sidecar alike: the same text from both, and each input changes
    the answer. What the engine cannot do (beams, logits) both refuse, naming the input."""
    prompt = "The weather today"
    tokenizer = load_tokenizer()
    request = pb.GenerateRequest(prompt=prompt, max_tokens=12)
    ids = [t for chunk in sidecar.scheduler().GenerateStream(request) for t in chunk.token_ids]

    def word_at(k: int) -> str:  # a generated token that is a word of its own
        for i in range(k, len(ids)):
            word = tokenizer.decode([ids[i]])
            whole = tokenizer.encode(word, add_special_tokens=False).ids == [ids[i]]
            if whole and ids[i] not in ids[:i]:
                return word
        raise AssertionError("no generated token round-trips as a word")

    base = text_request(prompt, 12)
    free, _ = _text(triton.grpc_url, base)
    words = np.array([[word_at(3)]], dtype=np.object_)
    cases = {
        "stop_words": {"stop_words": words},
        "bad_words": {"bad_words": np.array([[word_at(0), word_at(4)]], dtype=np.object_)},
        "penalties": {
            "repetition_penalty": np.array([[1.8]], dtype=np.float32),
            "presence_penalty": np.array([[0.7]], dtype=np.float32),
            "frequency_penalty": np.array([[0.4]], dtype=np.float32),
        },
        "min_length and end_id": {
            "end_id": np.array([[ids[2]]], dtype=np.int32),
            "min_length": np.array([[6]], dtype=np.int32),
        },
        "accepted, no effect": {
            "length_penalty": np.array([[0.5]], dtype=np.float32),
            "beam_width": np.array([[1]], dtype=np.int32),
            "exclude_input_in_output": np.array([[True]]),
        },
    }
    for name, extra in cases.items():
        theirs, error = _text(triton.grpc_url, {**base, **extra})
        assert error is None, (name, error)
        ours, error = _text(sidecar.url, {**base, **extra})
        assert error is None, (name, error)
        assert ours == theirs, name
        assert (ours == free) is (name == "accepted, no effect"), name
    stopped, _ = _text(sidecar.url, {**base, "stop_words": words})
    assert stopped is not None and free is not None
    assert stopped.endswith(str(words[0, 0])) and free.startswith(stopped)
    refused = {
        "beam_width": np.array([[2]], dtype=np.int32),
        "return_generation_logits": np.array([[True]]),
    }
    for name, value in refused.items():
        _, theirs = _text(triton.grpc_url, {**base, name: value})
        _, ours = _text(sidecar.url, {**base, name: value})
        assert theirs is not None and name in theirs, theirs
        assert ours is not None and "[INVALID_ARGUMENT]" in ours and name in ours, ours


def _log_probs(answer: object) -> tuple[list[float], list[float]]:
    """Every response's output_log_probs end to end, and each response's cum_log_probs."""
    outputs = [o for o in answer.outputs if "output_log_probs" in o]  # type: ignore[attr-defined]
    values = [float(v) for o in outputs for v in o["output_log_probs"].reshape(-1)]
    return values, [float(o["cum_log_probs"].reshape(-1)[0]) for o in outputs]


def test_log_probs_come_through_the_sidecar_as_from_triton(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    """return_log_probs on the ensemble and on the engine model, streamed and whole: the
    sidecar passes it to the engine and answers the engine's values in Triton's layout."""
    asked = {"return_log_probs": np.array([[True]])}
    for stream in (False, True):
        tensors = {**text_request("The weather today", 6, stream=stream), **asked}
        theirs, ours = (
            infer(triton.grpc_url, "ensemble", tensors),
            infer(sidecar.url, "ensemble", tensors),
        )
        assert theirs.error is None and ours.error is None, (theirs.error, ours.error)
        (their_values, their_cums), (our_values, our_cums) = _log_probs(theirs), _log_probs(ours)
        assert len(our_values) == 6 and our_values == pytest.approx(their_values, abs=1e-3)
        assert our_cums[-1] == pytest.approx(sum(our_values), abs=1e-3)
        assert our_cums[-1] == pytest.approx(their_cums[-1], abs=1e-3)
    prompt = load_tokenizer().encode("The weather today", add_special_tokens=False).ids
    tensors = engine_request(prompt, 5, streaming=True, end_id=np.array([[-1]], np.int32), **asked)
    theirs, ours = (
        infer(triton.grpc_url, "tensorrt_llm", tensors),
        infer(sidecar.url, "tensorrt_llm", tensors),
    )
    assert ours.tokens() == theirs.tokens()
    assert _log_probs(ours)[0] == pytest.approx(_log_probs(theirs)[0], abs=1e-3)
    assert [o["output_log_probs"].shape for o in ours.outputs if "output_ids" in o] == [
        (1, 1, len(o["output_ids"].reshape(-1))) for o in ours.outputs if "output_ids" in o
    ]
    plain = infer(sidecar.url, "ensemble", text_request("The weather today", 3))
    assert plain.error is None and not _log_probs(plain)[0]


def test_a_batched_request_is_answered_row_by_row_as_triton_does(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    """A [2, 1] request: two scheduled requests in the sidecar, answered on the stream with
    batch_index as Triton answers it, and whole ([2, 1]) on ModelInfer."""
    tensors = {
        "text_input": np.array([["The weather today"], ["Hello, 你好"]], dtype=np.object_),
        "max_tokens": np.array([[6], [9]], dtype=np.int32),
        "stream": np.array([[True], [True]]),
    }

    def rows(url: str) -> dict[int, str]:
        answer = infer(url, "ensemble", tensors)
        assert answer.error is None and answer.final, answer.error
        texts = {0: "", 1: ""}
        for out in answer.outputs:
            if "text_output" in out:
                row = int(out["batch_index"].reshape(-1)[0])
                texts[row] += out["text_output"].reshape(-1)[0].decode()
        return texts

    theirs = rows(triton.grpc_url)
    ended = len(sidecar.events("request end"))
    assert rows(sidecar.url) == theirs and theirs[0] and theirs[1]
    client = grpcclient.InferenceServerClient(sidecar.url)
    whole = client.infer("ensemble", make_inputs({**tensors, "stream": np.array([[False]])}))
    assert [t.decode() for t in whole.as_numpy("text_output").reshape(-1)] == [theirs[0], theirs[1]]
    # Each row was a request of its own: two streamed, two unary.
    sidecar.wait_for_events("request end", lambda ends: len(ends) >= ended + 4)
    assert len(sidecar.events("request end")) == ended + 4


def test_the_engine_model_is_scheduled_through_the_sidecar(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    """`tensorrt_llm` requests (token ids in and out), as TensorRT-LLM clients send them: the
    same tokens through the sidecar as from Triton, streamed or not, one row or two; each row
    goes through the scheduler (a request end of its own)."""
    prompt = load_tokenizer().encode("The weather today", add_special_tokens=False).ids
    ended = len(sidecar.events("request end"))
    for streaming in (True, False):
        tensors = engine_request(prompt, 8, streaming=streaming, end_id=np.array([[-1]], np.int32))
        theirs = infer(triton.grpc_url, "tensorrt_llm", tensors)
        ours = infer(sidecar.url, "tensorrt_llm", tensors)
        assert theirs.error is None and ours.error is None, (theirs.error, ours.error)
        assert ours.final and ours.tokens() == theirs.tokens() and len(ours.tokens()) == 8
        if streaming:
            assert len(ours.outputs) > 1  # new tokens per response
    two = {
        "input_ids": np.asarray([prompt, prompt[:2] + [0] * (len(prompt) - 2)], dtype=np.int32),
        "input_lengths": np.asarray([[len(prompt)], [2]], dtype=np.int32),
        "request_output_len": np.asarray([[5], [7]], dtype=np.int32),
        "streaming": np.asarray([[True], [True]]),
        "end_id": np.asarray([[-1], [-1]], dtype=np.int32),
    }
    theirs = infer(triton.grpc_url, "tensorrt_llm", two)
    ours = infer(sidecar.url, "tensorrt_llm", two)
    assert [ours.tokens(r) for r in (0, 1)] == [theirs.tokens(r) for r in (0, 1)]
    assert [len(ours.tokens(r)) for r in (0, 1)] == [5, 7]
    sidecar.wait_for_events("request end", lambda ends: len(ends) >= ended + 4)
    assert len(sidecar.events("request end")) - ended == 4
    whole = grpcclient.InferenceServerClient(sidecar.url).infer(
        "tensorrt_llm", make_inputs({**two, "streaming": np.asarray([[False], [False]])})
    )
    assert whole.as_numpy("sequence_length").reshape(-1).tolist() == [5, 7]
    assert whole.as_numpy("output_ids")[1, 0, :7].tolist() == theirs.tokens(1)
    stop = infer(
        sidecar.url, "tensorrt_llm", {**engine_request(prompt, 4), "stop": np.array([[True]])}
    )
    assert stop.error is not None and "request ids are labels" in stop.error
    versioned = grpcclient.InferenceServerClient(sidecar.url)
    with pytest.raises(InferenceServerException, match="version '2' is not served"):
        versioned.infer("ensemble", make_inputs(text_request("hi", 2)), model_version="2")


def test_the_text_and_engine_models_are_discovered_from_tritons_repository(
    tmp_path: Path,
) -> None:
    """A repository whose text ensemble is not called `ensemble` and whose engine is not called
    `tensorrt_llm`: the sidecar finds both by their contracts, and every front answers for
    those names."""
    repo = tmp_path / "repo"
    shutil.copytree(CPU_REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "ensemble").rename(repo / "chat-model")
    config = repo / "chat-model" / "config.pbtxt"
    text = config.read_text().replace('name: "ensemble"', 'name: "chat-model"')
    config.write_text(text.replace('model_name: "tensorrt_llm"', 'model_name: "llm-engine"'))
    (repo / "tensorrt_llm").rename(repo / "llm-engine")
    config = repo / "llm-engine" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "tensorrt_llm"', 'name: "llm-engine"'))
    triton = _start(repo, tmp_path / "triton.log")
    sidecar = SidecarProcess(triton.grpc_url, tmp_path).start()
    try:
        discovered = sidecar.wait_for_events("text model discovered", lambda e: len(e) >= 1)
        assert discovered[0]["model"] == "chat-model"
        [engine] = sidecar.events("engine model discovered")
        assert engine["model"] == "llm-engine" and engine["candidates"] == ["llm-engine"]
        prompt = load_tokenizer().encode("Hello there", add_special_tokens=False).ids
        tensors = engine_request(prompt, 4, end_id=np.array([[-1]], np.int32))
        theirs = infer(triton.grpc_url, "llm-engine", tensors)
        ours = infer(sidecar.url, "llm-engine", tensors)
        assert ours.error is None and ours.tokens() == theirs.tokens() and len(ours.tokens()) == 4
        client = grpcclient.InferenceServerClient(sidecar.url)
        assert client.get_model_metadata("chat-model").platform == "ensemble"
        result = client.infer("chat-model", make_inputs(text_request("hello", 3)))
        assert result.as_numpy("text_output") is not None
        with pytest.raises(InferenceServerException, match="not served here"):
            client.infer("ensemble", make_inputs(text_request("hello", 3)))
        models = httpx.get(f"{sidecar.http_url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["chat-model"]
    finally:
        sidecar.stop()
        triton.stop()
