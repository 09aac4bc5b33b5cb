"""A model-free worker for driving the scheduler alone: it applies each encoded diff as
engine_common/wire/diff.py says a worker must and "samples" a fixed token stream, nothing else.

It keeps, per handle, only what decides whether a request samples this step (tokens known and
tokens computed); block tables are checked only for length (enough blocks for the computed
tokens). Its cost is not part of what bench/scheduler_step.py times.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine_common.wire.codec import decode_runner_output, decode_scheduler_output, encode_runner_output
from engine_common.wire.diff import RunnerOutput


@dataclass
class _Row:
    num_tokens: int
    num_computed: int
    num_blocks: int


class FakeWorker:
    """Applies encoded SchedulerOutput diffs; returns decoded RunnerOutputs (after a round trip
    through the codec, as the engine receives them)."""

    def __init__(self, block_size: int, token_id: int = 7):
        self.block_size = block_size
        self.token_id = token_id           # every sampled token (never a stop id in the bench)
        self.rows: dict[int, _Row] = {}    # every cached request, by handle
        self.batch: dict[int, None] = {}   # handles in the running batch, in insertion order

    def execute(self, payload: bytes) -> RunnerOutput:
        diff = decode_scheduler_output(payload)
        for h in diff.finished_handles:
            self.rows.pop(h, None)
            self.batch.pop(h, None)
        for h in diff.preempted_handles:
            del self.batch[h]
        compiled = []               # grammars "compile" at once
        for new in diff.new_requests:
            self.rows[new.handle] = _Row(len(new.prompt_token_ids), new.num_computed_tokens,
                                         len(new.block_ids))
            self.batch[new.handle] = None
            if new.constraint is not None:
                compiled.append(new.handle)
        for res in diff.resumed_requests:
            row = self.rows[res.handle]
            row.num_computed, row.num_blocks = res.num_computed_tokens, len(res.block_ids)
            self.batch[res.handle] = None
        for h, ids in diff.new_block_ids.items():
            self.rows[h].num_blocks += len(ids)
        out = RunnerOutput(diff.step, compiled_handles=compiled)
        counts = diff.num_scheduled_tokens
        for h in self.batch:
            n = counts.get(h, 1)
            if n == 0:
                continue
            row = self.rows[h]
            row.num_computed += n
            if row.num_blocks * self.block_size < row.num_computed:
                raise AssertionError(f"handle {h}: {row.num_blocks} blocks for "
                                     f"{row.num_computed} tokens")
            if row.num_computed == row.num_tokens:
                row.num_tokens += 1
                out.handles.append(h)
                out.sampled_token_ids.append(self.token_id)
                out.logprobs.append(-0.5)
        return decode_runner_output(encode_runner_output(out))
