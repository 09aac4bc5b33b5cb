"""Errors the scheduler side raises toward the API layer, each with one gRPC meaning."""
from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """No worker is ready (not connected yet, died, or restarting): UNAVAILABLE."""


class WorkerFailure(EngineUnavailable):
    """A worker's Step stream broke or reported a protocol error mid-step."""


class WorkerRefused(WorkerFailure):
    """A worker refused the Init settings (INVALID_ARGUMENT: a model directory it cannot read, a
    dtype or option its device cannot run). Retrying helps only once the settings or the worker's
    files change, so the engine retries slowly and `deltaserve serve` stops at once."""


class RequestFailed(RuntimeError):
    """One request failed on the scheduler side (a bug, not bad input); the engine aborts it and
    serves the others: INTERNAL, for that stream only."""
