"""A small, honest client for the tests: Triton's streaming gRPC API and its metrics page."""

from __future__ import annotations

import queue
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import np_to_triton_dtype

ENGINE_METRIC_NAMES = ("nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics")


@dataclass
class Answer:
    """Everything one request got back, in order."""

    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)
    error: str | None = None
    final: bool = False

    def tokens(self, row: int = 0) -> list[int]:
        got: list[int] = []
        for out in self.outputs:
            if "output_ids" not in out:
                continue
            index = out.get("batch_index")
            if index is None or int(index.reshape(-1)[0]) == row:
                got.extend(int(t) for t in out["output_ids"].reshape(-1))
        return got

    def texts(self) -> list[bytes]:
        return [bytes(o["text_output"].reshape(-1)[0]) for o in self.outputs if "text_output" in o]


def make_inputs(tensors: Mapping[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in tensors.items():
        dtype = "BYTES" if value.dtype == np.object_ else np_to_triton_dtype(value.dtype)
        item = grpcclient.InferInput(name, list(value.shape), dtype)
        item.set_data_from_numpy(value)
        inputs.append(item)
    return inputs


def engine_request(
    prompt: list[int], max_tokens: int, *, streaming: bool = False, **extra: np.ndarray
) -> dict[str, np.ndarray]:
    """One-row `tensorrt_llm` inputs."""
    tensors = {
        "input_ids": np.asarray([prompt], dtype=np.int32),
        "input_lengths": np.asarray([[len(prompt)]], dtype=np.int32),
        "request_output_len": np.asarray([[max_tokens]], dtype=np.int32),
        "streaming": np.asarray([[streaming]], dtype=np.bool_),
    }
    tensors.update(extra)
    return tensors


def text_request(text: str, max_tokens: int, *, stream: bool = False) -> dict[str, np.ndarray]:
    return {
        "text_input": np.asarray([[text]], dtype=np.object_),
        "max_tokens": np.asarray([[max_tokens]], dtype=np.int32),
        "stream": np.asarray([[stream]], dtype=np.bool_),
    }


def infer(
    url: str,
    model: str,
    tensors: Mapping[str, np.ndarray],
    *,
    request_id: str = "",
    timeout_s: float = 120.0,
    on_output: Callable[[Answer, grpcclient.InferenceServerClient], bool] | None = None,
) -> Answer:
    """Send one request on its own stream and collect answers until the final flag or an error.

    `on_output` sees the answer after every response; returning True stops the stream there
    and cancels the request (as a client that goes away does).
    """
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    answer = Answer()
    try:
        client.async_stream_infer(
            model, make_inputs(tensors), request_id=request_id, enable_empty_final_response=True
        )
        deadline = time.monotonic() + timeout_s
        while True:
            result, error = answers.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:
                answer.error = str(error)
                return answer
            response = result.get_response()  # type: ignore[attr-defined]
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}  # type: ignore[attr-defined]
            if outputs:
                answer.outputs.append(outputs)
            if response.parameters["triton_final_response"].bool_param:
                answer.final = True
                return answer
            if on_output is not None and on_output(answer, client):
                client.stop_stream(cancel_requests=True)
                return answer
    finally:
        client.stop_stream()
        client.close()


def scrape(metrics_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample on a Prometheus page, keyed by name and label set."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def engine_metric(
    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float],
    name: str,
    model: str,
    **labels: str,
) -> float:
    key = (name, frozenset({"model": model, "version": "1", **labels}.items()))
    if key not in samples:
        raise KeyError(f"no sample {name}{{model={model}, {labels}}}")
    return samples[key]


def engine_models(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float]) -> set[str]:
    return {
        dict(labels)["model"]
        for name, labels in samples
        if name == "nv_trt_llm_kv_cache_block_metrics"
    }


def wait_engine_idle(metrics_url: str, model: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll until the engine has nothing in flight and every KV block is free; return the state."""
    deadline = time.monotonic() + timeout_s
    state: dict[str, float] = {}
    while time.monotonic() < deadline:
        samples = scrape(metrics_url)
        kv = "nv_trt_llm_kv_cache_block_metrics"
        req = "nv_trt_llm_request_metrics"
        state = {
            "free": engine_metric(samples, kv, model, kv_cache_block_type="free"),
            "max": engine_metric(samples, kv, model, kv_cache_block_type="max"),
            "used": engine_metric(samples, kv, model, kv_cache_block_type="used"),
            "active": engine_metric(samples, req, model, request_type="active"),
            "waiting": engine_metric(samples, req, model, request_type="waiting"),
        }
        if (
            state["used"] == 0
            and state["free"] == state["max"]
            and not state["active"]
            and not state["waiting"]
        ):
            return state
        time.sleep(0.05)
    raise AssertionError(f"engine {model} did not return to idle with all KV free: {state}")
