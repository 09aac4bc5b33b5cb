"""The worker's cached requests by handle, and the batch rows of those running: a step's diff
applied to both (engine_common/wire/diff.py gives the order), and the sampled ids written back."""
from __future__ import annotations

import hashlib

import numpy as np

from engine_common.wire.diff import SchedulerOutput
from worker_service.batch.input_batch import CachedRequestState, InputBatch
from worker_service.failures import StepProtocolError


def rejoins(diff: SchedulerOutput) -> bool:
    """Whether a handle leaves the batch in `diff` (finished or preempted) and joins it again in
    the same diff (a recycled handle's new request, or a resume). Its row then changes hands: a
    token still in flight for the request that left must be recorded before the diff is
    applied, else `record` (which goes by handle) writes it into the row of the one that joined."""
    if not (diff.finished_handles or diff.preempted_handles) \
            or not (diff.new_requests or diff.resumed_requests):
        return False
    left = {*diff.finished_handles, *diff.preempted_handles}
    return any(r.handle in left for r in (*diff.new_requests, *diff.resumed_requests))


class CachedRequests:
    """`states`: every request the worker knows, preempted ones included (their tokens are
    recomputed on resume); `batch`: the rows of the running ones."""

    def __init__(self, batch: InputBatch):
        self.batch = batch
        self.states: dict[int, CachedRequestState] = {}

    def row(self, handle: int) -> int:
        try:
            return self.batch.handle_to_row[handle]
        except KeyError:
            raise StepProtocolError(f"handle {handle} is not in the running batch") from None

    def apply(self, diff: SchedulerOutput) -> None:
        """The diff's membership and block parts, in protocol order; the batch ends dense.
        Costs Python per change, none per unchanged request."""
        batch, states = self.batch, self.states
        for handle in diff.finished_handles:
            if handle in batch.handle_to_row:
                batch.remove(handle)
            states.pop(handle, None)
        for handle in diff.preempted_handles:
            self._give_up_row(handle)     # keeps states[handle]: its tokens are recomputed
        for new in diff.new_requests:
            # A decoded prompt is a read-only array: kept as it is (never written, and copied
            # into the row by one slice); a list is copied, the diff's own stays the diff's.
            prompt = new.prompt_token_ids
            state = CachedRequestState(new.handle,
                                       prompt if hasattr(prompt, "dtype") else list(prompt),
                                       new.sampling,
                                       list(new.block_ids), new.num_computed_tokens,
                                       new.num_logprobs, new.constraint,
                                       pooling=new.pooling, lora_id=new.lora_id)
            states[new.handle] = state
            batch.add(state)
        for res in diff.resumed_requests:
            state = states[res.handle]
            state.block_ids = list(res.block_ids)
            state.num_computed_tokens = res.num_computed_tokens
            batch.add(state)
        if diff.new_block_ids:
            self._append_blocks(diff.new_block_ids)
        for handle, block_ids in diff.new_window_block_ids.items():
            if batch.window_table is None:
                raise StepProtocolError(f"new_window_block_ids[{handle}]: this model has no "
                                        "window group (not a hybrid model)")
            batch.append_window_block_ids(self.row(handle), block_ids)
        batch.condense()

    def _give_up_row(self, handle: int) -> None:
        """Take a preempted request out of the batch; its state keeps what the row knew."""
        state, batch = self.states[handle], self.batch
        row = self.row(handle)
        state.output_token_ids = batch.output_ids(handle)
        state.block_ids = batch.block_table[row, :batch.num_blocks[row]].tolist()
        state.num_computed_tokens = int(batch.num_computed[row])
        batch.remove(handle)

    def _append_blocks(self, new_block_ids: dict[int, list[int]]) -> None:
        """Append blocks to rows: one vectorised write when each request gets one block (the
        usual step), else row by row."""
        rows = [self.row(handle) for handle in new_block_ids]
        lists = list(new_block_ids.values())
        if all(len(ids) == 1 for ids in lists):
            self.batch.append_one_block_each(rows, [ids[0] for ids in lists])
            return
        for row, block_ids in zip(rows, lists):
            self.batch.append_block_ids(row, block_ids)

    def record(self, handles: list[int], positions: np.ndarray, token_ids: np.ndarray,
               rows: np.ndarray | None = None) -> list[int]:
        """Write sampled ids into the batch rows (where the request is still there); returns
        them as a list. `rows`: their rows when the batch layout is the one they were launched
        at (no lookups). A request preempted since the launch gets its token in its cached
        state; one finished since, nowhere."""
        batch, ids = self.batch, token_ids.tolist()
        if rows is not None:
            batch.write_sampled(rows, positions, token_ids)
            return ids
        rows_of = batch.handle_to_row
        live = [i for i, h in enumerate(handles) if h in rows_of]
        if live:
            at = np.array([rows_of[handles[i]] for i in live], dtype=np.int64)
            batch.write_sampled(at, positions[live], token_ids[live])
        if len(live) < len(handles):
            for handle, tok in zip(handles, ids):
                state = self.states.get(handle)
                if state is not None and handle not in rows_of:
                    state.output_token_ids.append(tok)
        return ids

    def digest(self, handles: list[int], sampled_ids: list[int], extra: bytes) -> bytes:
        """BLAKE2b (16 bytes) of a step's sampled ids and the cached state: per batch row the
        handle, num_computed, num_tokens and last token id; then `extra`. Nothing in it depends
        on the rank or the TP size."""
        b, n = self.batch, self.batch.num_reqs
        rows = np.arange(n)
        last = b.token_ids[rows, np.maximum(b.num_tokens[:n], 1) - 1]
        h = hashlib.blake2b(digest_size=16)
        for part in (handles, sampled_ids, [-1 if x is None else x for x in b.handles[:n]],
                     b.num_computed[:n], b.num_tokens[:n], last):
            h.update(np.asarray(part, dtype=np.int64).tobytes())
            h.update(b"|")
        h.update(extra)
        return h.digest()

    def clear(self) -> None:
        """Drop every request (a new epoch)."""
        for handle in list(self.batch.handle_to_row):
            self.batch.remove(handle)
        self.batch.condense()
        self.states.clear()
