"""The token read-back: the sampler's outputs to the host with the step's one host sync.

`start` queues non-blocking device-to-host copies of the sampled ids, their logprobs and (when
asked) the top alternatives into pinned host buffers, then records an event; `PendingTokens.wait`
synchronises on that event (the only host sync of a step) and returns numpy copies. The pinned
buffers are allocated once at max_num_reqs rows (the top-alternative ones grow to the widest k
seen); they are reused by every other step (the runner keeps two, one per step parity), which is
safe because wait() copies them out before the step after next is launched. On CPU the sampler's tensors are already on the host: no copy, no sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker_service.sample.sampler import SamplerOutput


@dataclass
class SampledTokens:
    """A step's sampler outputs on the host (rows in sampling order)."""

    token_ids: np.ndarray                  # int64 [N]
    logprobs: np.ndarray                   # float32 [N]; [0] when no row wanted one
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

    def wait_device(self) -> None:
        if self.done is not None:
            self.done.synchronize()

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
        # empty when no row wanted its logprob
        logprobs = self._copy(self._logprobs[:out.logprobs.shape[0]], out.logprobs)
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
    """A launched step awaiting its finish: the requests that sampled, where their ids go, and
    their read-back (on the device, `sampled` also feeds the next step: TokenFeed)."""

    step: int
    handles: list[int] = field(default_factory=list)   # handles that sampled, sampling order
    positions: np.ndarray | None = None     # int32 [N]: each one's token index in its row
    num_logprobs: np.ndarray | None = None  # int32 [N]: top alternatives each asked for (-1: none)
    tokens: PendingTokens | None = None     # None: nothing sampled
    sampled: torch.Tensor | None = None     # int64 [N] on the device (None on the simulated one)
    copied: torch.cuda.Event | None = None  # the staging copies' event, when nothing sampled
    computed: bool = True                   # False: the step scheduled no token at all
    rows: np.ndarray | None = None          # int64 [N]: their batch rows at the launch...
    layout: int = -1                        # ...valid while InputBatch.layout is this
    prompt_logprobs: object | None = None   # the step's PromptLogprobStep, when it has one
    spec: object | None = None              # the step's SpecStep (drafts), when it has one
    pooling: object | None = None           # the step's PoolingStep, when it has one

    def wait_device(self) -> None:
        """Block until the step's device work is done (its read-back, else its staging copies);
        the read-back itself stays for finish_step."""
        if self.tokens is not None:
            self.tokens.wait_device()
        elif self.copied is not None:
            self.copied.synchronize()


def top_alternatives(handles: list[int], num_logprobs: np.ndarray | None,
                     sampled: SampledTokens, draws: np.ndarray | None = None,
                     counts: np.ndarray | None = None) -> dict:
    """handle -> (top ids, top logprobs) of the rows that asked for alternatives. They stay
    numpy arrays: encode_runner_output writes their buffers to the wire as they are (no Python
    float per request and step). A speculative step (`draws`: per produced token the index of
    its draw, `counts`: tokens per sampled row) gives a row that produced n tokens n * k of
    each, token after token."""
    top = {}
    if sampled.top_ids is not None:
        starts = None if counts is None else np.cumsum(counts) - counts
        for i, k in enumerate(num_logprobs.tolist()):
            if k <= 0:                   # NO_LOGPROBS (-1): none at all
                continue
            if starts is None or counts[i] == 1:
                at = i if draws is None else int(draws[starts[i]])
                top[handles[i]] = (sampled.top_ids[at, :k], sampled.top_logprobs[at, :k])
            else:
                at = draws[starts[i]:starts[i] + counts[i]]
                top[handles[i]] = (sampled.top_ids[at, :k].reshape(-1),
                                   sampled.top_logprobs[at, :k].reshape(-1))
    return top


@dataclass
class TokenFeed:
    """The rows of a step's input ids that are the previous step's sampled ids, copied on the
    device: that step is launched before the previous one's ids reach the host."""

    dst: torch.Tensor       # int64 [K]: indices into this step's input ids
    src: torch.Tensor       # int64 [K]: indices into the previous step's sampled ids
    sampled: torch.Tensor | None

    @staticmethod
    def plan(prev: PendingStep, handle_ids: np.ndarray, inputs, staging,
             layout: int | None = None) -> "TokenFeed | None":
        """Which query tokens of `inputs` (a StepInputs over batch rows whose handles are
        `handle_ids[row]`) are ids `prev` sampled: a row's last query token, at the position
        prev sampled for its request. Staged in `staging` (before its flush); None if none.
        `layout`: the batch's now; when prev was launched at it and sampled exactly these rows
        (the steady decode step), its i-th sampled id is row i's, with no search."""
        if not prev.handles or not len(inputs.rows):
            return None
        last = inputs.query_start_loc[1:].astype(np.int64) - 1
        if (layout == prev.layout and len(prev.rows) == len(inputs.rows)
                and np.array_equal(prev.rows, inputs.rows)):
            src = np.arange(len(last))
            fed = inputs.positions[last] == prev.positions
        else:
            prev_handles = np.asarray(prev.handles, dtype=np.int64)
            order = np.argsort(prev_handles)
            ranked = prev_handles[order]
            current = handle_ids[inputs.rows]
            at = np.minimum(np.searchsorted(ranked, current), len(ranked) - 1)
            src = order[at]
            fed = (ranked[at] == current) & (inputs.positions[last] == prev.positions[src])
        if not fed.any():
            return None
        return TokenFeed(staging.put(last[fed], torch.int64, "feed dst"),
                         staging.put(src[fed], torch.int64, "feed src"), prev.sampled)

    def apply(self, input_ids: torch.Tensor) -> None:
        """Queue the copy (after the staging flush, before the model reads input_ids)."""
        input_ids.index_copy_(0, self.dst, self.sampled.index_select(0, self.src))
