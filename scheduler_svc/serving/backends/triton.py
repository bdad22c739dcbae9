"""The Triton adapter: TensorRT-LLM's `tensorrt_llm` contract over Triton's gRPC stream API.

Every request goes out with `streaming=true` on a `ModelStreamInfer` call that carries only it,
so tokens come back as the engine makes them; a call whose request ended cleanly is kept open
for the next one (no call set-up per request). A request the sidecar no longer wants (client
gone, stop string, past its deadline) is ended the way TensorRT-LLM's own clients end one: a
`stop` request with the same id on the same stream, the call reused once the engine has answered
both; only a stream that stays silent is cancelled outright. Either way the engine frees the
request's KV blocks. Errors become the sidecar's error types here and nowhere else.

The messages themselves (requests built, responses and model configs read) are codec.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import structlog
from tritonclient.grpc import service_pb2, service_pb2_grpc

from scheduler_svc.config import TritonConfig, TritonTls
from scheduler_svc.core.engine import EngineProfile
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
from scheduler_svc.serving.backends.base import DEFAULT_ENGINE_MODEL, GenerationInput, Tokens
from scheduler_svc.serving.backends.codec import (
    batch_index,
    build_batch_request,
    build_request,
    build_stop_request,
    is_engine_contract,
    is_final,
    output_ids,
    output_log_probs,
    profile_from_config,
)
from scheduler_svc.serving.backends.kvpoll import read_kv_blocks

_MAX_MESSAGE = 64 * 1024 * 1024
# How long a stopped request's stream may take to end cleanly before it is cancelled.
STOP_GRACE_S = 5.0
# Streams kept open between requests (each carries one request at a time).
IDLE_STREAMS = 32

log = structlog.get_logger("scheduler_svc.triton")


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
                    yield row, Tokens(ids, probs, last=final)
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
