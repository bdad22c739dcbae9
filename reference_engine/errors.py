"""Errors the reference engine answers a request with.

Each carries the Triton error code it is sent with. Messages name the tensor or limit at fault;
the queue-full message carries TensorRT-LLM's wording ("Exceeds maximum queue size") so clients
that recognise TensorRT-LLM's rejection recognise ours.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of all engine errors; `code` is a Triton error code name."""

    code = "INTERNAL"


class InvalidRequestError(EngineError):
    """The request is malformed or asks for more than the engine's limits allow."""

    code = "INVALID_ARG"


class NeverFitsError(InvalidRequestError):
    """The request could never be admitted, however empty the engine is."""


class QueueFullError(EngineError):
    """The engine's queue already holds `max_queue_size` requests."""

    code = "UNAVAILABLE"


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight was sent again."""
