"""Cumulative request and token counts of the streams, and the token rates derived from them.

The one source of GetServerStatus's token rates and of the Prometheus request and token counters:
every count is made here once, by the serving side (the stream hub for outputs, the Generate
servicer for calls and errors). Thread-safe.

    received                   Generate calls (a VllmEngine call with n choices: n)
    rejected[code]             calls that ended with an error status before their first output
    finished[(reason, stop)]   requests that ended with a final output (length, stop, abort),
                               or with an error status after an output (error); reason is
                               vLLM's finished_reason, stop says which stop (token, string; ""
                               for the other reasons)
    prompt_tokens              all prompt tokens of requests whose first token came out
    cached_prompt_tokens       of those, served by the prefix cache
    generation_tokens          tokens streamed
    stalled                    streams cut because their client read nothing for
                               --stream-send-timeout (api/stream_sends.py)
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from scheduler_service.core.request import RequestStatus
from scheduler_service.engine.output_processor import RequestOutput

_WINDOW_SECONDS = 10.0

# RequestStatus -> (vLLM finished_reason, stop).
FINISH_LABELS = {
    RequestStatus.FINISHED_LENGTH: ("length", ""),
    RequestStatus.FINISHED_STOP_TOKEN: ("stop", "token"),
    RequestStatus.FINISHED_STOP_STRING: ("stop", "string"),
    RequestStatus.FINISHED_ABORTED: ("abort", ""),
}
ERROR_LABELS = ("error", "")


@dataclass(frozen=True)
class CountsSnapshot:
    received: int
    rejected: dict[str, int]
    finished: dict[tuple[str, str], int]
    prompt_tokens: int
    cached_prompt_tokens: int
    generation_tokens: int
    stalled: int = 0


class ServingCounters:
    def __init__(self, window_seconds: float = _WINDOW_SECONDS):
        self._window = window_seconds
        self._lock = threading.Lock()
        self._received = 0
        self._stalled = 0
        self._rejected: Counter = Counter()
        self._finished: Counter = Counter()
        self._tokens = [0, 0, 0]                # prompt, cached prompt, generation
        self._recent: deque = deque()           # (time, computed prompt tokens, generated)

    def received(self, n: int = 1) -> None:
        """`n` requests arrived (a VllmEngine call with n choices stands for n)."""
        with self._lock:
            self._received += n

    def rejected(self, code: str, n: int = 1) -> None:
        with self._lock:
            self._rejected[code] += n

    def stalled(self) -> None:
        """A stream was cut: its client read nothing for --stream-send-timeout."""
        with self._lock:
            self._stalled += 1

    def failed_after_output(self, n: int = 1) -> None:
        """`n` requests that streamed outputs, then ended with an error status."""
        with self._lock:
            self._finished[ERROR_LABELS] += n

    def record(self, outputs: list[RequestOutput]) -> None:
        """Count one hand-off's outputs (outputs carrying an error are counted by the servicer,
        which sees the error). A prompt counts when its first token comes out."""
        prompt = cached = generated = 0
        finished = Counter()
        for out in outputs:
            if out.error is not None:
                continue
            generated += len(out.new_token_ids)
            if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
                prompt += out.num_prompt_tokens
                cached += out.num_cached_tokens
            if out.finished:
                finished[FINISH_LABELS[out.finish_reason]] += 1
        now = time.monotonic()
        with self._lock:
            self._finished.update(finished)
            for i, n in enumerate((prompt, cached, generated)):
                self._tokens[i] += n
            if prompt or generated:
                self._recent.append((now, prompt - cached, generated))
            while self._recent and now - self._recent[0][0] > self._window:
                self._recent.popleft()

    def snapshot(self) -> CountsSnapshot:
        with self._lock:
            return CountsSnapshot(self._received, dict(self._rejected), dict(self._finished),
                                  *self._tokens, stalled=self._stalled)

    def rates(self) -> tuple[float, float]:
        """(prompt tokens/s less the prefix-cache hits, generated tokens/s) over the window."""
        now = time.monotonic()
        with self._lock:
            recent = [s for s in self._recent if now - s[0] <= self._window]
        if not recent:
            return 0.0, 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(s[1] for s in recent) / span, sum(s[2] for s in recent) / span
