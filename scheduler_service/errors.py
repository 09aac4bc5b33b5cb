"""Errors the scheduler side raises toward the API layer, each with one gRPC meaning."""
from __future__ import annotations

from engine_common.request.params import ParamError


class EngineUnavailable(RuntimeError):
    """No worker is ready (not connected yet, died, or restarting): UNAVAILABLE."""


class WorkerFailure(EngineUnavailable):
    """A worker's Step stream broke or reported a protocol error mid-step. `kind` names the
    failure in metrics: step_timeout, stream_ended, protocol, a worker StepError code in lower
    case (rank_failed, epoch_failed, ...), symmetry_divergence, refused, or unavailable."""

    default_kind = "unavailable"

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind or self.default_kind


class WorkerRefused(WorkerFailure):
    """A worker refused the Init settings (INVALID_ARGUMENT: a model directory it cannot read, a
    dtype or option its device cannot run). Retrying helps only once the settings or the worker's
    files change, so the engine retries slowly and `deltaserve serve` stops at once."""

    default_kind = "refused"


class Fenced(WorkerFailure):
    """Another scheduler took the workers over with a higher epoch. This scheduler stops driving
    them for good (no retry: retrying would take them back and lock both out); its requests get
    UNAVAILABLE naming the new owner."""

    default_kind = "fenced"


class EngineFault(RuntimeError):
    """A bug in an engine step (an exception that is no WorkerFailure): every open stream ends
    INTERNAL naming the exception's type only. Its text stays in the server's log: it may name
    any tenant's request (an id, a stop string, a token), and every tenant's stream gets it."""

    def __init__(self, error: BaseException):
        super().__init__(f"the engine step failed ({type(error).__name__}; the server's log "
                         "has the cause): every open stream was ended and a new epoch starts")


class StalledClient(RuntimeError):
    """A stream's client read none of its output for --stream-send-timeout seconds while it
    waited (api/stream_sends.py): the request is aborted; RESOURCE_EXHAUSTED naming the flag."""


class WrongRunner(RuntimeError):
    """A call this server's runner does not serve (Generate on a pooling server, Embed on a
    generating one): FAILED_PRECONDITION, naming the runner and the flag."""


class RequestFailed(RuntimeError):
    """One request failed on the scheduler side (a bug, not bad input); the engine aborts it and
    serves the others: INTERNAL, for that stream only."""


class LoRAUpdatesOff(RuntimeError):
    """LoadLoraAdapter / UnloadLoraAdapter on a server started without
    --allow-runtime-lora-updating: FAILED_PRECONDITION naming the flag."""


class AdaptersBusy(ParamError):
    """A runtime LoRA load finds every adapter --max-cpu-loras keeps in use by a running
    request: RESOURCE_EXHAUSTED (retry once one finishes), naming lora_name and the flag."""
