"""The one place that turns an exception into a gRPC status code and message.

    AdapterNotFound (a LoRA adapter not served now)               -> NOT_FOUND
    AdapterExists (a runtime load of a served name)               -> ALREADY_EXISTS
    ParamError, RequestRejected (a bad field, a prompt too long)  -> INVALID_ARGUMENT
    AdapterRefused (a LoRA directory a worker refused)            -> INVALID_ARGUMENT
    LoRAUpdatesOff (no --allow-runtime-lora-updating)             -> FAILED_PRECONDITION
    QueueFull (more than max_waiting requests queued)              -> RESOURCE_EXHAUSTED
    StalledClient (a client read nothing for --stream-send-timeout) -> RESOURCE_EXHAUSTED
    AdaptersBusy (a LoRA load with every --max-cpu-loras slot running) -> RESOURCE_EXHAUSTED
    EngineUnavailable, WorkerFailure (no worker ready, one died)   -> UNAVAILABLE
    WrongRunner (Embed on a generating server, or the reverse)     -> FAILED_PRECONDITION
    RequestFailed (one request's output could not be processed)    -> INTERNAL, its own message
    anything else                                                  -> INTERNAL
"""
from __future__ import annotations

import grpc

from engine_common.configuration.lora import AdapterExists, AdapterNotFound, AdapterRefused
from engine_common.request.params import ParamError
from scheduler_service.core.admission import QueueFull, RequestRejected
from scheduler_service.errors import (AdaptersBusy, EngineUnavailable, LoRAUpdatesOff,
                                     RequestFailed, StalledClient, WrongRunner)

# Checked in order: a subclass comes before its base class.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StalledClient, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AdaptersBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (AdapterExists, grpc.StatusCode.ALREADY_EXISTS),
    (AdapterRefused, grpc.StatusCode.INVALID_ARGUMENT),
    (LoRAUpdatesOff, grpc.StatusCode.FAILED_PRECONDITION),
    (RequestRejected, grpc.StatusCode.INVALID_ARGUMENT),
    (ParamError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineUnavailable, grpc.StatusCode.UNAVAILABLE),
    (WrongRunner, grpc.StatusCode.FAILED_PRECONDITION),
    (RequestFailed, grpc.StatusCode.INTERNAL),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for `exc`. Known errors keep their own message (it names the field, the
    value and the allowed range); anything else is INTERNAL with the exception's type named."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc) or kind.__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
