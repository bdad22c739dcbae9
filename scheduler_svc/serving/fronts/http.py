"""The HTTP fronts: OpenAI-compatible /v1 and Triton's generate extension (/v2).

Both run on the sidecar's event loop (aiohttp) and hand every request to the one
`GenerationService`, with the same validation, lanes, credentials and quotas as the gRPC
fronts. Bodies are bounded in size (`server.max_message_bytes`, 413 beyond) and in time
(`server.read_timeout_s`, 408 beyond); a streamed answer is
written through the response's drain, so a slow reader holds up only its own request, and one
that reads nothing for `server.write_timeout_s` is cut off. A client that disconnects cancels
its handler: the request leaves the queue or is cancelled inside Triton.

A streamed answer starts only once the first text is ready, so a refusal still gets its HTTP
status (400 / 401 / 404 / 429 with Retry-After / 503 ...); an error after that comes in-band
as a last `data: {"error": ...}` event.

Over 500 lines: the aiohttp server, its error answers and both route families (OpenAI and
Triton's generate extension) live here; what the fronts share is presentation.py, the OpenAI
shapes openai.py, the ensemble's metadata kserve.py. The generate routes could be a module of
their own next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import ssl
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import structlog
from aiohttp import web

from scheduler_svc import __version__
from scheduler_svc.contracts.generation import Delta, Final, GenerationParams
from scheduler_svc.core.types import Urgency
from scheduler_svc.errors import (
    BadRequestError,
    PermissionDeniedError,
    RequestError,
    UnauthenticatedError,
    UnknownModelError,
    clip,
    grpc_status,
    http_status,
)
from scheduler_svc.serving import auth
from scheduler_svc.serving.chat import ChatTemplate
from scheduler_svc.serving.fronts import openai
from scheduler_svc.serving.fronts.ensemble import (
    INPUTS,
    OUTPUT,
    ensemble_metadata,
    params_from_inputs,
)
from scheduler_svc.serving.fronts.guard import Identity, admit
from scheduler_svc.serving.fronts.presentation import logged_internal_error, shown_pieces
from scheduler_svc.serving.service import GenerationService, final_of

log = structlog.get_logger("scheduler_svc.http")

# Probes carry no credential: liveness and readiness are open, as on the gRPC health service.
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# What an OpenAI error's `type` says, by HTTP status.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    501: "not_implemented",
    503: "service_unavailable",
    504: "timeout",
}
_PYTHON_TYPES = {"BYTES": (str,), "INT32": (int,), "UINT64": (int,), "FP32": (int, float)}
_INT_RANGES = {"INT32": (-(2**31), 2**31), "UINT64": (0, 2**64)}


class _HttpRefusedError(Exception):
    """An HTTP-level refusal (no route, wrong method, body too large) in our error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _peer_names(request: web.Request) -> list[str]:
    """The client certificate's common names and DNS / URI subject alternative names."""
    transport = request.transport
    cert = transport.get_extra_info("peercert") if transport is not None else None
    if not cert:
        return []
    names = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    names += [v for k, v in cert.get("subjectAltName", ()) if k in ("DNS", "URI")]
    return names


def _route(request: web.Request) -> str:
    """The matched route's pattern (a bounded metric label), never the client's path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _retry_headers(error: RequestError) -> dict[str, str]:
    if error.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}


def _param(message: str) -> str | None:
    """The field an error message names (`field: what is wrong`), for OpenAI's `param`."""
    head, sep, _ = message.partition(":")
    return head if sep and head.replace("_", "").replace(".", "").isalnum() else None


def openai_error(status: int, message: str, code: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _OPENAI_TYPES.get(status, "server_error"),
            "param": _param(message),
            "code": code,
        }
    }


def _error_body(path: str, status: int, message: str, code: str) -> dict[str, Any]:
    """OpenAI's error object on /v1, Triton's `{"error": message}` elsewhere."""
    if path.startswith("/v1/"):
        return openai_error(status, message, code)
    return {"error": message}


