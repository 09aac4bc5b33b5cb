"""Pooling (embedding) requests on the worker: one vector per request from the final hidden states
of its prompt (after the model's last norm, before the LM head), as vLLM's embed pooler.

LAST takes the last prompt position's row, computed in the step that completes the prompt (a
prefix-cache hit never covers it: the scheduler always computes at least the last token). MEAN
adds each chunk's rows to a float32 sum on the device, CLS keeps the first position's row; both
come with no prefix hit (the scheduler skips the cache for them), and a recompute after a
preemption adds no position twice. The vector, normalised when asked (L2, float32), reaches the
host once, in the reply of the step that completes the prompt; a pooling row never samples
(InputBatch.pools), and the scheduler finishes the request on its vector.

A classifier's request (CLASSIFY) passes its pooled row through the model's head (`classify`):
its vector is the logits. A sentence pair's request carries where its second text starts: the
step's `token_type_ids` mark those rows type 1 (only a model with token types is sent one).

Every rank holds the full hidden state after the last all-reduce and computes the same vector;
only the output rank's reply is read. A step without pooling requests stops at one falsy check
in `PoolingBook.plan` and `finish`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_common.request.pooling import (CLS, LAST, MEAN, NO_POOLING, decode_code,
                                           is_classify, pair_start)
from engine_common.wire.diff import RunnerOutput, SchedulerOutput
from worker_service.batch.diff_check import BadDiff


@dataclass(eq=False)
class _Entry:
    kind: int
    normalize: bool
    prompt_len: int
    classify: bool = False               # the vector goes through the model's head
    pair_start: int = 0                  # first position of token type 1 (0: none)
    covered: int = 0                     # prompt positions already pooled (MEAN, CLS)
    acc: torch.Tensor | None = None      # MEAN: the sum so far; CLS: the first row (float32)


@dataclass
class _Chunk:
    handle: int
    entry: _Entry
    first_row: int       # the step's row of its first new position
    count: int           # new prompt positions in this step (MEAN, CLS: those not pooled yet)
    last: bool           # this step computes the prompt's last position


@dataclass
class PoolingStep:
    """One step's pooling work; after `launch`, the finished vectors on their way to the host."""

    chunks: list[_Chunk]
    # the step's rows [a, b) of token type 1 (sentence pairs' second texts)
    type1_rows: list[tuple[int, int]]
    out: dict[int, torch.Tensor] | None = None
    done: torch.cuda.Event | None = None

    def token_type_ids(self, num_rows: int, device: torch.device) -> torch.Tensor | None:
        """Each of the step's `num_rows` rows' token type; None when every row is type 0."""
        if not self.type1_rows:
            return None
        types = torch.zeros(num_rows, dtype=torch.int64)
        for a, b in self.type1_rows:
            types[a:b] = 1
        return types.to(device, non_blocking=True)

    def launch(self, hidden: torch.Tensor, model=None) -> None:
        """Pool from the step's hidden states (every token row); queue the copies (no sync)."""
        out = {}
        for c in self.chunks:
            e = c.entry
            rows = hidden[c.first_row:c.first_row + c.count].float()
            if e.kind == MEAN and c.count:
                e.acc = rows.sum(0) if e.acc is None else e.acc + rows.sum(0)
            elif e.kind == CLS and c.count and e.acc is None:
                e.acc = rows[0].clone()
            if c.last:
                vec = rows[-1] if e.kind == LAST else e.acc
                if e.kind == MEAN:
                    vec = vec / e.prompt_len
                if e.classify:
                    vec = model.classify(vec)
                elif e.normalize:
                    vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
                out[c.handle] = vec
        if hidden.device.type == "cuda" and out:
            out = {h: v.to("cpu", non_blocking=True) for h, v in out.items()}
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(hidden.device))
        self.out = out

    def finish(self) -> dict[int, np.ndarray]:
        if self.done is not None:
            self.done.synchronize()
        return {h: v.numpy() for h, v in (self.out or {}).items()}


