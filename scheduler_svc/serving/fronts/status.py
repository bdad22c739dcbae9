"""Turning a `RequestError` into a gRPC status: the one place fronts do it."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from scheduler_svc.errors import RequestError, grpc_status

RETRY_AFTER_KEY = "retry-after-ms"

Context = grpc.aio.ServicerContext[Any, Any]


async def abort(context: Context, error: RequestError) -> NoReturn:
    """End the call with the error's status and message (and a retry hint when it has one)."""
    if error.retry_after_s is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(int(error.retry_after_s * 1000))),))
    await context.abort(grpc_status(error), str(error))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
