"""Triton's own `inference.GRPCInferenceService` (KServe v2) for the ensemble text contract.

A stock tritonclient program points at the sidecar instead of Triton: `text_input`, `max_tokens`,
`stream` and the optional `temperature` / `top_k` / `top_p` / `random_seed` in, `text_output` out,
unary (`ModelInfer`) or streaming (`ModelStreamInfer`, one response per text delta when `stream`
is true, the last flagged `triton_final_response`); with `return_log_probs`, each response also
carries its tokens' `output_log_probs` and the row's `cum_log_probs`. Triton's request
parameters `priority` (1 is most urgent) and `timeout` (microseconds in the queue) are honoured
here.

Over 500 lines: one servicer answers the text contract's calls, passes every other KServe call
through to Triton, and streams the replies of both contracts; the text contract itself is
ensemble.py, the engine contract's parsing kserve_engine.py, what the fronts share
presentation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import numpy as np
import structlog
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as kserve_pb
from tritonclient.grpc import service_pb2_grpc as kserve_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from scheduler_svc import __version__
from scheduler_svc.contracts.generation import Delta, GenerationParams
from scheduler_svc.errors import (
    BadRequestError,
    OverloadedError,
    RequestError,
    UnknownModelError,
    UnsupportedError,
    clip,
    grpc_status,
)
from scheduler_svc.serving.fronts.ensemble import (
    INPUTS,
    OUTPUT,
    TEXT_OUTPUTS,
    ensemble_metadata,
    params_from_inputs,
)
from scheduler_svc.serving.fronts.kserve_engine import (
    engine_batch_response,
    engine_response,
    parse_engine_request,
)
from scheduler_svc.serving.fronts.kserve_params import (
    INDEX_OUTPUTS,
    MAX_ROWS,
    add_log_probs,
    add_output,
    add_row_index,
    raw_dtype,
    request_parameter,
    route_parameters,
    typed_contents,
)
from scheduler_svc.serving.fronts.presentation import logged_internal_error, shown_pieces
from scheduler_svc.serving.fronts.status import Context
from scheduler_svc.serving.service import GenerationService, final_of

SERVICE = "inference.GRPCInferenceService"
MAX_NAME_CHARS = 256

log = structlog.get_logger("scheduler_svc.kserve")
T = TypeVar("T")


def _deserialize_bytes(raw: bytes) -> list[bytes]:
    """Triton's BYTES wire format (each element a 4-byte little-endian length, then its data),
    read by tritonclient's own codec; a length past the end is the client's error."""
    try:
        return list(deserialize_bytes_tensor(raw))
    except struct.error:
        raise BadRequestError("text_input: truncated BYTES tensor") from None


def _serialize_bytes(items: list[bytes]) -> bytes:
    if not items:
        return b""
    encoded = serialize_byte_tensor(np.array(items, dtype=np.object_))
    return bytes(encoded.item())


def _values(
    request: kserve_pb.ModelInferRequest,
    index: int,
    tensor: kserve_pb.ModelInferRequest.InferInputTensor,
) -> list[object]:
    name, spec = tensor.name, INPUTS[tensor.name]
    if index < len(request.raw_input_contents):
        raw = request.raw_input_contents[index]
        if spec.datatype == "BYTES":
            return list(_deserialize_bytes(raw))
        try:
            return list(np.frombuffer(raw, dtype=raw_dtype(spec.datatype)).tolist())
        except ValueError:
            raise BadRequestError(
                f"{name}: {len(raw)} bytes do not hold {spec.datatype} values"
            ) from None
    return typed_contents(tensor, spec.datatype)


def parse_infer_request(
    request: kserve_pb.ModelInferRequest, model: str, time_remaining_s: float | None
) -> tuple[list[GenerationParams], bool]:
    """The generation parameters of each row of a text-contract request ([N, 1] tensors, N
    rows; a [1, 1] tensor applies to every row), and whether it streams."""
    if request.model_name != model:
        raise UnknownModelError(
            f"model {clip(request.model_name)} is not served here (try '{model}')"
        )
    columns: dict[str, list[object]] = {}
    rows = 1
    for index, tensor in enumerate(request.inputs):
        spec = INPUTS.get(tensor.name)
        if spec is None:
            raise BadRequestError(f"unknown input {clip(tensor.name)} for model '{model}'")
        if tensor.datatype != spec.datatype:
            raise BadRequestError(
                f"input '{tensor.name}' has data type {tensor.datatype[:32]}, expected "
                f"{spec.datatype}"
            )
        shape = list(tensor.shape)
        if len(shape) != 2 or not 1 <= shape[0] <= MAX_ROWS or (shape[1] != 1 and not spec.words):
            want = "[rows, n] words" if spec.words else "[rows, 1]"
            raise BadRequestError(
                f"input '{tensor.name}' has shape {shape[:4]}: expected {want}, at most "
                f"{MAX_ROWS} rows"
            )
        items = _values(request, index, tensor)
        if len(items) != shape[0] * shape[1]:
            raise BadRequestError(
                f"input '{tensor.name}': {len(items)} values do not fill shape {shape}"
            )
        width = shape[1]
        columns[tensor.name] = (
            [items[r * width : (r + 1) * width] for r in range(shape[0])] if spec.words else items
        )
        if tensor.name == "text_input":
            rows = shape[0]
    for name, column in columns.items():
        if len(column) not in (1, rows):
            raise BadRequestError(
                f"input '{name}' has {len(column)} rows; text_input has {rows} (or give 1)"
            )
    for output in request.outputs:
        if output.name not in TEXT_OUTPUTS:
            raise BadRequestError(
                f"unknown output {clip(output.name)} (this model has {TEXT_OUTPUTS})"
            )
    timeout_us = request_parameter(request, "timeout")
    priority = request_parameter(request, "priority")
    session, precision = route_parameters(request)
    params = [
        replace(
            params_from_inputs(
                {name: column[r if len(column) > 1 else 0] for name, column in columns.items()},
                request.id,
                priority,
                timeout_us,
                time_remaining_s,
            ),
            session=session,
            precision=precision,
        )
        for r in range(rows)
    ]
    stream = columns.get("stream", [False])
    return params, bool(stream[0])


def _response(
    request: kserve_pb.ModelInferRequest,
    texts: list[str],
    final: bool | None = None,
    row: int | None = None,
    log_probs: list[tuple[float, ...] | None] | None = None,
    cums: list[float] | None = None,
) -> kserve_pb.ModelInferResponse:
    """text_output [rows, 1]; the log-probability outputs where a row asked; with `row`, one
    row's answer and its batch_index, as Triton streams the rows of a batched request."""
    response = kserve_pb.ModelInferResponse(
        model_name=request.model_name, model_version="1", id=request.id
    )
    encoded = _serialize_bytes([t.encode("utf-8") for t in texts])
    add_output(response, OUTPUT, "BYTES", [len(texts), 1], encoded)
    if log_probs is not None:
        add_log_probs(response, log_probs, cums or [0.0] * len(texts))
    if row is not None:
        add_row_index(response, row)
    if final is not None:
        response.parameters["triton_final_response"].bool_param = final
    return response


