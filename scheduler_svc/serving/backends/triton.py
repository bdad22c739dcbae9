"""The Triton adapter: TensorRT-LLM's `tensorrt_llm` contract over Triton's gRPC stream API.

Every request goes out with `streaming=true` on a `ModelStreamInfer` call that carries only it,
so tokens come back as the engine makes them; a call whose request ended cleanly is kept open
for the next one (no call set-up per request). A request the sidecar no longer wants (client
gone, stop string, past its deadline) is ended the way TensorRT-LLM's own clients end one: a
`stop` request with the same id on the same stream, the call reused once the engine has answered
both; only a stream that stays silent is cancelled outright. Either way the engine frees the
request's KV blocks. Errors become the sidecar's error types here and nowhere else.

Over 500 lines: the stream client, the request/response codec and the engine-profile reader
live here together; the codec belongs in contracts/ with the other copies of TensorRT-LLM's
tensor contract once they are merged (issue 30's next step).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import numpy as np
import numpy.typing as npt
import structlog
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from scheduler_svc.config import TritonConfig, TritonTls
from scheduler_svc.contracts.trtllm import (
    IDENTIFYING_INPUTS,
    IDENTIFYING_OUTPUTS,
    INPUTS,
    word_lists,
)
from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.errors import (
    BackendFailedError,
    BackendUnavailableError,
    ConfigError,
    DeadlineError,
    TritonCallError,
    from_backend_message,
    from_backend_status,
    from_repository_status,
)
from scheduler_svc.profiles import load_profile
from scheduler_svc.serving.backends.base import DEFAULT_ENGINE_MODEL, GenerationInput, Tokens
from scheduler_svc.serving.backends.kvpoll import read_kv_blocks

_MAX_MESSAGE = 64 * 1024 * 1024
# How long a stopped request's stream may take to end cleanly before it is cancelled.
STOP_GRACE_S = 5.0
# Streams kept open between requests (each carries one request at a time).
IDLE_STREAMS = 32

log = structlog.get_logger("scheduler_svc.triton")


def is_engine_contract(meta: service_pb2.ModelMetadataResponse) -> bool:
    """Whether a model's metadata has TensorRT-LLM's tensor contract (token ids in and out)."""
    inputs = {(i.name, i.datatype) for i in meta.inputs}
    return inputs >= IDENTIFYING_INPUTS and {o.name for o in meta.outputs} >= IDENTIFYING_OUTPUTS


def is_text_contract(meta: service_pb2.ModelMetadataResponse) -> bool:
    """Whether a model's metadata has the ensemble's text contract (text_input and max_tokens
    in, text_output out)."""
    inputs = {(i.name, i.datatype) for i in meta.inputs}
    wanted = {("text_input", "BYTES"), ("max_tokens", "INT32")}
    return wanted <= inputs and "text_output" in {o.name for o in meta.outputs}


def _tensor(request: service_pb2.ModelInferRequest, name: str, value: npt.NDArray[Any]) -> None:
    """Input `name` of the contract, with its datatype there, as raw little-endian bytes."""
    tensor = request.inputs.add()
    tensor.name = name
    tensor.datatype = INPUTS[name].datatype
    tensor.shape.extend(value.shape)
    request.raw_input_contents.append(value.tobytes())


def _message(model: str, request_id: str) -> service_pb2.ModelInferRequest:
    """A request to `model` whose end always reaches us: asked for empty final responses, Triton
    forwards an engine's bare end flag (a stopped request's, the stop's own) instead of dropping
    it. Without it a stop's two ends never came, and the stopped row was held STOP_GRACE_S."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def build_request(model: str, inp: GenerationInput) -> service_pb2.ModelInferRequest:
    """The ModelInferRequest for one row of the `tensorrt_llm` contract."""
    request = _message(model, inp.request_id)
    ids = np.asarray([list(inp.prompt_ids)], dtype="<i4")
    _tensor(request, "input_ids", ids)
    _tensor(request, "input_lengths", np.asarray([[ids.shape[1]]], dtype="<i4"))
    _tensor(request, "request_output_len", np.asarray([[inp.max_tokens]], dtype="<i4"))
    _tensor(request, "end_id", np.asarray([[inp.end_id]], dtype="<i4"))
    _tensor(request, "pad_id", np.asarray([[inp.pad_id]], dtype="<i4"))
    _tensor(request, "streaming", np.asarray([[True]], dtype=np.bool_))
    sampling = inp.sampling
    if sampling.temperature > 0:
        # TensorRT-LLM decodes greedily when top_k and top_p are both 0: a temperature alone
        # must still sample, so it goes with the full nucleus.
        top_p = sampling.top_p if sampling.top_p > 0 else 1.0
        _tensor(request, "temperature", np.asarray([[sampling.temperature]], dtype="<f4"))
        _tensor(request, "runtime_top_k", np.asarray([[sampling.top_k]], dtype="<i4"))
        _tensor(request, "runtime_top_p", np.asarray([[top_p]], dtype="<f4"))
        _tensor(request, "random_seed", np.asarray([[sampling.seed]], dtype="<u8"))
    _word_tensors(request, [inp])
    return request


