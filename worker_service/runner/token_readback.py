"""The token read-back: the sampler's outputs to the host with the step's one host sync.

`start` queues non-blocking device-to-host copies of the sampled ids, their logprobs and (when
asked) the top alternatives into pinned host buffers, then records an event; `PendingTokens.wait`
synchronises on that event (the only host sync of a step) and returns numpy copies. The pinned
buffers are allocated once at max_num_reqs rows (the top-alternative ones grow to the widest k
seen); they are reused every step, which is safe because wait() copies them out before the next
step starts. On CPU the sampler's tensors are already on the host: no copy, no sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_service.sample.sampler import SamplerOutput


@dataclass
class SampledTokens:
    """A step's sampler outputs on the host (rows in sampling order)."""

    token_ids: np.ndarray                  # int64 [N]
    logprobs: np.ndarray                   # float32 [N]
    top_ids: np.ndarray | None = None      # int64 [N, k]
    top_logprobs: np.ndarray | None = None  # float32 [N, k]


@dataclass
class PendingTokens:
    """Host views being filled by in-flight copies; wait() makes them readable."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    done: torch.cuda.Event | None          # None on CPU: nothing in flight

    def wait(self) -> SampledTokens:
        """The step's one host sync; returns copies that outlive the pinned buffers."""
        if self.done is not None:
            self.done.synchronize()

        def host(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.numpy().copy()
        return SampledTokens(host(self.token_ids), host(self.logprobs), host(self.top_ids),
                             host(self.top_logprobs))


class TokenReadback:
    """Pinned host buffers for up to max_rows sampled rows on `device`."""

    def __init__(self, max_rows: int, device: torch.device | str) -> None:
        self.max_rows = max_rows
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._ids = self._host(max_rows, torch.int64)
        self._logprobs = self._host(max_rows, torch.float32)
        self._top_ids = self._host(0, torch.int64)          # flat, grown on demand
        self._top_logprobs = self._host(0, torch.float32)
        self._done = torch.cuda.Event() if self._pinned else None

    def start(self, out: SamplerOutput) -> PendingTokens:
        """Queue the copies of `out` (no sync); wait() on the result reads them."""
        if not self._pinned:
            return PendingTokens(out.sampled_token_ids, out.logprobs, out.top_ids,
                                 out.top_logprobs, None)
        n = out.sampled_token_ids.shape[0]
        if n > self.max_rows:
            raise ValueError(f"{n} sampled rows exceed max_rows={self.max_rows}")
        ids = self._copy(self._ids[:n], out.sampled_token_ids)
        logprobs = self._copy(self._logprobs[:n], out.logprobs)
        top_ids = top_logprobs = None
        if out.top_ids is not None:
            shape = tuple(out.top_ids.shape)
            self._grow_top(self.max_rows * shape[1])
            top_ids = self._copy(self._top_ids[:n * shape[1]].view(shape), out.top_ids)
            top_logprobs = self._copy(self._top_logprobs[:n * shape[1]].view(shape),
                                      out.top_logprobs)
        # On this device's stream, not the calling thread's current device (0 in a new thread).
        self._done.record(torch.cuda.current_stream(self.device))
        return PendingTokens(ids, logprobs, top_ids, top_logprobs, self._done)

    def _host(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=self._pinned)

    def _grow_top(self, n: int) -> None:
        """Make the top-alternative buffers hold n elements (safe: the last step was read)."""
        if self._top_ids.shape[0] < n:
            self._top_ids = self._host(n, torch.int64)
            self._top_logprobs = self._host(n, torch.float32)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        dst.copy_(src, non_blocking=True)
        return dst


@dataclass
class PendingStep:
    """A launched step awaiting its finish: the rows that sampled and their read-back."""

    step: int
    rows: np.ndarray | None = None          # batch rows that sampled, in sampling order
    tokens: PendingTokens | None = None     # None: nothing sampled
