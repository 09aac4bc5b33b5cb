"""Tokens per second over the last few seconds, from the outputs the streams received."""
from __future__ import annotations

import threading
import time
from collections import deque

from scheduler_service.engine.output_processor import RequestOutput

_WINDOW_SECONDS = 10.0


class ThroughputWindow:
    """Thread-safe: fed on the event loop, read wherever GetServerStatus runs."""

    def __init__(self, window_seconds: float = _WINDOW_SECONDS):
        self._window = window_seconds
        self._steps: deque = deque()  # (time, prompt tokens, generated tokens)
        self._lock = threading.Lock()

    def record(self, outputs: list[RequestOutput]) -> None:
        """Count one hand-off's outputs. A prompt counts when its prefill completes (its first
        token), less the tokens the prefix cache served."""
        generated = prompt = 0
        for out in outputs:
            generated += len(out.new_token_ids)
            if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
                prompt += out.num_prompt_tokens - out.num_cached_tokens   # prefill just ended
        if not (generated or prompt):
            return
        now = time.monotonic()
        with self._lock:
            self._steps.append((now, prompt, generated))
            while self._steps and now - self._steps[0][0] > self._window:
                self._steps.popleft()

    def rates(self) -> tuple[float, float]:
        """(prompt tokens/s, generated tokens/s) over the window."""
        now = time.monotonic()
        with self._lock:
            steps = [s for s in self._steps if now - s[0] <= self._window]
        if not steps:
            return 0.0, 0.0
        span = max(now - steps[0][0], 1e-3)
        return sum(s[1] for s in steps) / span, sum(s[2] for s in steps) / span
