"""Triton's readiness as the sidecar reads it: one missed check is not an outage; the engine
model is found in Triton's repository when the config does not name it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from scheduler_svc.config import TritonConfig
from scheduler_svc.serving.backends.triton import TritonBackend


@dataclass
class Answers:
    """A stand-in for Triton's gRPC stub: each check takes the next scripted answer (True,
    False, or a status code the call fails with)."""

    script: list[bool | grpc.StatusCode]

    def _next(self) -> bool:
        # One scripted answer per check: a failure or "not ready" ends the check here; "ready"
        # is taken by the model's readiness call that follows.
        answer = self.script[0]
        if answer is not True:
            self.script.pop(0)
        if isinstance(answer, grpc.StatusCode):
            raise grpc.aio.AioRpcError(answer, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")
        return answer

    async def ServerReady(self, request: Any, timeout: float) -> Any:
        return service_pb2.ServerReadyResponse(ready=self._next())

    async def ModelReady(self, request: Any, timeout: float) -> Any:
        return service_pb2.ModelReadyResponse(ready=self.script.pop(0))


def checks(script: list[bool | grpc.StatusCode], misses: int = 3) -> list[bool]:
    backend = TritonBackend(TritonConfig(engine_model="tensorrt_llm", unready_after_misses=misses))
    stub = Answers(list(script))
    backend._stub = stub  # type: ignore[assignment]

    async def run() -> list[bool]:
        out = []
        while stub.script:
            out.append(await backend.ready())
        return out

    return asyncio.run(run())


def test_a_ready_triton_stays_ready_through_fewer_missed_checks_than_the_limit() -> None:
    late = grpc.StatusCode.DEADLINE_EXCEEDED
    gone = grpc.StatusCode.UNAVAILABLE
    assert checks([True, late, gone, True]) == [True, True, True, True]
    # The third miss in a row is an outage; the next answer counts again.
    assert checks([True, late, late, gone, True]) == [True, True, True, False, True]
    assert checks([True, late, late, gone], misses=1) == [True, False, False, False]


def test_not_ready_is_believed_at_once_and_a_miss_before_any_answer_is_not_ready() -> None:
    assert checks([True, False]) == [True, False]
    assert checks([grpc.StatusCode.UNAVAILABLE, True]) == [False, True]
    # A triton that said it is not ready stays so through misses.
    assert checks([False, grpc.StatusCode.DEADLINE_EXCEEDED]) == [False, False]


def metadata(name: str, inputs: dict[str, str], outputs: list[str]) -> Any:
    meta = service_pb2.ModelMetadataResponse(name=name)
    for input_name, datatype in inputs.items():
        meta.inputs.add(name=input_name, datatype=datatype)
    for output in outputs:
        meta.outputs.add(name=output, datatype="INT32")
    return meta


ENGINE = {"input_ids": "INT32", "input_lengths": "INT32", "request_output_len": "INT32"}


@dataclass
class Repository:
    """A stand-in for Triton's stub with a model repository: every model is ready."""

    models: dict[str, Any]

    async def ServerReady(self, request: Any, timeout: float) -> Any:
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: Any, timeout: float) -> Any:
        return service_pb2.ModelReadyResponse(ready=request.name in self.models)

    async def RepositoryIndex(self, request: Any, timeout: float) -> Any:
        assert request.ready  # only ready models are candidates
        index = service_pb2.RepositoryIndexResponse()
        for name in self.models:
            index.models.add(name=name, state="READY")
        return index

    async def ModelMetadata(self, request: Any, timeout: float) -> Any:
        return self.models[request.name]


def discovered(models: dict[str, Any], configured: str | None = None) -> tuple[str, bool]:
    backend = TritonBackend(TritonConfig(engine_model=configured))
    backend._stub = Repository(models)  # type: ignore[assignment]
    ready = asyncio.run(backend.ready())
    return backend.engine_model, ready


def test_the_engine_model_is_the_ready_model_with_the_engine_contract() -> None:
    text = metadata("ensemble", {"text_input": "BYTES", "max_tokens": "INT32"}, ["text_output"])
    pre = metadata("preprocessing", {"QUERY": "BYTES"}, ["INPUT_ID"])
    engine = metadata("llama_engine", ENGINE, ["output_ids", "sequence_length"])
    assert discovered({"ensemble": text, "preprocessing": pre, "llama_engine": engine}) == (
        "llama_engine",
        True,
    )
    # Among several, TensorRT-LLM's own name; else the first by name.
    other = metadata("a_engine", ENGINE, ["output_ids"])
    trt = metadata("tensorrt_llm", ENGINE, ["output_ids"])
    assert discovered({"llama_engine": engine, "tensorrt_llm": trt, "a_engine": other})[0] == (
        "tensorrt_llm"
    )
    assert discovered({"llama_engine": engine, "a_engine": other})[0] == "a_engine"
    # An input of the wrong type is not the contract; with no engine, the default name stays
    # and Triton's readiness for it decides.
    wrong = metadata("llama_engine", {**ENGINE, "input_ids": "INT64"}, ["output_ids"])
    assert discovered({"ensemble": text, "llama_engine": wrong}) == ("tensorrt_llm", False)
    # A configured name is used as it is: no discovery.
    assert discovered({"llama_engine": engine}, configured="mine") == ("mine", False)
