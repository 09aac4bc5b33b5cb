"""Speculative drafts on the worker (docs/speculative-decoding.md): staged as query tokens of
their request's row, verified by the sampler's own draw, and the accepted run written back.

A request with k drafts d_0..d_{k-1} after its T known tokens is scheduled 1 + k tokens:
positions T-1 (its last token) .. T+k-1 (its last draft). The step's one sampler call draws for
the step's sampling rows (a drafted row's draw there follows all k drafts: the bonus) and then
for every draft position j of every drafted row (`sampling_rows`), each with what one-token
decoding would use for that output token: the counter c + j (c the row's tokens generated
before the step; the bonus c + k), the penalties' history with drafts 0..j-1 in it, the
min_tokens mask of that length, the row's logit_bias and id sets (build_sampling_metadata's
`num_tokens`), and a constrained row's grammar mask after drafts 0..j-1 (grammar_drafts.py:
a draft the grammar forbids has a -inf logit there, so it is rejected). d_j is accepted while
the draw v_j == d_j; the step's tokens are the accepted drafts and then v_a at the first
mismatch a, or the bonus when all k match; each token's logprob and top alternatives are
those of its draw (`accept` names it). Since the noise is
a pure function of (seed, counter, vocab id), the tokens are those of decoding without drafts,
seeded or not (the scheduler gives an unseeded request its seed), greedy (the argmax, the
temperature-0 case) or sampled. The draft is one token with probability 1 (an n-gram), so this
is the rejection sampler exactly: d_j is kept with probability p(d_j), and on a mismatch v_a is
a draw of p given != d_a (the residual max(p - q, 0) normalised, q one-hot on d_a). The row's
KV of rejected drafts is left in place; num_computed drops to T + a, so the next step writes
those slots again. Every rank verifies alike (same logits, same noise): nothing is broadcast.

Async scheduling: the scheduler drafts for step t+1 before step t's tokens are back, assuming
step t's drafts all accepted and guessing its last token (diff.spec_assumed). The runner
finishes step t before launching step t+1 (needs_host_tokens), so the batch holds step t's
tokens: a row where the assumption holds is verified as above; one where it fails drops its
drafts and computes its one token at its true position (`held_drafts`), as a plain decode.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_common.wire.diff import SchedulerOutput
from worker_service.batch.cached_requests import CachedRequests
from worker_service.batch.input_batch import InputBatch
from worker_service.failures import StepProtocolError
from worker_service.step.step_inputs import StepInputs, prepare_step_inputs


def prepare_with_drafts(batch: InputBatch, cached: CachedRequests, diff: SchedulerOutput,
                        block_size: int, grammar=None) -> tuple[StepInputs, "SpecStep | None"]:
    """The step's model inputs for the applied `diff` (its counts per row; none named: one
    token each, the steady decode step), with its speculative drafts as query tokens (but
    those whose assumption failed: `held_drafts`; and a constrained row's drafts from the
    first its grammar refuses: `grammar_trim`, with `grammar` the runner's GrammarBook)."""
    num_scheduled = None
    if diff.num_scheduled_tokens:
        num_scheduled = np.ones(batch.num_reqs, dtype=np.int32)
        for handle, n in diff.num_scheduled_tokens.items():
            num_scheduled[cached.row(handle)] = n
    drafts, walks = diff.spec_token_ids, {}
    if diff.spec_assumed:
        drafts = held_drafts(batch, cached, diff)
    if grammar and drafts:
        drafts, walks = grammar_trim(drafts, grammar)
    for handle, sent in diff.spec_token_ids.items():
        if len(drafts.get(handle, ())) != len(sent):     # its row, where it really is
            num_scheduled[cached.row(handle)] = 1 + len(drafts.get(handle, ()))
    if not drafts:
        return prepare_step_inputs(batch, num_scheduled, block_size), None
    spec, inputs = SpecStep.stage(batch, cached, drafts, walks), None
    try:
        inputs = prepare_step_inputs(batch, num_scheduled, block_size)
    finally:
        spec.unstage(batch, inputs)
    return inputs, spec


def held_drafts(batch: InputBatch, cached: CachedRequests,
                diff: SchedulerOutput) -> dict[int, list[int]]:
    """diff.spec_token_ids without the drafts whose assumption failed: async scheduling drafts
    over the step before this one (its drafts all accepted, its last token guessed); a row
    that does not hold diff.spec_assumed's [num tokens, last token] after that step runs its
    one token instead. The batch holds that step's tokens (needs_host_tokens)."""
    drafts = dict(diff.spec_token_ids)
    for handle, (num, last) in diff.spec_assumed.items():
        row = cached.row(handle)
        n = int(batch.num_tokens[row])
        if n != num or int(batch.token_ids[row, n - 1]) != last:
            del drafts[handle]
    return drafts


def grammar_trim(drafts: dict[int, list[int]], grammar) -> tuple[dict, dict]:
    """(drafts, walks): each constrained row's drafts cut before the first its grammar refuses,
    and their DraftWalks (GrammarBook.walk_drafts). Its draw there cannot equal the refused
    draft, so the run always ends at that position: the drafts after it would never be
    reached, and that draw is the same as the bonus of the cut drafts (the same tokens before
    it, the same counter and mask). vLLM trims them in its scheduler (`validate_tokens`); the
    matchers live on the workers here, and every rank cuts alike. A row cut to no draft
    computes its one token. Drafts after an allowed eos are cut too: the request ends at that
    eos (or, with ignore_eos, goes on unconstrained), so they were forward work for tokens
    never kept; the draw after the eos is the cut drafts' bonus, the same token."""
    handles = list(drafts)
    walks = grammar.walk_drafts(handles, [drafts[h] for h in handles])
    kept = dict(drafts)
    for handle, w in list(walks.items()):
        if w.eos:                   # nothing after an allowed eos: it ends the request
            if w.valid + 1 < len(w.drafts):
                kept[handle] = w.drafts[:w.valid + 1]
                walks[handle] = w.cut_after_eos()
            continue
        if w.valid == len(w.drafts):
            continue
        if w.valid == 0:
            del kept[handle]
            del walks[handle]
            continue
        kept[handle] = w.drafts[:w.valid]
        walks[handle] = w.cut()
    return kept, walks


@dataclass
class SpecStep:
    """One step's drafted rows (batch row order as the diff named them)."""

    rows: np.ndarray                  # int64 [R] batch rows
    drafts: list[list[int]]           # per row, its draft ids
    ks: np.ndarray                    # int32 [R] drafts per row
    query_rows: np.ndarray | None = None   # int64 [sum k]: their verified query positions
    walks: dict | None = None         # handle -> DraftWalk of its constrained drafted rows

    @classmethod
    def stage(cls, batch: InputBatch, cached: CachedRequests,
              spec_token_ids: dict[int, list[int]], walks: dict | None = None) -> "SpecStep":
        """Write each request's drafts after its known tokens and count them as known while
        the step's inputs are prepared (`unstage` takes them back out of num_tokens)."""
        rows = np.array([cached.row(h) for h in spec_token_ids], dtype=np.int64)
        drafts = list(spec_token_ids.values())
        ks = np.array([len(d) for d in drafts], dtype=np.int32)
        width = batch.token_ids.shape[1]
        for row, ids in zip(rows.tolist(), drafts):
            start = int(batch.num_tokens[row])
            if start + len(ids) >= width:
                raise StepProtocolError(f"handle {batch.handles[row]}: {len(ids)} drafts after "
                                        f"{start} tokens pass max_model_len ({width})")
            batch.token_ids[row, start:start + len(ids)] = ids
        batch.num_tokens[rows] += ks
        return cls(rows, drafts, ks, walks=walks)

    def unstage(self, batch: InputBatch, inputs: StepInputs | None) -> None:
        """num_tokens as before `stage`; each drafted row must sample this step (its last
        known token and every draft scheduled); its verified query positions."""
        batch.num_tokens[self.rows] -= self.ks
        if inputs is None:
            return
        at = np.searchsorted(inputs.rows, self.rows)
        at = np.minimum(at, len(inputs.rows) - 1)
        ok = (inputs.rows[at] == self.rows) & inputs.sample_mask[at] \
            & (inputs.num_scheduled[at] == self.ks + 1)
        if not ok.all():
            bad = int(self.rows[np.flatnonzero(~ok)[0]])
            raise StepProtocolError(f"handle {batch.handles[bad]}: drafts must follow its last "
                                    "known token, all scheduled in this step")
        starts = inputs.query_start_loc[at].astype(np.int64)
        self.query_rows = np.repeat(starts, self.ks) + _ranges(self.ks)

    def sampling_rows(self, batch: InputBatch, sample_rows: np.ndarray,
                      grammar_done: np.ndarray | None, walks: dict | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """What the step's one sampler call draws for: the step's sampling rows (a drafted
        row's draw there follows its k drafts: the bonus), then each drafted row once per draft
        position j (after its drafts 0..j-1), in `query_rows` order; with the tokens known
        before each draw (build_sampling_metadata's `num_tokens`: the counter, the penalties'
        history, min_tokens) and `grammar_done` widened to them. `walks`: handle -> DraftWalk
        of the drafted constrained rows (grammar_drafts.py): their `stopped` per position
        goes into grammar_done, and each gets its positions' draw indices (`draws`)."""
        known = batch.num_tokens[sample_rows].copy()
        at = np.searchsorted(sample_rows, self.rows)
        known[at] += self.ks
        before = np.repeat(batch.num_tokens[self.rows], self.ks) + _ranges(self.ks)
        if grammar_done is not None:
            grammar_done = np.concatenate([grammar_done, np.zeros(len(before), dtype=bool)])
        if walks:
            n, lo = len(sample_rows), 0
            for j, (row, k) in enumerate(zip(self.rows.tolist(), self.ks.tolist())):
                w = walks.get(int(batch.handle_ids[row]))
                if w is not None:
                    w.draws = [*range(n + lo, n + lo + k), int(at[j])]
                    grammar_done[w.draws] = w.stopped
                lo += k
        return (np.concatenate([sample_rows, np.repeat(self.rows, self.ks)]),
                np.concatenate([known, before]), grammar_done)

    def walk_grammars(self, batch: InputBatch, grammar) -> dict:
        """The drafted rows' grammars walked through their drafts (GrammarBook.walk_drafts;
        walked already when the drafts were trimmed: `grammar_trim`)."""
        if self.walks is None:      # kept: `accept` reads a walk's `reach`
            self.walks = grammar.walk_drafts(batch.handle_ids[self.rows].tolist(), self.drafts)
        return self.walks

    def logits_rows(self, logits_indices: torch.Tensor) -> torch.Tensor:
        """The hidden rows the sampler reads, matching `sampling_rows`: the step's sampling
        rows, then every verified draft position."""
        extra = torch.as_tensor(self.query_rows, device=logits_indices.device)
        return torch.cat([logits_indices, extra])

    def accept(self, batch: InputBatch, handles: list[int], rows: np.ndarray,
               positions: np.ndarray, token_ids: np.ndarray):
        """The step's sampled rows expanded to every token they produced: (handles, rows,
        positions, draws, counts), a drafted row's accepted drafts then its last token, each
        token as the index of its draw in `token_ids` (the sampler's draws for
        `sampling_rows`: the step's rows, then the draft positions; its logprob and top
        alternatives are that draw's), and the tokens per sampled row; the rows' num_tokens
        and num_computed set to what was accepted."""
        n = len(handles)
        v = token_ids[n:]
        drafted = {int(r): i for i, r in enumerate(self.rows.tolist())}
        offsets = np.concatenate([[0], np.cumsum(self.ks)])
        out_h, out_r, out_p, out_d, counts = [], [], [], [], []
        for i, (handle, row) in enumerate(zip(handles, rows.tolist())):
            j = drafted.get(row)
            if j is None:
                out_h.append(handle), out_r.append(row), out_p.append(int(positions[i]))
                out_d.append(i), counts.append(1)
                continue
            k, lo = int(self.ks[j]), int(offsets[j])
            ver, drafts = v[lo:lo + k], self.drafts[j]
            a, last = 0, self._last_position(handle, k)
            while a < last and int(ver[a]) == drafts[a]:
                a += 1
            out_h += [handle] * (a + 1)
            out_r += [row] * (a + 1)
            out_p += range(int(positions[i]), int(positions[i]) + a + 1)
            out_d += [*range(n + lo, n + lo + a), n + lo + a if a < k else i]
            counts.append(a + 1)
            batch.num_tokens[row] += a                  # the launch counted one
            batch.num_computed[row] -= k - a            # the rejected drafts' slots
        return (out_h, np.array(out_r, dtype=np.int64), np.array(out_p, dtype=np.int32),
                np.array(out_d, dtype=np.int64), np.array(counts, dtype=np.int64))


    def _last_position(self, handle: int, k: int) -> int:
        """The last position the run of `handle`'s k drafts may reach: k (the bonus), or the
        `reach` of its grammar walk (a mask past it failed: the draw there ends the run)."""
        w = None if self.walks is None else self.walks.get(handle)
        return k if w is None or w.reach is None else min(k, w.reach)


def _ranges(ks: np.ndarray) -> np.ndarray:
    """0..k-1 for each k, laid end to end."""
    total = int(ks.sum())
    starts = np.repeat(np.cumsum(ks) - ks, ks)
    return np.arange(total, dtype=np.int64) - starts
