"""Times every LLMEngine step and says which were pure decode and how much KV they read.

`StepTimer(engine)` is a context manager: inside it, that one engine's `step` and its scheduler's
`schedule` are wrapped (instance attributes, removed on exit). A step's time is the whole
`LLMEngine.step`: schedule, encode, run the model, sample, copy the tokens back, detokenize. It
is what the engine spends per step, not just the forward pass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    seconds: float
    num_tokens: int       # tokens scheduled (prefill chunks + decodes)
    num_reqs: int         # requests scheduled for at least one token
    is_decode: bool       # every scheduled request got exactly one token, none was new
    kv_tokens: int        # cached positions attention reads: sum of the scheduled context lengths


@dataclass(frozen=True)
class StepSummary:
    num_steps: int
    num_decode_steps: int
    decode_seconds: float          # summed over decode steps
    mean_decode_batch: float       # requests per decode step
    decode_kv_tokens: int          # summed over decode steps
    other_seconds: float = 0.0     # summed over the steps that prefilled (prefill, mixed)
    other_tokens: int = 0          # tokens those steps scheduled
    slowest_other: tuple[tuple[float, int, int], ...] = ()   # (seconds, tokens, requests)
    step_seconds: float = 0.0      # every step together; a run's wall minus this ran outside

    @property
    def mean_decode_step_s(self) -> float:
        return self.decode_seconds / self.num_decode_steps if self.num_decode_steps else 0.0


class StepTimer:
    """Records a StepRecord per engine step while active."""

    def __init__(self, engine):
        self.engine = engine
        self.records: list[StepRecord] = []
        self._pending: tuple[int, int, bool, int] | None = None
        self._schedule = engine.scheduler.schedule
        self._step = engine.step

    def __enter__(self) -> "StepTimer":
        self.engine.scheduler.schedule = self._observe_schedule
        self.engine.step = self._timed_step
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.scheduler.schedule
        del self.engine.step

    def _observe_schedule(self):
        out = self._schedule()
        scheduler = self.engine.scheduler
        tokens = scheduler.scheduled_tokens(out.step)       # handle -> n, n > 0
        # num_computed_tokens already counts this step's tokens: it is the context length.
        kv_tokens = sum(r.num_computed_tokens for r in scheduler.running if r.handle in tokens)
        is_decode = (bool(tokens) and not out.new_requests and not out.resumed_requests
                     and all(n == 1 for n in tokens.values()))
        self._pending = (sum(tokens.values()), len(tokens), is_decode, kv_tokens)
        return out

    def _timed_step(self):
        self._pending = None
        start = time.perf_counter()
        outputs = self._step()
        seconds = time.perf_counter() - start
        # A step that scheduled nothing (LLM.generate's last, telling the runner which
        # requests finished) computed nothing: not a step to time.
        if self._pending is not None and self._pending[1]:
            self.records.append(StepRecord(seconds, *self._pending))
        return outputs

    def summary(self) -> StepSummary:
        decode = [r for r in self.records if r.is_decode]
        others = [r for r in self.records if not r.is_decode]
        n = len(decode)
        return StepSummary(
            num_steps=len(self.records), num_decode_steps=n,
            decode_seconds=sum(r.seconds for r in decode),
            mean_decode_batch=sum(r.num_reqs for r in decode) / n if n else 0.0,
            decode_kv_tokens=sum(r.kv_tokens for r in decode),
            other_seconds=sum(r.seconds for r in others),
            other_tokens=sum(r.num_tokens for r in others),
            slowest_other=tuple((r.seconds, r.num_tokens, r.num_reqs) for r in
                                sorted(others, key=lambda r: -r.seconds)[:3]),
            step_seconds=sum(r.seconds for r in self.records))