def _word_tensors(request: service_pb2.ModelInferRequest, rows: list[GenerationInput]) -> None:
    """stop_words_list and bad_words_list, when any row has words; min_length and the
    penalties, when any row sets one."""
    column = np.asarray
    if any(r.sampling.min_length for r in rows):
        _tensor(request, "min_length", column([[r.sampling.min_length] for r in rows], "<i4"))
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        default = 1.0 if name == "repetition_penalty" else 0.0
        if any(getattr(r.sampling, name) != default for r in rows):
            values = column([[getattr(r.sampling, name)] for r in rows], "<f4")
            _tensor(request, name, values)
    if any(r.stop_words for r in rows):
        _tensor(request, "stop_words_list", word_lists([r.stop_words for r in rows]))
    if any(r.bad_words for r in rows):
        _tensor(request, "bad_words_list", word_lists([r.bad_words for r in rows]))
    if any(r.return_log_probs for r in rows):
        flags = column([[r.return_log_probs] for r in rows], np.bool_)
        _tensor(request, "return_log_probs", flags)


def build_batch_request(
    model: str, request_id: str, rows: list[GenerationInput]
) -> service_pb2.ModelInferRequest:
    """One ModelInferRequest carrying every row: `input_ids` padded with each row's pad id to
    the longest prompt, `input_lengths` telling the engine where each row really ends."""
    request = _message(model, request_id)
    width = max(len(r.prompt_ids) for r in rows)
    ids = np.asarray(
        [list(r.prompt_ids) + [r.pad_id] * (width - len(r.prompt_ids)) for r in rows], dtype="<i4"
    )

    def column(values: list[Any], dtype: Any) -> npt.NDArray[Any]:
        return np.asarray([[v] for v in values], dtype=dtype)

    _tensor(request, "input_ids", ids)
    _tensor(request, "input_lengths", column([len(r.prompt_ids) for r in rows], "<i4"))
    _tensor(request, "request_output_len", column([r.max_tokens for r in rows], "<i4"))
    _tensor(request, "end_id", column([r.end_id for r in rows], "<i4"))
    _tensor(request, "pad_id", column([r.pad_id for r in rows], "<i4"))
    # Every input carries the batch dimension, `streaming` included.
    _tensor(request, "streaming", column([True] * len(rows), np.bool_))
    samplings = [r.sampling for r in rows]
    if any(s.temperature > 0 for s in samplings):
        _tensor(request, "temperature", column([s.temperature for s in samplings], "<f4"))
        _tensor(request, "runtime_top_k", column([s.top_k for s in samplings], "<i4"))
        top_p = [s.top_p if s.top_p > 0 or s.temperature == 0 else 1.0 for s in samplings]
        _tensor(request, "runtime_top_p", column(top_p, "<f4"))
        _tensor(request, "random_seed", column([s.seed for s in samplings], "<u8"))
    _word_tensors(request, rows)
    return request


# What the reader of one stream hands on: a response, the call's error, or None at its end.
_Inbound: TypeAlias = service_pb2.ModelStreamInferResponse | grpc.aio.AioRpcError | None


async def _pump(call: Any, inbox: asyncio.Queue[_Inbound]) -> None:
    try:
        async for response in call:
            inbox.put_nowait(response)
        inbox.put_nowait(None)
    except grpc.aio.AioRpcError as exc:
        inbox.put_nowait(exc)


