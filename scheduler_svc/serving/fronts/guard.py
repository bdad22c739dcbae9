"""The one check every call on every front goes through (a gRPC server interceptor).

For each call it:
1. identifies the caller (a bearer token in `authorization`, or the mTLS client certificate;
   else anonymous) and refuses, before any work, a caller without the role the method needs:
   UNAUTHENTICATED / PERMISSION_DENIED;
2. decodes the request itself, so a malformed message (invalid UTF-8 in a string field
   included) is INVALID_ARGUMENT on every front, streamed messages too;
3. answers every `RequestError` through the one status table (with its retry hint), and any
   unexpected exception as INTERNAL with an error id that is logged with the traceback and
   counted (`scheduler_svc_internal_errors_total`): never UNKNOWN;
4. writes streamed answers with a bound on how long a client that stopped reading may hold
   one (`server.write_timeout_s`), then ends the call.

Handlers therefore just raise. The principal is in `auth.CURRENT` while the handler runs.
Health and reflection need no credential (probes); anything this table does not list needs
`admin`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
import structlog

from scheduler_svc.errors import (
    BadRequestError,
    DeadlineError,
    PermissionDeniedError,
    RequestError,
    UnauthenticatedError,
    grpc_status,
)
from scheduler_svc.serving.auth import ADMIN, CLIENT, CURRENT, Credentials, Principal
from scheduler_svc.serving.fronts.presentation import logged_internal_error
from scheduler_svc.serving.fronts.status import Context, abort
from scheduler_svc.serving.metrics import SidecarMetrics

log = structlog.get_logger("scheduler_svc.guard")
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

OPEN = ""  # no credential needed
# The role each service needs, and the methods that differ from their service's.
SERVICE_ROLES: dict[str, str] = {
    "scheduler.v1.Scheduler": CLIENT,
    "scheduler.v1.Admin": ADMIN,
    "inference.GRPCInferenceService": CLIENT,
    "grpc.health.v1.Health": OPEN,
    "grpc.reflection.v1alpha.ServerReflection": OPEN,
}
METHOD_ROLES: dict[str, str] = {
    "/inference.GRPCInferenceService/RepositoryModelLoad": ADMIN,
    "/inference.GRPCInferenceService/RepositoryModelUnload": ADMIN,
    "/inference.GRPCInferenceService/TraceSetting": ADMIN,
    "/inference.GRPCInferenceService/LogSettings": ADMIN,
}


def role_for(method: str) -> str:
    if method in METHOD_ROLES:
        return METHOD_ROLES[method]
    service = method.strip("/").split("/", 1)[0]
    return SERVICE_ROLES.get(service, ADMIN)


@dataclass
class Identity:
    """How callers of one listener are identified (swapped whole on SIGHUP)."""

    credentials: Credentials | None
    anonymous: Principal  # who a caller without any credential is

    def identify(self, context: Context) -> Principal:
        return self.identify_by(_authorization(context), lambda: _peer_names(context))

    def identify_by(
        self, authorization: str | None, peer_names: Callable[[], list[str]]
    ) -> Principal:
        """The principal of a caller that sent this Authorization value (or none) and holds a
        client certificate with these names (asked only when there is no token)."""
        # With no credentials configured an Authorization value means nothing, whatever its
        # scheme: the caller is anonymous (the OpenAI client always sends a token; a gateway
        # may pass on its own Basic credentials).
        if self.credentials is None:
            return self.anonymous
        token = bearer(authorization)
        if token is not None:
            found = self.credentials.by_token(token)
            if found is None:
                raise UnauthenticatedError("the bearer token is not valid")
            return found
        names = peer_names()
        if names:
            found = self.credentials.by_identity(names)
            if found is not None:
                return found
        return self.anonymous


def _authorization(context: Context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value; None when there is no value."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise UnauthenticatedError("authorization: expected 'Bearer <token>'")
    return token.strip()


def _peer_names(context: Context) -> list[str]:
    auth = context.auth_context() or {}
    names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names]


def admit(principal: Principal, role: str, what: str) -> Principal:
    """`principal` when it holds `role`; otherwise UNAUTHENTICATED (no credential at all) or
    PERMISSION_DENIED."""
    if role not in principal.roles:
        if not principal.roles:
            raise UnauthenticatedError(
                "this server needs a credential (a bearer token or a client certificate)"
            )
        raise PermissionDeniedError(
            f"{what} needs the {role} role; '{principal.name}' does not have it"
        )
    return principal


class Guard(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        identity: Callable[[], Identity],
        metrics: SidecarMetrics,
        write_timeout_s: float,
    ) -> None:
        self.identity = identity
        self.metrics = metrics
        self.write_timeout_s = write_timeout_s

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        if handler is None:
            return None  # not served: gRPC answers UNIMPLEMENTED
        method = details.method
        role = role_for(method)
        if role == OPEN:
            return handler
        call = _Call(self, method, role, handler)
        serializer = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                call.unary_unary, response_serializer=serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                call.unary_stream, response_serializer=serializer
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                call.stream_stream, response_serializer=serializer
            )
        return grpc.stream_unary_rpc_method_handler(
            call.stream_unary, response_serializer=serializer
        )


class _Call:
    """One method's wrapped behaviours."""

    def __init__(self, guard: Guard, method: str, role: str, handler: Handler) -> None:
        self.guard = guard
        self.method = method
        self.role = role
        self.handler: Any = handler  # its behaviours are the aio kind, which the stubs do not know
        self.decode: Callable[[bytes], Any] = handler.request_deserializer or (lambda raw: raw)

    def _admit(self, context: Context) -> None:
        principal = self.guard.identity().identify(context)
        CURRENT.set(admit(principal, self.role, self.method))

    def _request(self, raw: bytes) -> Any:
        try:
            return self.decode(raw)
        except Exception:  # protobuf's DecodeError, or any deserializer's own failure
            raise BadRequestError(
                f"the request is not a valid message for {self.method} (a string field that "
                "is not UTF-8?)"
            ) from None

    async def _requests(self, raws: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
        """A client stream's messages; each is admitted again against the credentials loaded
        last, so a credential revoked by a reload (SIGHUP) ends a stream at its next message
        rather than when the connection ages out."""
        async for raw in raws:
            self._admit(context)
            yield self._request(raw)

    async def _fail(self, context: Context, exc: BaseException) -> None:
        """Answer an exception with its status; never returns."""
        if isinstance(exc, RequestError):
            if isinstance(exc, UnauthenticatedError | PermissionDeniedError):
                self.guard.metrics.refused_calls.labels(grpc_status(exc).name).inc()
            await abort(context, exc)
        metrics = self.guard.metrics
        await abort(
            context, logged_internal_error(log, exc, metrics, self.method, method=self.method)
        )

    async def _write(self, context: Context, message: Any) -> None:
        try:
            # A timeout scope, not wait_for: on Python 3.11 wait_for runs the write as a task of
            # its own, a round through the event loop for every token streamed.
            async with asyncio.timeout(self.guard.write_timeout_s):
                await context.write(message)
        except TimeoutError:
            raise DeadlineError(
                f"the client read nothing for {self.guard.write_timeout_s:g} s; call ended"
            ) from None

    async def _guarded(self, context: Context, work: Callable[[], Awaitable[Any]]) -> Any:
        """Admit the caller, then run `work` (which decodes the request: only after the
        caller is admitted); answer any failure with its status."""
        try:
            self._admit(context)
            return await work()
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await self._fail(context, exc)

    async def unary_unary(self, raw: bytes, context: Context) -> Any:
        return await self._guarded(
            context, lambda: self.handler.unary_unary(self._request(raw), context)
        )

    async def stream_unary(self, raws: AsyncIterator[bytes], context: Context) -> Any:
        return await self._guarded(
            context, lambda: self.handler.stream_unary(self._requests(raws, context), context)
        )

    async def unary_stream(self, raw: bytes, context: Context) -> None:
        await self._guarded(
            context,
            lambda: self._pipe(self.handler.unary_stream(self._request(raw), context), context),
        )

    async def stream_stream(self, raws: AsyncIterator[bytes], context: Context) -> None:
        await self._guarded(
            context,
            lambda: self._pipe(
                self.handler.stream_stream(self._requests(raws, context), context), context
            ),
        )

    async def _pipe(self, answers: Any, context: Context) -> None:
        if not hasattr(answers, "__aiter__"):  # a handler that writes for itself
            await answers
            return
        try:
            async for answer in answers:
                await self._write(context, answer)
        finally:
            await answers.aclose()
