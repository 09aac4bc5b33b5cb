"""Prompt logprobs (vLLM's `prompt_logprobs`): for each prompt position i >= 1 the raw logprob
of prompt token i given the tokens before it, its rank and the best k alternatives.

Computed as vLLM v1 computes them: from the model's logits at every prompt position of a
prefill chunk, log_softmax in float32 before any sampling processor; a token's rank is the
number of ids whose logprob is >= its own (itself included, so the best is 1; ties count
against it), as vLLM's gather_logprobs counts it. A chunk's last position predicts the next
chunk's first token (the targets are prompt ids, all known from the start), so a prompt split
over steps gets every position. The rows are kept on the host per request until the prompt is
done; the reply of the step where the request then samples its first token carries them once
(a recompute after a preemption does not compute them again).

Every rank computes them (the LM head may gather over the TP group: the ranks stay in step);
only the output rank's reply is read. A step in which no cached request waits for prompt
logprobs stops at one falsy check in `PromptLogprobBook.plan` (and `finish`): no tensor is made
(tests/integration/test_prompt_logprobs.py asserts the path).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine_common.wire.diff import PromptLogprobs, RunnerOutput, SchedulerOutput

# Rows of logits made at once: bounds the float32 [rows, vocab] temporaries to ~64 MiB.
_LOGIT_ELEMENTS = 1 << 24


@dataclass(eq=False)
class _Entry:
    """One request's prompt logprobs as they fill (row j: the prediction of prompt token j+1)."""

    k: int
    prompt: np.ndarray                 # the prompt's ids
    logprobs: np.ndarray = field(init=False)
    ranks: np.ndarray = field(init=False)
    top_ids: np.ndarray = field(init=False)
    top_logprobs: np.ndarray = field(init=False)

    def __post_init__(self):
        n = max(0, len(self.prompt) - 1)
        self.logprobs = np.zeros(n, np.float32)
        self.ranks = np.zeros(n, np.int64)
        self.top_ids = np.zeros((n, self.k), np.int64)
        self.top_logprobs = np.zeros((n, self.k), np.float32)

    def result(self) -> PromptLogprobs:
        return PromptLogprobs(self.logprobs, self.ranks, self.top_ids.reshape(-1),
                              self.top_logprobs.reshape(-1))


@dataclass
class _Chunk:
    entry: _Entry
    handle: int
    first: int          # first row of the entry this chunk fills
    rows: int           # rows it fills
    last: bool          # it completes the prompt


