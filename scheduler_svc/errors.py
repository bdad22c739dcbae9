"""The project's error tree and its one mapping to gRPC status codes.

Each error has a fixed `type` string (a metric label) and a gRPC status in `GRPC_STATUS`.

SchedulerSvcError
├── ConfigError                   a configuration value is wrong (names the field)
├── LauncherError                 the embedded Triton could not be started or stopped
│   ├── TritonNotInstalledError   no bundled tritonserver (install the `triton` extra)
│   ├── BackendStubMissingError   no Python backend stub for this interpreter
│   ├── PortInUseError            a requested port is taken
│   ├── ModelLoadError            a model failed to load; names the model and Triton's reason
│   ├── TritonExitedError         tritonserver exited for another reason
│   └── TritonStartTimeoutError   tritonserver did not become ready in time
└── RequestError                  one request could not be served
    ├── BadRequestError           the request itself is wrong            INVALID_ARGUMENT
    ├── UnknownModelError         a model this sidecar does not front    NOT_FOUND
    ├── OverloadedError           the sidecar's queue is full            RESOURCE_EXHAUSTED
    ├── BackendBusyError          the engine's own queue is full         RESOURCE_EXHAUSTED
    ├── QueueTimeoutError         waited past its queue timeout          DEADLINE_EXCEEDED
    ├── DeadlineError             the client's deadline passed           DEADLINE_EXCEEDED
    ├── BackendUnavailableError   Triton cannot be reached / not ready   UNAVAILABLE
    ├── BackendFailedError        Triton failed the request              UNAVAILABLE
    ├── BackendRefusedError       Triton refused an admin change         FAILED_PRECONDITION
    ├── PreconditionError         an admin change the state refuses      FAILED_PRECONDITION
    ├── BackendStalledError       Triton sent nothing for too long       UNAVAILABLE
    ├── MaxDurationError          the request ran past the server's cap  DEADLINE_EXCEEDED
    ├── ShuttingDownError         the sidecar is draining                UNAVAILABLE
    ├── UnauthenticatedError      no valid credential                    UNAUTHENTICATED
    ├── PermissionDeniedError     the credential lacks the role / tenant PERMISSION_DENIED
    ├── QuotaExceededError        the tenant is over its quota           RESOURCE_EXHAUSTED
    ├── UnsupportedError          a call the sidecar cannot serve        UNIMPLEMENTED
    ├── TritonCallError           a passed-through call Triton failed    Triton's own code
    └── InternalError             a bug: logged with an error id         INTERNAL

`clip` bounds any client-given text an error message echoes.
"""

from __future__ import annotations

import grpc


class SchedulerSvcError(Exception):
    """Base of every error scheduler_svc raises on purpose."""

    type = "internal"


class ConfigError(SchedulerSvcError):
    type = "config"


# -- the embedded Triton --------------------------------------------------------------------


class LauncherError(SchedulerSvcError):
    type = "launcher"


class TritonNotInstalledError(LauncherError):
    type = "triton_not_installed"


class BackendStubMissingError(LauncherError):
    type = "backend_stub_missing"


class PortInUseError(LauncherError):
    type = "port_in_use"

    def __init__(self, service: str, port: int) -> None:
        super().__init__(
            f"the {service} port {port} is already in use; choose another (0 picks a free one)"
        )
        self.service = service
        self.port = port


class ModelLoadError(LauncherError):
    type = "model_load_failed"

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"model '{model}' failed to load: {reason}")
        self.model = model
        self.reason = reason


class TritonExitedError(LauncherError):
    type = "triton_exited"


class TritonStartTimeoutError(LauncherError):
    type = "triton_start_timeout"


# -- one request ----------------------------------------------------------------------------


class RequestError(SchedulerSvcError):
    """A request that ends in an error; `retry_after_s` is sent as a hint when set."""

    type = "request"
    retry_after_s: float | None = None


class BadRequestError(RequestError):
    type = "bad_request"


class UnknownModelError(RequestError):
    type = "unknown_model"


class OverloadedError(RequestError):
    type = "overloaded"

    def __init__(self, message: str, retry_after_s: float, reason: str = "overloaded") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason  # the policy's reason (a metric label), where it gave one


class BackendBusyError(RequestError):
    type = "backend_busy"
    retry_after_s = 0.5


class QueueTimeoutError(RequestError):
    type = "queue_timeout"


class DeadlineError(RequestError):
    type = "deadline"


class BackendUnavailableError(RequestError):
    type = "backend_unavailable"


class BackendFailedError(RequestError):
    type = "backend_failed"


class BackendRefusedError(RequestError):
    type = "backend_refused"


class PreconditionError(RequestError):
    """An admin change that the configuration or the present state does not allow (no
    rollout configured; a step after the rollout is done)."""

    type = "failed_precondition"


class ShuttingDownError(RequestError):
    type = "shutting_down"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendStalledError(RequestError):
    type = "backend_stalled"


