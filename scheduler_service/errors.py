"""Errors the scheduler side raises toward the API layer, each with one gRPC meaning."""
from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """No worker is ready (not connected yet, died, or restarting): UNAVAILABLE."""


class WorkerFailure(EngineUnavailable):
    """A worker's Step stream broke or reported a protocol error mid-step."""


class RequestFailed(RuntimeError):
    """One request failed on the scheduler side (a bug, not bad input); the engine aborts it and
    serves the others: INTERNAL, for that stream only."""