@dataclass
class PromptLogprobStep:
    """One step's prompt-logprob work: which query rows of the step, their targets, and (after
    `launch`) the results on their way to the host."""

    chunks: list[_Chunk]
    query_rows: np.ndarray              # int64: rows of the step's flattened tokens
    targets: np.ndarray                 # int64: the prompt token each row predicts
    k: int                              # the widest k of the step
    vocab_size: int
    out: tuple[torch.Tensor, ...] | None = None
    done: torch.cuda.Event | None = None

    def launch(self, hidden: torch.Tensor, model) -> None:
        """Compute from the step's hidden states (every token row) and queue the copies to the
        host (no sync: `finish` waits)."""
        device = hidden.device
        rows, targets = (_to_device(a, device) for a in (self.query_rows, self.targets))
        parts = []
        step = max(1, _LOGIT_ELEMENTS // self.vocab_size)
        for i in range(0, len(self.query_rows), step):
            logits = model.compute_logits(hidden.index_select(0, rows[i:i + step]))
            parts.append(token_logprobs(logits, targets[i:i + step], self.k))
        out = tuple(torch.cat(p) for p in zip(*parts))
        if device.type == "cuda":
            out = tuple(t.to("cpu", non_blocking=True) for t in out)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(device))
        self.out = out

    def finish(self) -> tuple[np.ndarray, ...]:
        if self.done is not None:
            self.done.synchronize()
        return tuple(t.numpy() for t in self.out)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """The host array on `device`, through pinned memory there (no host sync)."""
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, ...]:
    """(target logprob [M], its rank [M], top ids [M, k], top logprobs [M, k]) of the raw
    logits, in float32 as vLLM's compute_logprobs and gather_logprobs."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    k = min(k, logprobs.shape[1])
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
    return chosen.squeeze(1), ranks, ids, values


class PromptLogprobBook:
    """The cached requests that want prompt logprobs: filling (`pending`, chunks still to come)
    and done but not yet sent (`ready`)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.pending: dict[int, _Entry] = {}
        self.ready: dict[int, PromptLogprobs] = {}
        self._entries: dict[int, _Entry] = {}     # every one of them, by handle

    def __bool__(self) -> bool:
        return bool(self._entries)

    def apply(self, diff: SchedulerOutput) -> None:
        """A step's diff: its finished requests dropped (nothing of them is sent), its new ones
        that ask for prompt logprobs added. A preempted request keeps its entry: recomputed
        from position 0 (no prefix hit for it) while pending, not computed again once done."""
        if self._entries:
            for handle in diff.finished_handles:
                self._entries.pop(handle, None)
                self.pending.pop(handle, None)
                self.ready.pop(handle, None)
        for new in diff.new_requests:
            if new.prompt_logprobs >= 0:
                entry = _Entry(new.prompt_logprobs, np.asarray(new.prompt_token_ids, np.int64))
                self._entries[new.handle] = self.pending[new.handle] = entry

    def clear(self) -> None:
        self.pending.clear()
        self.ready.clear()
        self._entries.clear()

    def plan(self, batch, inputs) -> PromptLogprobStep | None:
        """This step's prompt positions of the pending requests (an InputBatch before the
        step's tokens are counted computed, the step's StepInputs), or None when none."""
        if not self.pending:
            return None
        chunks, query, targets = [], [], []
        query_start_loc = inputs.query_start_loc
        for i, row in enumerate(inputs.rows.tolist()):
            handle = int(batch.handle_ids[row])
            entry = self.pending.get(handle)
            if entry is None:
                continue
            start, n = int(batch.num_computed[row]), int(inputs.num_scheduled[i])
            count = min(n, len(entry.prompt) - 1 - start)   # positions that predict a prompt id
            last = start + n >= len(entry.prompt) - 1
            if count > 0:
                q = int(query_start_loc[i])
                query.append(np.arange(q, q + count, dtype=np.int64))
                targets.append(entry.prompt[start + 1:start + 1 + count])
            if count > 0 or last:
                chunks.append(_Chunk(entry, handle, start, max(0, count), last))
            if last:
                del self.pending[handle]            # its last rows are in this step
        if not chunks:
            return None
        k = max(c.entry.k for c in chunks)
        cat = (lambda a: np.concatenate(a) if a else np.zeros(0, np.int64))
        return PromptLogprobStep(chunks, cat(query), cat(targets), k, self.vocab_size)

    def record(self, step: PromptLogprobStep) -> None:
        """The step's rows into their requests; a completed one becomes ready."""
        lps, ranks, ids, values = step.finish() if len(step.query_rows) else (None,) * 4
        at = 0
        for c in step.chunks:
            e, rows, got = c.entry, slice(c.first, c.first + c.rows), slice(at, at + c.rows)
            if c.rows:
                e.logprobs[rows], e.ranks[rows] = lps[got], ranks[got]
                e.top_ids[rows], e.top_logprobs[rows] = ids[got, :e.k], values[got, :e.k]
            at += c.rows
            if c.last and self._entries.get(c.handle) is e:
                self.ready[c.handle] = e.result()

    def finish(self, step: PromptLogprobStep | None, out: RunnerOutput) -> None:
        """At a step's finish: its rows recorded (`step`: the launch's plan), and the ready
        prompt logprobs of the requests that sampled in it into the reply, sent once."""
        if step is not None:
            self.record(step)
        if self.ready:
            for h in out.handles:
                if h in self.ready:
                    out.prompt_logprobs[h] = self.ready.pop(h)
                    del self._entries[h]