class _Stream:
    """One `ModelStreamInfer` call that carries one request at a time. After a request's clean
    end (its final response, or a stop the engine answered) the next request goes on the same
    call: opening a call per request cost ~0.6 ms of a serial request's ~8.5 ms here."""

    def __init__(
        self, stub: service_pb2_grpc.GRPCInferenceServiceStub, tasks: set[asyncio.Task[None]]
    ) -> None:
        self.outbox: asyncio.Queue[service_pb2.ModelInferRequest | None] = asyncio.Queue()
        self.inbox: asyncio.Queue[_Inbound] = asyncio.Queue()
        self.call = stub.ModelStreamInfer(self._requests())
        # A read that is cancelled cancels the whole call inside gRPC, so the call is read by a
        # task of its own: a client that goes away cancels only its wait on `inbox`, and its
        # request can still be ended with a `stop`.
        self.reader = asyncio.create_task(_pump(self.call, self.inbox))
        tasks.add(self.reader)
        self.reader.add_done_callback(tasks.discard)

    async def _requests(self) -> AsyncIterator[service_pb2.ModelInferRequest]:
        # Our side stays open until the stream is retired (None closes it).
        while (item := await self.outbox.get()) is not None:
            yield item

    @property
    def reusable(self) -> bool:
        """Still open, with nothing left over from its last request."""
        return not self.reader.done() and self.inbox.empty()

    def close(self) -> None:
        """Close our side: Triton then ends the call."""
        self.outbox.put_nowait(None)

    def cancel(self) -> None:
        self.outbox.put_nowait(None)
        self.call.cancel()


def build_stop_request(model: str, request_id: str) -> service_pb2.ModelInferRequest:
    """TensorRT-LLM's `stop`: ends the in-flight request with the same id. The contract's
    required inputs ride along; the engine ignores them."""
    request = _message(model, request_id)
    _tensor(request, "input_ids", np.asarray([[0]], dtype="<i4"))
    _tensor(request, "input_lengths", np.asarray([[1]], dtype="<i4"))
    _tensor(request, "request_output_len", np.asarray([[1]], dtype="<i4"))
    _tensor(request, "stop", np.asarray([[True]], dtype=np.bool_))
    return request