class PoolingBook:
    """The cached pooling requests still computing their prompt (`pending`)."""

    def __init__(self, only: bool = False, classifier: bool = False,
                 token_types: bool = False) -> None:
        """only: the model serves pooling requests only (an encoder, a classifier: no LM head);
        classifier: it has a head for CLASSIFY requests; token_types: it embeds token types."""
        self.pending: dict[int, _Entry] = {}
        self.only, self.classifier, self.token_types = only, classifier, token_types

    @classmethod
    def for_model(cls, model, num_cache_layers: int) -> "PoolingBook":
        """The book for `model`: pooling only without a KV cache or an LM head, a head for
        classifiers (`classify`), token types for a model with more than one."""
        return cls(only=not num_cache_layers or getattr(model, "pooling_only", False),
                   classifier=hasattr(model, "classify"),
                   token_types=getattr(getattr(model, "args", None), "type_vocab_size", 0) > 1)

    def check_new(self, new_requests) -> None:
        """BadDiff for a request this model cannot serve (before the diff is applied
        anywhere): generation on a pooling-only model, CLASSIFY without a head or the other
        way round, a sentence pair for a model without token types or past its prompt."""
        for new in new_requests:
            code, field = new.pooling, f"new request {new.handle} pooling"
            if code == NO_POOLING:
                if self.only:
                    raise BadDiff(field, code, "a pooling code: this model has no LM head, "
                                  "it only pools")
                continue
            if is_classify(code) != self.classifier:
                raise BadDiff(field, code, "CLASSIFY set exactly when the model is a "
                              f"classifier ({self.classifier})")
            start = pair_start(code)
            if start and (not self.token_types or start >= len(new.prompt_token_ids)):
                raise BadDiff(field, code, "no pair start (this model has no token types)"
                              if not self.token_types else
                              f"a pair start below the prompt's {len(new.prompt_token_ids)} "
                              "tokens")

    def __bool__(self) -> bool:
        return bool(self.pending)

    def apply(self, diff: SchedulerOutput) -> None:
        """Finished requests dropped; new pooling requests added."""
        if self:
            for handle in diff.finished_handles:
                self.pending.pop(handle, None)
        for new in diff.new_requests:
            if new.pooling != NO_POOLING:
                kind, normalize = decode_code(new.pooling)
                self.pending[new.handle] = _Entry(kind, normalize, len(new.prompt_token_ids),
                                                  is_classify(new.pooling),
                                                  pair_start(new.pooling))

    def clear(self) -> None:
        self.pending.clear()

    def plan(self, batch, inputs) -> PoolingStep | None:
        """This step's prompt rows of the pending requests (an InputBatch before the step's
        tokens are counted computed, the step's StepInputs), or None when none."""
        if not self.pending:
            return None
        chunks, type1_rows = [], []
        for i, row in enumerate(inputs.rows.tolist()):
            handle = int(batch.handle_ids[row])
            e = self.pending.get(handle)
            if e is None:
                continue
            start, n = int(batch.num_computed[row]), int(inputs.num_scheduled[i])
            end = min(start + n, e.prompt_len)
            q = int(inputs.query_start_loc[i])
            last = end >= e.prompt_len
            if e.pair_start and end > e.pair_start:
                type1_rows.append((q + max(e.pair_start, start) - start, q + end - start))
            if e.kind == LAST:
                if last:
                    chunks.append(_Chunk(handle, e, q + end - 1 - start, 1, True))
            else:
                begin = max(start, e.covered)      # a recompute adds no position twice
                count = max(0, end - begin)
                if count or last:
                    chunks.append(_Chunk(handle, e, q + begin - start, count, last))
                e.covered = max(e.covered, end)
            if last:
                del self.pending[handle]
        return PoolingStep(chunks, type1_rows) if chunks or type1_rows else None

    def finish(self, step: PoolingStep | None, out: RunnerOutput) -> None:
        """At a step's finish: the vectors it completed go into its reply, once."""
        if step is not None:
            out.pooled.update(step.finish())
