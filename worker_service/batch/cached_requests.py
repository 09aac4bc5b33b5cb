"""The worker's cached requests by handle, and the batch rows of those running: a step's diff
applied to both (engine_common/wire/diff.py gives the order), and the sampled ids written back."""
from __future__ import annotations

import hashlib

import numpy as np

from engine_common.wire.diff import SchedulerOutput
from worker_service.batch.input_batch import CachedRequestState, InputBatch
from worker_service.failures import StepProtocolError


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
        """The diff's membership and block parts, in protocol order; the batch ends dense."""
        batch, states = self.batch, self.states
        for handle in diff.finished_handles:
            if handle in batch.handle_to_row:
                batch.remove(handle)
            states.pop(handle, None)
        for handle in diff.preempted_handles:
            batch.remove(handle)      # keeps states[handle]: its tokens are recomputed
        for new in diff.new_requests:
            state = CachedRequestState(new.handle, list(new.prompt_token_ids), new.sampling,
                                       list(new.block_ids), new.num_computed_tokens,
                                       new.num_logprobs, new.constraint)
            states[new.handle] = state
            batch.add(state)
        for res in diff.resumed_requests:
            state = states[res.handle]
            state.block_ids = list(res.block_ids)
            state.num_computed_tokens = res.num_computed_tokens
            batch.add(state)
        for handle, block_ids in diff.new_block_ids.items():
            states[handle].block_ids.extend(block_ids)
            batch.append_block_ids(self.row(handle), block_ids)
        batch.condense()

    def record(self, handles: list[int], positions: np.ndarray, token_ids: np.ndarray
               ) -> list[int]:
        """Write sampled ids into the batch rows (where the request is still there) and the
        cached states; returns them as a list. A request finished or preempted since the launch
        still gets its token in its cached state, when kept."""
        rows_of = self.batch.handle_to_row
        live = [i for i, h in enumerate(handles) if h in rows_of]
        if len(live) == len(handles):
            rows = np.fromiter((rows_of[h] for h in handles), dtype=np.int64, count=len(handles))
            self.batch.token_ids[rows, positions] = token_ids
        elif live:
            rows = np.array([rows_of[handles[i]] for i in live], dtype=np.int64)
            self.batch.token_ids[rows, positions[live]] = token_ids[live]
        states, ids = self.states, token_ids.tolist()
        for handle, tok in zip(handles, ids):
            state = states.get(handle)
            if state is not None:
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