def _output(
    response: service_pb2.ModelInferResponse, name: str, fp32: bool = False
) -> list[Any] | None:
    """An INT32 (or FP32) output's values, None when absent; a malformed one (a length that
    is not a multiple of 4, say) is BackendFailedError naming it, never a crash."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name != name:
            continue
        if index < len(response.raw_output_contents):
            raw = response.raw_output_contents[index]
            if len(raw) % 4:
                kind = "FP32" if fp32 else "INT32"
                raise BackendFailedError(
                    f"Triton sent a malformed '{name}' output ({len(raw)} bytes of {kind})"
                )
            return list(np.frombuffer(raw, dtype="<f4" if fp32 else "<i4"))
        contents = tensor.contents.fp32_contents if fp32 else tensor.contents.int_contents
        return list(contents)
    return None


def _int32s(response: service_pb2.ModelInferResponse, name: str) -> list[int] | None:
    values = _output(response, name)
    return None if values is None else [int(v) for v in values]


def batch_index(response: service_pb2.ModelInferResponse) -> int:
    """Which row of a multi-row request a response belongs to (0 when absent)."""
    values = _int32s(response, "batch_index")
    if values is None:
        return 0
    if not values:
        raise BackendFailedError("Triton sent an empty 'batch_index' output")
    return values[0]


def output_ids(response: service_pb2.ModelInferResponse) -> list[int]:
    """The generated ids in one response ([] for an empty final response)."""
    return _int32s(response, "output_ids") or []


def output_log_probs(response: service_pb2.ModelInferResponse, count: int) -> list[float]:
    """The log probabilities of a response's `count` ids (TensorRT-LLM's `output_log_probs`,
    FP32 [1, 1, n]); a missing or short one is BackendFailedError naming it."""
    values = _output(response, "output_log_probs", fp32=True)
    if values is None:
        raise BackendFailedError(
            "Triton sent no 'output_log_probs' output (return_log_probs asked)"
        )
    if len(values) < count:
        raise BackendFailedError(
            f"Triton sent {len(values)} 'output_log_probs' values for {count} ids"
        )
    # The last `count` values are this response's ids' (an engine that repeats the earlier
    # ones in a streamed response sends them first).
    return [float(v) for v in values[len(values) - count :]]


def _config_int_parameter(config: model_config_pb2.ModelConfig, key: str) -> int | None:
    param = config.parameters.get(key)
    try:
        value = int(param.string_value) if param is not None else None
    except ValueError:  # an unrendered template value such as ${max_num_tokens}
        return None
    return value if value is not None and value > 0 else None


def profile_from_config(config: model_config_pb2.ModelConfig, override: str) -> EngineProfile:
    """The profile a `tensorrt_llm` model config describes (`override`: auto, or a batching)."""
    if override != "auto":
        batching = Batching(override)
    else:
        model_type = config.parameters.get("gpt_model_type")
        static = model_type is not None and model_type.string_value.lower() == "v1"
        batching = Batching.STATIC if static else Batching.INFLIGHT
    instances = sum(group.count or 1 for group in config.instance_group) or 1
    paged_tokens = _config_int_parameter(config, "max_tokens_in_paged_kv_cache")
    per_block = _config_int_parameter(config, "tokens_per_block")
    policy = config.parameters.get("batch_scheduler_policy")
    # TensorRT-LLM's default is guaranteed_no_evict; an unfilled template value reads as it.
    allocates_as_it_goes = policy is not None and policy.string_value == "max_utilization"
    chunked = config.parameters.get("enable_chunked_context")
    chunking = config.parameters.get("context_chunking_policy")
    # TensorRT-LLM's default policy is first_come_first_served; an unfilled template value
    # (`${...}`) reads as it.
    chunk_policy = (
        chunking.string_value
        if chunking is not None and not chunking.string_value.startswith("$")
        else "first_come_first_served"
    )
    return EngineProfile(
        batching=batching,
        max_batch_size=max(1, config.max_batch_size),
        batches_at_once=instances,
        max_num_sequences=_config_int_parameter(config, "max_num_sequences"),
        max_num_tokens=_config_int_parameter(config, "max_num_tokens"),
        kv_total_blocks=paged_tokens // per_block if paged_tokens and per_block else None,
        reserves_max_tokens=not allocates_as_it_goes,
        context_chunking=(
            chunk_policy if chunked is not None and chunked.string_value.lower() == "true" else None
        ),
        **_step_cost(config),
    )


def _step_cost(config: model_config_pb2.ModelConfig) -> dict[str, Any]:
    """An emulated engine's cost profile and time scale (EngineProfile fields); nothing for a
    real engine or a profile this process cannot read."""
    timing = config.parameters.get("timing")
    name = config.parameters.get("cost_profile")
    if timing is None or timing.string_value != "emulated" or name is None:
        return {}
    scale = config.parameters.get("time_scale")
    try:
        factor = float(scale.string_value) if scale is not None else 1.0
        return {"step_cost": load_profile(name.string_value), "time_scale": factor}
    except (OSError, ValueError):
        return {}


def channel_credentials(tls: TritonTls) -> grpc.ChannelCredentials:
    """TLS (and a client certificate, where Triton asks for one) to Triton."""

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"triton.tls: cannot read {path}: {exc.strerror}") from None

    return grpc.ssl_channel_credentials(read(tls.ca_file), read(tls.key_file), read(tls.cert_file))


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    param = response.parameters.get("triton_final_response")
    return bool(param is not None and param.bool_param)


class TritonBackend:
    """A `Backend` on one Triton gRPC endpoint."""

    def __init__(self, cfg: TritonConfig) -> None:
        self.cfg = cfg
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self._idle: list[_Stream] = []  # open streams with no request on them
        self.streams_opened = 0
        self._ready = False  # the last answer Triton gave
        # The engine model: configured, or found in Triton's repository on the first check
        # that Triton answers (the default name until then).
        self.engine_model = cfg.engine_model or DEFAULT_ENGINE_MODEL
        self._found = cfg.engine_model is not None
        self._misses = 0  # readiness checks in a row that got no answer

    async def start(self) -> None:
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            # Triton is a neighbour (same pod): after a restart, reconnect within seconds.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        tls = self.cfg.tls
        if tls is None:
            self._channel = grpc.aio.insecure_channel(self.cfg.url, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.aio.secure_channel(
                self.cfg.url, channel_credentials(tls), options=options
            )
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        for stream in self._idle:
            stream.cancel()
        self._idle.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    @property
    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        if self._stub is None:
            raise RuntimeError("TritonBackend.start() was not awaited")
        return self._stub

    async def ready(self) -> bool:
        """Triton's answer (server and engine model ready). A check that gets no answer (an
        error, or none within connect_timeout_s) keeps the last answer until
        `unready_after_misses` checks in a row have missed: a Triton busy for a moment (a
        loaded host, a long step) is not an outage, and refusing its clients for it would be."""
        timeout = self.cfg.connect_timeout_s
        try:
            server = await self.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=timeout)
            ready = server.ready
            if ready and not self._found:
                await self._discover(timeout)
            if ready:
                model = await self.stub.ModelReady(
                    service_pb2.ModelReadyRequest(name=self.engine_model), timeout=timeout
                )
                ready = model.ready
        except grpc.aio.AioRpcError as exc:
            self._misses += 1
            if self._ready and self._misses < self.cfg.unready_after_misses:
                log.warning(
                    "Triton readiness check got no answer",
                    triton=self.cfg.url,
                    code=exc.code().name,
                    misses=self._misses,
                )
                return True
            self._ready = False
            return False
        self._misses = 0
        self._ready = bool(ready)
        return self._ready

    async def _discover(self, timeout: float) -> None:
        """Find the engine model: the ready model of Triton's repository with TensorRT-LLM's
        tensor contract; `tensorrt_llm` if it is one of several, else the first by name. With
        none, the default name stays (and readiness says whether Triton has it)."""
        found = await self._models_with(is_engine_contract, timeout)
        self._found = True
        if not found:
            log.warning(
                "no model with the engine contract in Triton's repository",
                triton=self.cfg.url,
                model=self.engine_model,
            )
            return
        self.engine_model = DEFAULT_ENGINE_MODEL if DEFAULT_ENGINE_MODEL in found else found[0]
        log.info(
            "engine model discovered",
            triton=self.cfg.url,
            model=self.engine_model,
            candidates=found,
        )

    async def _models_with(
        self, accepts: Callable[[service_pb2.ModelMetadataResponse], bool], timeout: float
    ) -> list[str]:
        """The ready models of Triton's repository whose metadata `accepts`, by name."""
        index = await self.stub.RepositoryIndex(
            service_pb2.RepositoryIndexRequest(ready=True), timeout=timeout
        )
        found = []
        for name in sorted({m.name for m in index.models}):
            meta = await self.stub.ModelMetadata(
                service_pb2.ModelMetadataRequest(name=name), timeout=timeout
            )
            if accepts(meta):
                found.append(name)
        return found

    async def models_with(
        self, accepts: Callable[[service_pb2.ModelMetadataResponse], bool], timeout_s: float = 600
    ) -> list[str]:
        """`_models_with`, Triton's refusal kept as TritonCallError."""
        try:
            return await self._models_with(accepts, timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise TritonCallError(exc.code(), exc.details() or "") from None

    async def health(self) -> list[tuple[str, bool]]:
        return [(self.cfg.url, await self.ready())]

    async def profile(self) -> EngineProfile:
        """The engine's profile from its model config: `gpt_model_type` (V1 is static batching;
        anything else, or nothing, in-flight), `max_batch_size`, the instance count, and the
        TensorRT-LLM parameters that bound a step and the KV pool. `triton.engine_batching`
        overrides the batching where set."""
        try:
            answer = await self.stub.ModelConfig(
                service_pb2.ModelConfigRequest(name=self.engine_model),
                timeout=self.cfg.connect_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise BackendUnavailableError(
                f"cannot read the engine's profile from {self.cfg.url}: {exc.details()}"
            ) from None
        return profile_from_config(answer.config, self.cfg.engine_batching)

    async def call(self, method: str, request: Any, timeout_s: float = 600) -> Any:
        """A KServe call passed through to Triton as it is; Triton's refusal keeps its status
        code (TritonCallError)."""
        try:
            return await getattr(self.stub, method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise TritonCallError(exc.code(), exc.details() or "") from None

    async def read_kv(self) -> tuple[int, int] | None:
        if self.cfg.metrics_url is None:
            return None
        return await read_kv_blocks(
            self.cfg.metrics_url, self.engine_model, self.cfg.connect_timeout_s
        )

    # -- the model repository (Admin passes these through) ----------------------------------

    async def repository_index(self) -> list[tuple[str, str, str, str]]:
        """(name, version, state, reason) of every model in Triton's repository."""
        try:
            index = await self.stub.RepositoryIndex(
                service_pb2.RepositoryIndexRequest(), timeout=self.cfg.connect_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise from_backend_status(exc.code(), exc.details() or "") from None
        return [(m.name, m.version, m.state, m.reason) for m in index.models]

    async def load_model(self, name: str) -> None:
        await self._repository_call(
            self.stub.RepositoryModelLoad, service_pb2.RepositoryModelLoadRequest(model_name=name)
        )

    async def unload_model(self, name: str) -> None:
        await self._repository_call(
            self.stub.RepositoryModelUnload,
            service_pb2.RepositoryModelUnloadRequest(model_name=name),
        )

    async def _repository_call(self, method: Any, request: Any) -> None:
        try:
            # Loading a large engine takes a while: allow minutes, not the readiness timeout.
            await method(request, timeout=600)
        except grpc.aio.AioRpcError as exc:
            raise from_repository_status(exc.code(), exc.details() or "") from None

    async def stream(self, request: GenerationInput) -> AsyncGenerator[Tokens, None]:
        message = build_request(self.engine_model, request)
        asked = frozenset({0}) if request.return_log_probs else frozenset()
        answers = self._responses(message, request.timeout_s, asked)
        async with contextlib.aclosing(answers) as stream:
            async for _, tokens in stream:
                yield tokens

    async def stream_batch(
        self, request_id: str, rows: list[GenerationInput], timeout_s: float | None
    ) -> AsyncGenerator[tuple[int, Tokens], None]:
        """Every row in one request; yield (row, new ids) as the engine streams them."""
        message = build_batch_request(self.engine_model, request_id, rows)
        asked = frozenset(i for i, r in enumerate(rows) if r.return_log_probs)
        answers = self._responses(message, timeout_s, asked)
        async with contextlib.aclosing(answers) as stream:
            async for row, tokens in stream:
                yield row, tokens

    def _take_stream(self) -> _Stream:
        """An idle stream that is still open, else a new one."""
        while self._idle:
            stream = self._idle.pop()
            if stream.reusable:
                return stream
            stream.cancel()
        self.streams_opened += 1
        return _Stream(self.stub, self._readers)

    def _give_back(self, stream: _Stream) -> None:
        """A stream whose request ended cleanly: kept for the next one (up to IDLE_STREAMS)."""
        if stream.reusable and len(self._idle) < IDLE_STREAMS:
            self._idle.append(stream)
        else:
            stream.close()

    async def _responses(
        self,
        message: service_pb2.ModelInferRequest,
        timeout_s: float | None,
        log_probs: frozenset[int],
    ) -> AsyncGenerator[tuple[int, Tokens], None]:
        """(row, its new ids) per response; with their log probabilities for the rows in
        `log_probs` (those that asked). Past `timeout_s` the request is stopped and ends with
        DeadlineError."""
        stream = self._take_stream()
        stream.outbox.put_nowait(message)
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        finished = False
        broken = False
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await stream.inbox.get()
                except TimeoutError:
                    raise DeadlineError("the deadline passed while Triton was generating") from None
                if isinstance(item, grpc.aio.AioRpcError):
                    broken = True
                    raise from_backend_status(item.code(), item.details() or "")
                if item is None:
                    broken = True
                    raise BackendFailedError("Triton closed the stream before the final response")
                if item.error_message:
                    finished = True  # an error is the engine's last word on a request
                    raise from_backend_message(item.error_message)
                infer = item.infer_response
                ids = output_ids(infer)
                final = is_final(infer)
                if ids:
                    row = batch_index(infer)
                    probs = output_log_probs(infer, len(ids)) if row in log_probs else None
                    yield row, Tokens(ids, probs)
                if final:
                    finished = True
                    return
        finally:
            ended_cleanly = finished
            try:
                if not finished and not broken:
                    ended_cleanly = await self._stop(stream, message.id)
            finally:
                if ended_cleanly:
                    self._give_back(stream)
                else:
                    stream.cancel()

    async def _stop(self, stream: _Stream, request_id: str) -> bool:
        """End an unfinished request with a `stop` and wait (briefly) for the engine to answer
        both it and the stopped request, so the stream carries nothing in flight. Returns
        whether it did."""
        stream.outbox.put_nowait(build_stop_request(self.engine_model, request_id))

        async def two_finals() -> bool:
            finals = 0
            while finals < 2:
                item = await stream.inbox.get()
                if item is None or isinstance(item, grpc.aio.AioRpcError):
                    return False
                if item.error_message or is_final(item.infer_response):
                    finals += 1
            return True

        try:
            return await asyncio.wait_for(two_finals(), STOP_GRACE_S)
        except TimeoutError:
            return False