class TritonCalls(Protocol):
    """Where calls the sidecar does not answer itself go: Triton (SidecarControls)."""

    async def triton_call(self, method: str, request: Any, every: bool = False) -> Any: ...


# Triton extensions a client can use through the sidecar; shared memory is not one of them.
_NOT_THROUGH_THE_SIDECAR = ("shared_memory",)
_NO_SHARED_MEMORY = (
    "shared memory is not available through the sidecar: it cannot see the client's memory "
    "(send the tensors in the request)"
)


class KServeFront(kserve_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The ensemble text contract is served here; the rest of Triton's service (repository,
    statistics, trace and log settings, other models' metadata) passes through to Triton."""

    def __init__(self, service: GenerationService, triton: TritonCalls | None = None) -> None:
        self.service = service
        self.triton = triton

    @property
    def engine_model(self) -> str:
        return self.service.engine_model

    @property
    def model(self) -> str:
        return self.service.text_model

    async def _through(self, method: str, request: Any, every: bool = False) -> Any:
        if self.triton is None:
            raise UnsupportedError(f"{method}: no Triton behind this sidecar to pass it to")
        return await self.triton.triton_call(method, request, every)

    def _ready(self) -> bool:
        return self.service.backend_ready and not self.service.draining

    # -- health and metadata -----------------------------------------------------------------

    async def ServerLive(
        self, request: kserve_pb.ServerLiveRequest, context: Context
    ) -> kserve_pb.ServerLiveResponse:
        return kserve_pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: kserve_pb.ServerReadyRequest, context: Context
    ) -> kserve_pb.ServerReadyResponse:
        return kserve_pb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(
        self, request: kserve_pb.ModelReadyRequest, context: Context
    ) -> kserve_pb.ModelReadyResponse:
        if request.name != self.model:
            return await self._through("ModelReady", request)
        return kserve_pb.ModelReadyResponse(ready=self._ready())

    async def ServerMetadata(
        self, request: kserve_pb.ServerMetadataRequest, context: Context
    ) -> kserve_pb.ServerMetadataResponse:
        """Our name and version; Triton's extensions, less those that cannot work through a
        sidecar (shared memory)."""
        extensions: list[str] = []
        if self.triton is not None and self.service.backend_ready:
            with contextlib.suppress(RequestError):
                triton = await self._through("ServerMetadata", request)
                extensions = [
                    e
                    for e in triton.extensions
                    if not any(word in e for word in _NOT_THROUGH_THE_SIDECAR)
                ]
        return kserve_pb.ServerMetadataResponse(
            name="scheduler_svc", version=__version__, extensions=extensions
        )

    async def ModelMetadata(
        self, request: kserve_pb.ModelMetadataRequest, context: Context
    ) -> kserve_pb.ModelMetadataResponse:
        if request.name != self.model:
            return await self._through("ModelMetadata", request)
        return json_format.ParseDict(
            ensemble_metadata(self.model), kserve_pb.ModelMetadataResponse()
        )

    async def ModelConfig(
        self, request: kserve_pb.ModelConfigRequest, context: Context
    ) -> kserve_pb.ModelConfigResponse:
        if request.name != self.model:
            return await self._through("ModelConfig", request)
        config = mc.ModelConfig(name=self.model, platform="ensemble", max_batch_size=MAX_ROWS)
        for name, spec in INPUTS.items():
            config.input.add(
                name=name,
                data_type=spec.config_type,
                dims=[-1 if spec.words else 1],
                optional=spec.optional,
            )
        config.output.add(name=OUTPUT, data_type=mc.TYPE_STRING, dims=[-1])
        config.output.add(name="cum_log_probs", data_type=mc.TYPE_FP32, dims=[-1])
        config.output.add(name="output_log_probs", data_type=mc.TYPE_FP32, dims=[-1, -1])
        for name in INDEX_OUTPUTS:
            config.output.add(name=name, data_type=mc.TYPE_INT32, dims=[1])
        config.model_transaction_policy.decoupled = True
        return kserve_pb.ModelConfigResponse(config=config)

    # -- passed through to Triton ------------------------------------------------------------

    async def ModelStatistics(
        self, request: kserve_pb.ModelStatisticsRequest, context: Context
    ) -> kserve_pb.ModelStatisticsResponse:
        return await self._through("ModelStatistics", request)

    async def RepositoryIndex(
        self, request: kserve_pb.RepositoryIndexRequest, context: Context
    ) -> kserve_pb.RepositoryIndexResponse:
        return await self._through("RepositoryIndex", request)

    async def RepositoryModelLoad(
        self, request: kserve_pb.RepositoryModelLoadRequest, context: Context
    ) -> kserve_pb.RepositoryModelLoadResponse:
        return await self._through("RepositoryModelLoad", request, every=True)

    async def RepositoryModelUnload(
        self, request: kserve_pb.RepositoryModelUnloadRequest, context: Context
    ) -> kserve_pb.RepositoryModelUnloadResponse:
        return await self._through("RepositoryModelUnload", request, every=True)

    async def TraceSetting(
        self, request: kserve_pb.TraceSettingRequest, context: Context
    ) -> kserve_pb.TraceSettingResponse:
        return await self._through("TraceSetting", request)

    async def LogSettings(
        self, request: kserve_pb.LogSettingsRequest, context: Context
    ) -> kserve_pb.LogSettingsResponse:
        return await self._through("LogSettings", request)

    async def _no_shared_memory(self, request: Any, context: Context) -> Any:
        raise UnsupportedError(_NO_SHARED_MEMORY)

    SystemSharedMemoryStatus = SystemSharedMemoryRegister = _no_shared_memory
    SystemSharedMemoryUnregister = CudaSharedMemoryStatus = _no_shared_memory
    CudaSharedMemoryRegister = CudaSharedMemoryUnregister = _no_shared_memory

    # -- inference ---------------------------------------------------------------------------

    def _is_engine(self, request: kserve_pb.ModelInferRequest) -> bool:
        """A request for the engine model itself (token ids): scheduled through the same path."""
        name = str(request.model_name)
        return name == self.engine_model and name != self.model

    def _check_version(self, request: kserve_pb.ModelInferRequest) -> None:
        if request.model_version not in ("", "1"):
            raise UnknownModelError(
                f"model {clip(request.model_name)} version {clip(request.model_version)} is "
                "not served here (version 1 is)"
            )

    async def ModelInfer(
        self, request: kserve_pb.ModelInferRequest, context: Context
    ) -> kserve_pb.ModelInferResponse:
        """Every row scheduled on its own, side by side; one answer with every row."""
        self._check_version(request)
        if self._is_engine(request):
            rows, _ = parse_engine_request(request, context.time_remaining())
            finals = await _side_by_side([self.service.answer(params) for params in rows])
            return engine_batch_response(request, finals, self.service.cfg.model.pad_id)
        rows, _ = parse_infer_request(request, self.model, context.time_remaining())
        finals = await _side_by_side([self.service.answer(params) for params in rows])
        asked = any(f.log_probs is not None for f in finals)
        return _response(
            request,
            [f.text for f in finals],
            log_probs=[f.log_probs for f in finals] if asked else None,
            cums=[sum(f.log_probs or ()) for f in finals],
        )

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[kserve_pb.ModelInferRequest],
        context: Context,
    ) -> AsyncIterator[kserve_pb.ModelStreamInferResponse]:
        """Requests on one stream run side by side. Each gets exactly one final answer or one
        error carrying its id. At most `server.max_stream_requests` are unanswered at once (one
        more is refused in-band); answers wait in a bounded buffer, so a client that stops
        reading holds up its own requests only. A malformed message ends the stream
        INVALID_ARGUMENT once the requests already in it are answered."""
        cap = self.service.cfg.server.max_stream_requests
        out: asyncio.Queue[kserve_pb.ModelStreamInferResponse | None] = asyncio.Queue(
            maxsize=2 * cap
        )
        tasks: set[asyncio.Task[None]] = set()
        broken: list[RequestError] = []

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if len(tasks) >= cap:
                        await out.put(
                            _stream_error(
                                request,
                                OverloadedError(
                                    f"{cap} requests are unanswered on this stream "
                                    "(server.max_stream_requests); wait for one or open "
                                    "another stream",
                                    0.1,
                                ),
                            )
                        )
                        continue
                    task = asyncio.create_task(self._one_streamed(request, out, context))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            except RequestError as exc:  # a malformed message: no more requests from here
                broken.append(exc)
            finally:
                while tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
                await out.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await out.get()) is not None:
                yield item
            if broken:
                raise broken[0]
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _one_streamed(
        self,
        request: kserve_pb.ModelInferRequest,
        out: asyncio.Queue[kserve_pb.ModelStreamInferResponse | None],
        context: Context,
    ) -> None:
        """One request of a stream: its rows scheduled side by side. A batched request's
        responses carry batch_index; the very last one is flagged final. One row's error ends
        the request with that error, and its other rows are cancelled."""
        try:
            self._check_version(request)
            engine = self._is_engine(request)
            if engine:
                rows, stream = parse_engine_request(request, context.time_remaining())
            else:
                rows, stream = parse_infer_request(request, self.model, context.time_remaining())
            left = [len(rows)]
            row = (lambda r: r) if len(rows) > 1 else (lambda r: None)
            streamed = self._engine_row_streamed if engine else self._row_streamed
            await _side_by_side(
                [
                    streamed(request, params, stream, row(r), left, out)
                    for r, params in enumerate(rows)
                ]
            )
        except RequestError as exc:
            await out.put(_stream_error(request, exc))
        except Exception as exc:  # a bug: this request still gets its one answer
            metrics = self.service.loop.metrics
            error = logged_internal_error(
                log, exc, metrics, "ModelStreamInfer", method="ModelStreamInfer"
            )
            await out.put(_stream_error(request, error))

    async def _engine_row_streamed(
        self,
        request: kserve_pb.ModelInferRequest,
        params: GenerationParams,
        stream: bool,
        row: int | None,
        left: list[int],
        out: asyncio.Queue[kserve_pb.ModelStreamInferResponse | None],
    ) -> None:
        """One row of an engine-contract request: new token ids per response when streaming,
        else all of them at the end."""

        def answer(piece: Delta, cum: float, final: bool) -> kserve_pb.ModelStreamInferResponse:
            response = engine_response(request, piece, cum, final, row)
            return kserve_pb.ModelStreamInferResponse(infer_response=response)

        await self._stream_row(params, stream, left, out, answer, lambda p: bool(p.token_ids))

    async def _row_streamed(
        self,
        request: kserve_pb.ModelInferRequest,
        params: GenerationParams,
        stream: bool,
        row: int | None,
        left: list[int],
        out: asyncio.Queue[kserve_pb.ModelStreamInferResponse | None],
    ) -> None:
        """One row of a text request: a response per text delta when streaming, else one."""

        def answer(piece: Delta, cum: float, final: bool) -> kserve_pb.ModelStreamInferResponse:
            probs: list[tuple[float, ...] | None] = [piece.log_probs]
            asked = piece.log_probs is not None
            response = _response(request, [piece.text], final, row, probs if asked else None, [cum])
            return kserve_pb.ModelStreamInferResponse(infer_response=response)

        await self._stream_row(params, stream, left, out, answer, lambda p: bool(p.text))

    async def _stream_row(
        self,
        params: GenerationParams,
        stream: bool,
        left: list[int],
        out: asyncio.Queue[kserve_pb.ModelStreamInferResponse | None],
        answer: Callable[[Delta, float, bool], kserve_pb.ModelStreamInferResponse],
        shows: Callable[[Delta], bool],
    ) -> None:
        """Generate one row and answer it: each piece that `shows` something as it comes, the
        row's last piece (the engine said no token follows) held and flagged final with the end,
        as Triton flags the response that carries the last token; or the whole row at the end.
        A delta that shows nothing (ids whose text is not complete yet) rides with the next
        one, so every token's log probability goes out exactly once."""
        async with contextlib.aclosing(self.service.generate(params)) as events:
            if not stream:
                final = await final_of(events)
                left[0] -= 1
                whole = Delta(final.text, final.token_ids, final.log_probs)
                await out.put(answer(whole, sum(whole.log_probs or ()), left[0] == 0))
                return
            held: Delta | None = None  # the last piece, once it came
            cum = 0.0  # the row's log probabilities so far, up to the held piece
            async for piece in shown_pieces(events, shows):
                if isinstance(piece, Delta):
                    if held is not None or piece.last:
                        held = piece if held is None else held + piece
                        continue
                    cum += sum(piece.log_probs or ())
                    await out.put(answer(piece, cum, False))
                    continue
                left[0] -= 1
                last = (held or Delta()) + piece.leftover
                cum += sum(last.log_probs or ())
                await out.put(answer(last, cum, left[0] == 0))


async def _side_by_side(work: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run every row at once; the first failure cancels the others and is raised as it is."""
    tasks = [asyncio.create_task(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _stream_error(
    request: kserve_pb.ModelInferRequest, error: RequestError
) -> kserve_pb.ModelStreamInferResponse:
    """An in-band error for one request of a stream, carrying its id (and status code name)."""
    return kserve_pb.ModelStreamInferResponse(
        error_message=f"[{grpc_status(error).name}] {error}",
        infer_response=kserve_pb.ModelInferResponse(
            model_name=request.model_name[:MAX_NAME_CHARS], model_version="1", id=request.id
        ),
    )
