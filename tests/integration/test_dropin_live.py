"""A stock tritonclient program pointed at the sidecar instead of Triton: the calls beyond
inference pass through to Triton, shared memory is refused clearly, request ids are labels."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.triton.launcher import TritonServer
from tests.integration.sidecar import SidecarProcess
from tests.integration.tritonio import make_inputs, text_request


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