class MaxDurationError(RequestError):
    type = "max_duration"


class UnauthenticatedError(RequestError):
    type = "unauthenticated"


class PermissionDeniedError(RequestError):
    type = "permission_denied"


class QuotaExceededError(RequestError):
    type = "quota_exceeded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InternalError(RequestError):
    type = "internal"


class UnsupportedError(RequestError):
    type = "unsupported"


class TritonCallError(RequestError):
    """A call passed through to Triton (repository, statistics, settings) that Triton failed:
    answered with Triton's own status code (UNKNOWN becomes INTERNAL) and its message."""

    type = "triton_call"

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"Triton: {details}")
        self.code = grpc.StatusCode.INTERNAL if code == grpc.StatusCode.UNKNOWN else code


def clip(text: str, limit: int = 64) -> str:
    """`text` as an error message may echo it: at most `limit` characters, repr-quoted."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + f"... ({len(text)} characters)"


GRPC_STATUS: dict[type[RequestError], grpc.StatusCode] = {
    BadRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownModelError: grpc.StatusCode.NOT_FOUND,
    OverloadedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    BackendBusyError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QueueTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    DeadlineError: grpc.StatusCode.DEADLINE_EXCEEDED,
    BackendUnavailableError: grpc.StatusCode.UNAVAILABLE,
    BackendFailedError: grpc.StatusCode.UNAVAILABLE,
    BackendRefusedError: grpc.StatusCode.FAILED_PRECONDITION,
    PreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    BackendStalledError: grpc.StatusCode.UNAVAILABLE,
    MaxDurationError: grpc.StatusCode.DEADLINE_EXCEEDED,
    ShuttingDownError: grpc.StatusCode.UNAVAILABLE,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    QuotaExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InternalError: grpc.StatusCode.INTERNAL,
    UnsupportedError: grpc.StatusCode.UNIMPLEMENTED,
}


def grpc_status(error: RequestError) -> grpc.StatusCode:
    """The status a request error is answered with (UNAVAILABLE for anything unlisted)."""
    if isinstance(error, TritonCallError):
        return error.code
    for cls in type(error).__mro__:
        if cls in GRPC_STATUS:
            return GRPC_STATUS[cls]
    return grpc.StatusCode.UNAVAILABLE


# The texts of Triton and TensorRT-LLM errors that arrive as plain strings (stream errors carry
# no status code), mapped to our errors. First match wins; anything else is BackendFailedError.
BACKEND_MESSAGES: list[tuple[str, type[RequestError]]] = [
    ("Exceeds maximum queue size", BackendBusyError),  # Triton core's wording
    ("Maximum queue size of", BackendBusyError),  # TensorRT-LLM's executor: "... has been reached"
    ("can never run", BadRequestError),
    ("input_ids:", BadRequestError),
    ("input_lengths:", BadRequestError),
    ("request_output_len:", BadRequestError),
    ("is outside the vocabulary", BadRequestError),
    ("Request timeout expired", QueueTimeoutError),
]


# Triton's own gRPC status codes, for calls that fail as a whole.
BACKEND_STATUS: dict[grpc.StatusCode, type[RequestError]] = {
    grpc.StatusCode.UNAVAILABLE: BackendUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineError,
    grpc.StatusCode.INVALID_ARGUMENT: BadRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BackendBusyError,
}


def from_backend_status(code: grpc.StatusCode, details: str) -> RequestError:
    """Classify a failed Triton call by its status code."""
    cls = BACKEND_STATUS.get(code, BackendFailedError)
    if cls is BackendUnavailableError:
        return cls(f"Triton is unreachable: {details}")
    if cls is DeadlineError:
        return cls("the deadline passed while Triton was generating")
    return cls(f"Triton: {details}")


def from_repository_status(code: grpc.StatusCode, details: str) -> RequestError:
    """Classify a failed repository call (load, unload). A Triton that answered refused the
    change itself (unknown model, model control disabled): FAILED_PRECONDITION with its reason.
    Only a Triton that could not be reached is UNAVAILABLE."""
    unreachable = code == grpc.StatusCode.UNAVAILABLE and any(
        word in details.lower() for word in ("connect", "socket", "unreachable", "refused")
    )
    if unreachable or code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return from_backend_status(code, details)
    return BackendRefusedError(f"Triton: {details}")


def from_backend_message(message: str) -> RequestError:
    """Classify a backend error text."""
    for needle, cls in BACKEND_MESSAGES:
        if needle in message:
            return cls(f"backend: {message}")
    return BackendFailedError(f"backend failed the request: {message}")


# The HTTP fronts answer with the HTTP code of the error's gRPC status (Triton's HTTP server
# maps its codes the same way; 429 carries Retry-After).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(error: RequestError) -> int:
    return HTTP_STATUS.get(grpc_status(error), 500)
