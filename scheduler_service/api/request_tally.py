"""One call of the vLLM engine protocol (Generate or Embed) in the request counters."""
from __future__ import annotations

from scheduler_service.api.status import status_for
from scheduler_service.engine.output_processor import RequestOutput
from scheduler_service.engine.serving_counters import ServingCounters
from scheduler_service.errors import StalledClient


class RequestTally:
    """One call in the request counters (docs/metrics.md: received = rejected +
    success + in flight). The call is one request until it is validated, then its n choices;
    a failure before any output rejects them all (by status code), after one it ends those
    choices not yet finished with `finished_reason="error"` (the finished ones were counted
    as successes by the stream hub). A stream cut by --stream-send-timeout is not counted
    here: the engine counts each request's end (abort, or how it finished before the cut)."""

    def __init__(self, counters: ServingCounters):
        self._counters = counters
        self._requests = 1
        self._outputs = self._finished = 0
        counters.received()

    def choices(self, n: int) -> None:
        if n > self._requests:
            self._counters.received(n - self._requests)
            self._requests = n

    def output(self, out: RequestOutput) -> None:
        self._outputs += 1
        self._finished += out.finished

    def failed(self, error: Exception) -> None:
        if isinstance(error, StalledClient):
            return
        if self._outputs:
            self._counters.failed_after_output(self._requests - self._finished)
        else:
            self._counters.rejected(status_for(error)[0].name, self._requests)