def _json_response(
    body: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(body, status=status, headers=headers, dumps=_dumps)


def _dumps(payload: object) -> str:
    return json.dumps(payload, ensure_ascii=False)


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "scheduler_svc"  # not the library and Python versions


def _sse(payload: object) -> bytes:
    text = payload if isinstance(payload, str) else _dumps(payload)
    return f"data: {text}\n\n".encode()


class HttpFront:
    def __init__(
        self,
        service: GenerationService,
        identity: Callable[[], Identity],
        chat: ChatTemplate,
    ) -> None:
        self.service = service
        self.cfg = service.cfg
        self.identity = identity
        self.chat = chat
        self.metrics = service.loop.metrics
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def model(self) -> str:
        return self.service.text_model

    # -- the listener ------------------------------------------------------------------------

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self.cfg.server.max_message_bytes, middlewares=[self._guard]
        )
        app.on_response_prepare.append(_server_header)
        route = app.router
        route.add_get("/v1/models", self.list_models)
        route.add_get("/v1/models/{model}", self.get_model)
        route.add_post("/v1/completions", self.completions)
        route.add_post("/v1/chat/completions", self.chat_completions)
        route.add_get("/v2", self.server_metadata)
        route.add_get("/v2/health/live", self.live)
        route.add_get("/v2/health/ready", self.ready)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            route.add_get(base, self.model_metadata)
            route.add_get(f"{base}/ready", self.model_ready)
            route.add_post(f"{base}/generate", self.generate)
            route.add_post(f"{base}/generate_stream", self.generate_stream)
        return app

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        # The drain has answered every request before the listener closes; what is still
        # open then (a slow reader's last bytes) gets a second.
        self._runner = web.AppRunner(
            self.application(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls)
        await site.start()
        address = self._runner.addresses[0]
        self.port = int(address[1])
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- every request -----------------------------------------------------------------------

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        path = request.path
        try:
            try:
                if path not in OPEN_PATHS:
                    principal = self.identity().identify_by(
                        request.headers.get("Authorization"), lambda: _peer_names(request)
                    )
                    auth.CURRENT.set(admit(principal, auth.CLIENT, f"{request.method} {path}"))
                return await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                raise _HttpRefusedError(exc.status, self._http_reason(exc, request)) from None
        except RequestError as exc:
            if isinstance(exc, UnauthenticatedError | PermissionDeniedError):
                self.metrics.refused_calls.labels(grpc_status(exc).name).inc()
            status = http_status(exc)
            body = _error_body(path, status, str(exc), exc.type)
            return _json_response(body, status=status, headers=_retry_headers(exc))
        except _HttpRefusedError as exc:
            body = _error_body(path, exc.status, str(exc), "http_" + str(exc.status))
            return _json_response(body, status=exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            where = f"HTTP {_route(request)}"
            error = logged_internal_error(log, exc, self.metrics, where, path=path)
            return _json_response(_error_body(path, 500, str(error), error.type), status=500)

    def _http_reason(self, exc: web.HTTPException, request: web.Request) -> str:
        if exc.status == 404:
            return f"no such endpoint: {request.method} {clip(request.path)}"
        if exc.status == 405:
            return f"{request.method} is not allowed on {clip(request.path)}"
        if exc.status == 413:
            limit = self.cfg.server.max_message_bytes
            return f"the request body is larger than {limit} bytes (server.max_message_bytes)"
        return exc.reason

    async def _json(self, request: web.Request) -> object:
        limit = self.cfg.server.read_timeout_s
        try:
            async with asyncio.timeout(limit):
                raw = await request.read()  # bounded by client_max_size: 413 beyond
        except TimeoutError:
            raise _HttpRefusedError(
                408, f"the request body did not arrive within {limit:g} s (server.read_timeout_s)"
            ) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequestError(f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise BadRequestError("the body is not valid JSON: nested too deeply") from None

    def _request_id(self, request: web.Request) -> str:
        return request.headers.get("x-request-id", "") or uuid.uuid4().hex

    def _objective(self, request: web.Request) -> Urgency | None:
        name = request.headers.get(self.cfg.http.objective_header)
        if name is None:
            return None
        objectives = self.cfg.http.objectives
        if name not in objectives:
            known = ", ".join(sorted(objectives))
            raise BadRequestError(
                f"{self.cfg.http.objective_header}: {clip(name)} is not a known objective ({known})"
            )
        return Urgency[objectives[name].upper()]

    async def _answer(
        self,
        request: web.Request,
        params: GenerationParams,
        shape: Callable[[AsyncIterator[Delta | Final]], AsyncGenerator[object, None]],
        stream: bool,
        done: str | None,
    ) -> web.StreamResponse:
        """Run one generation and answer: one JSON object, or server-sent events of what
        `shape` makes of the events (ended by `done` when set)."""
        async with (
            contextlib.aclosing(self.service.generate(params)) as events,
            contextlib.aclosing(shape(events)) as answers,
        ):
            first = await anext(answers)  # a refusal here is still an HTTP status
            headers = {"X-Request-Id": params.request_id}
            if not stream:
                return _json_response(first, headers=headers)
            response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
            await response.prepare(request)
            try:
                await self._send(request, response, _sse(first))
                async for answer in answers:
                    await self._send(request, response, _sse(answer))
            except RequestError as exc:
                await self._send(request, response, _sse(self._inband(request, exc)))
            except ConnectionResetError:
                return response  # the client left: closing `events` cancels the request
            if done is not None:
                await self._send(request, response, _sse(done))
            await response.write_eof()
            return response

    def _inband(self, request: web.Request, error: RequestError) -> dict[str, Any]:
        return _error_body(request.path, http_status(error), str(error), error.type)

    async def _send(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """Write and wait for the transport to drain; a reader that takes nothing for
        write_timeout_s is cut off (its request is cancelled when the handler ends)."""
        limit = self.cfg.server.write_timeout_s
        try:
            async with asyncio.timeout(limit):  # no task per chunk, as wait_for makes on 3.11
                await response.write(data)
        except TimeoutError:
            log.warning("slow reader cut off", path=request.path, write_timeout_s=limit)
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("slow reader") from None

    # -- OpenAI ------------------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        return _json_response(openai.models_list(self.model))

    async def get_model(self, request: web.Request) -> web.Response:
        openai.check_model(request.match_info["model"], self.model)
        return _json_response(openai.models_list(self.model)["data"][0])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = openai.parse(openai.CompletionBody, await self._json(request))
        return await self._openai(request, body, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = openai.parse(openai.ChatBody, await self._json(request))
        return await self._openai(request, body, chat=True)

    def _routed(self, request: web.Request, params: GenerationParams) -> GenerationParams:
        """The session and precision headers, where given (backend groups route by them)."""
        cfg = self.cfg.http
        session = request.headers.get(cfg.session_header, "")
        precision = request.headers.get(cfg.precision_header, "")
        if session or precision:
            return replace(params, session=session or params.session, precision=precision)
        return params

    async def _openai(
        self, request: web.Request, body: openai.CompletionBody | openai.ChatBody, chat: bool
    ) -> web.StreamResponse:
        request_id = self._request_id(request)
        tenant = request.headers.get(self.cfg.http.tenant_header, "")
        params = openai.params_of(
            body, self.model, request_id, self._objective(request), tenant, self.chat
        )
        params = self._routed(request, params)
        answer = openai.Answer(chat, request_id, self.model)
        usage = body.stream_options is not None and body.stream_options.include_usage

        async def whole(events: AsyncIterator[Delta | Final]) -> AsyncGenerator[object, None]:
            yield answer.whole(await final_of(events))

        async def chunks(events: AsyncIterator[Delta | Final]) -> AsyncGenerator[object, None]:
            async for piece in shown_pieces(events):
                if isinstance(piece, Delta):
                    yield answer.chunk(piece, usage)
                    continue
                if piece.leftover.token_ids:  # their log probabilities still go out
                    yield answer.chunk(piece.leftover, usage)
                yield answer.chunk(piece.final, usage)
                if usage:
                    yield answer.usage_chunk(piece.final)

        if body.stream:
            return await self._answer(request, params, chunks, True, "[DONE]")
        return await self._answer(request, params, whole, False, None)

    # -- Triton's generate extension and health ----------------------------------------------

    def _check_model(self, request: web.Request) -> None:
        model = request.match_info["model"]
        version = request.match_info.get("version", "1")
        if model != self.model or version not in ("", "1"):
            raise UnknownModelError(
                f"Request for unknown model: '{clip(model)}' version {clip(version)} is not "
                f"found (this server serves '{self.model}' version 1)"
            )

    def _ready_now(self) -> bool:
        return self.service.backend_ready and not self.service.draining

    async def live(self, request: web.Request) -> web.Response:
        return _json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self._ready_now()
        return _json_response({"ready": ready}, status=200 if ready else 503)

    async def model_ready(self, request: web.Request) -> web.Response:
        self._check_model(request)
        ready = self._ready_now()
        return _json_response({"ready": ready}, status=200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json_response(
            {"name": "scheduler_svc", "version": __version__, "extensions": ["generate"]}
        )

    async def model_metadata(self, request: web.Request) -> web.Response:
        self._check_model(request)
        return _json_response(ensemble_metadata(self.model))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, streamed=False)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, streamed=True)

    async def _generate(self, request: web.Request, streamed: bool) -> web.StreamResponse:
        """One request: its inputs as the body's keys (a value or a one-element list), and
        Triton's request `parameters` (`priority`, `timeout` in microseconds)."""
        self._check_model(request)
        body = await self._json(request)
        if not isinstance(body, dict):
            raise BadRequestError("the body must be a JSON object of input names and values")
        values, accumulate, priority, timeout_us = _generate_inputs(body)
        params = params_from_inputs(values, self._request_id(request), priority, timeout_us, None)
        objective = self._objective(request)
        tenant = request.headers.get(self.cfg.http.tenant_header, "")
        params = self._routed(request, _with(params, objective, tenant))
        stream = bool(values.get("stream", False)) and streamed

        cum = [0.0]  # the log probabilities so far

        def response(text: str, log_probs: tuple[float, ...] | None) -> dict[str, Any]:
            out: dict[str, Any] = {"model_name": self.model, "model_version": "1", OUTPUT: text}
            if log_probs is not None:
                # As Triton's generate answers an FP32 tensor: one value bare, more as a list.
                cum[0] += sum(log_probs)
                out["cum_log_probs"] = cum[0]
                out["output_log_probs"] = log_probs[0] if len(log_probs) == 1 else list(log_probs)
            return out

        async def shape(events: AsyncIterator[Delta | Final]) -> AsyncGenerator[object, None]:
            """One response with the whole text; or, streaming, one per text delta (the
            text so far with accumulate_tokens), and one empty response if there was none. A
            delta with no text yet passes its log probabilities on to the next response."""
            if not stream:
                final = await final_of(events)
                yield response(final.text, final.log_probs)
                return
            shown = ""
            async for piece in shown_pieces(events):
                if isinstance(piece, Delta):
                    shown += piece.text
                    yield response(shown if accumulate else piece.text, piece.log_probs)
                elif not shown or piece.leftover.log_probs:
                    yield response("", piece.leftover.log_probs)

        return await self._answer(request, params, shape, streamed, None)


def _generate_inputs(
    body: dict[str, Any],
) -> tuple[dict[str, object], bool, int | None, int | None]:
    """The ensemble inputs of a generate body, checked against INPUTS; `accumulate_tokens`
    (tensorrt_llm_bls's: each streamed text is the whole text so far); the parameters."""
    values: dict[str, object] = {}
    accumulate = False
    priority = timeout_us = None
    for name, raw in body.items():
        if name == "parameters":
            if not isinstance(raw, dict):
                raise BadRequestError("parameters: expected an object")
            priority = _request_int_parameter(raw, "priority")
            timeout_us = _request_int_parameter(raw, "timeout")
            unknown = set(raw) - {"priority", "timeout"}
            if unknown:
                raise BadRequestError(
                    f"parameters: {clip(sorted(unknown)[0])} is not a parameter this server "
                    "honours (priority, timeout)"
                )
            continue
        spec = INPUTS.get(name)
        if spec is not None and spec.words:  # a word or a list of words
            words = raw if isinstance(raw, list) else [raw]
            if not all(isinstance(w, str) for w in words):
                raise BadRequestError(f"{name}: expected a word or a list of words (text)")
            values[name] = words
            continue
        value = raw[0] if isinstance(raw, list) and len(raw) == 1 else raw
        if name == "accumulate_tokens":
            if not isinstance(value, bool):
                raise BadRequestError("accumulate_tokens: expected true or false")
            accumulate = value
            continue
        spec = INPUTS.get(name)
        if spec is None:
            known = ", ".join(INPUTS)
            raise BadRequestError(f"{clip(name)}: unknown input (this model has {known})")
        if isinstance(value, list):
            raise BadRequestError(f"{name}: one value per request, got a list of {len(value)}")
        if not _fits(spec.datatype, value):
            raise BadRequestError(
                f"{name}: expected a {spec.datatype} value, got {clip(repr(value))}"
            )
        values[name] = value
    return values, accumulate, priority, timeout_us


def _fits(datatype: str, value: object) -> bool:
    if datatype == "BOOL":
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, _PYTHON_TYPES[datatype]):
        return False
    low, high = _INT_RANGES.get(datatype, (None, None))
    return low is None or low <= value < high  # type: ignore[operator]


def _request_int_parameter(parameters: dict[str, Any], key: str) -> int | None:
    value = parameters.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequestError(f"parameter {key}: expected an integer, got {clip(repr(value))}")
    return value


def _with(params: GenerationParams, objective: Urgency | None, tenant: str) -> GenerationParams:
    if objective is not None:
        params = replace(params, urgency=objective)
    return replace(params, tenant=tenant) if tenant else params
