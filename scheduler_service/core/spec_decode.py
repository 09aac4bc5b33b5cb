"""Speculative decoding on the scheduler side (docs/speculative-decoding.md): n-gram drafts
added to a step's decodes, and the verified tokens applied back.

Scheduling: after the running batch is scheduled (scheduler.py's hot loop, untouched), each
request that samples this step with one token and may draft gets up to k drafts
(spec_proposer.py), capped by its max_tokens / max_len and the step's budget: its count
becomes 1 + k, its KV slots grow by k (a request that cannot get the blocks drafts nothing:
drafts never preempt, and a step that preempted has none), and num_computed_tokens counts
them, as the step is assumed to run. The prefix cache offers only blocks full of known
tokens (KVCacheManager.grow_slots), so a block holding a draft is never cached.

Async scheduling (a step in flight when the next is scheduled): drafts count as pending
tokens, and a request with tokens pending drafts over them: its proposal assumes the step in
flight's drafts all accepted and guesses its last token (`_propose`); the diff's spec_assumed
carries that, the workers drop drafts whose assumption fails (the handle then makes one token),
and `apply` learns the same from the step before, so the next proposal assumes one token.

Update: the workers reply with the accepted drafts and one more token under the handle;
num_computed_tokens drops by the rejected drafts (their KV slots are written again by the
next step; the blocks stay with the request until it ends). The stop rules see each token in
order and cut the run where one-token decoding would have stopped.

Who drafts: every request that decodes (greedy and sampled, with penalties, min_tokens,
logit_bias, token-id sets, a structured-output grammar, top alternatives). The workers verify a
draft by the draw one-token decoding would make at its position (argmax, or the seeded
Gumbel-max draw with that token's counter, the penalties' history, min_tokens and the grammar's
mask after the drafts before it), so their tokens are exactly those of decoding without drafts,
and for sampled requests this is the rejection sampler of an n-gram (probability-1) draft. A
handle's top alternatives come k per token it produced, token after token (`_per_token`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine_common.configuration.speculative import SpeculativeConfig
from engine_common.wire.diff import RunnerOutput
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.sampled_tokens import (attach_prompt_results, fail_on_worker,
                                                  finish_pooled)
from scheduler_service.core.scheduler_diff import StepPlan
from scheduler_service.core.spec_proposer import TokenBuffers, propose_ngram
from scheduler_service.core.step_result import TokenUpdate, check_stop

_PREEMPTED = int(RequestStatus.PREEMPTED)
_RUNNING = RequestStatus.RUNNING


@dataclass
class SpecStats:
    """vLLM's spec decode counters: drafting requests-steps, draft tokens, accepted drafts, and
    the accepted ones per draft position; counted as the workers verified them. Ours:
    requests-steps whose drafts the workers dropped (async scheduling: the guess over the step
    in flight failed), counted in none of vLLM's."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_dropped: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(slots=True)
class _Sent:
    """One request's drafts in one step: the ids, what they assumed of the step before (async
    scheduling: [num tokens, last token], or None), and whether that held (set when the step
    before is applied; the workers drop drafts whose assumption failed)."""

    ids: list[int]
    assumed: list[int] | None = None
    valid: bool = True


class SpecDecoder:
    """The proposer, the drafts of the steps in flight and the counters."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._buffers = TokenBuffers()
        self._drafts: dict[int, dict[int, _Sent]] = {}     # step -> handle -> drafts sent

    def add_drafts(self, step: int, plan: StepPlan, kv: KVCacheManager) -> None:
        """Drafts for the step's one-token decodes (see the module docstring), into `plan`.
        None in a step that preempted: the blocks freed are for the request preempted for
        (priority) or the batch (memory), not for drafts; none in a step of more requests than
        the config's disable_by_batch_size."""
        c = self.config
        if plan.preempted_handles or (c.disable_by_batch_size is not None
                                      and len(plan.work) > c.disable_by_batch_size):
            self._buffers.end_round()
            return
        counts, sent = plan.counts, {}
        in_flight = self._drafts.get(step - 1, {})
        for handle, request in plan.work.items():
            if handle in counts or plan.budget <= 0:
                continue
            drafts = self._propose(request, in_flight.get(handle), plan.budget)
            # (its num_computed_tokens counts the step's own token already: nothing to free)
            if drafts is None or (new_ids := kv.grow_slots(
                    request, len(drafts.ids), free_skipped=False)) is None:
                continue
            k = len(drafts.ids)
            if new_ids:
                plan.new_block_ids.setdefault(handle, []).extend(new_ids)
            request.num_computed_tokens += k
            request.num_pending_tokens += k      # at most k more outputs in flight
            counts[handle] = 1 + k
            plan.budget -= k
            plan.spec_token_ids[handle] = drafts.ids
            if drafts.assumed is not None:
                plan.spec_assumed[handle] = drafts.assumed
            sent[handle] = drafts
        self._buffers.end_round()
        if sent:
            self._drafts[step] = sent

    def _propose(self, request: Request, before: _Sent | None, budget: int) -> _Sent | None:
        """The request's drafts this step, or None. It samples this step with one token when
        its computed tokens then reach all but the one it samples: known + pending - 1 (pending
        counts this step's token). Tokens pending from the step in flight (async scheduling:
        its drafts, assumed accepted, then one unknown token) are guessed: the proposal over
        the known tokens and those drafts is asked for one more token, whose first is the guess
        (`assumed`), and the workers keep the drafts only if the guess and the length hold."""
        num_known = len(request.prompt_token_ids) + len(request.output_token_ids)
        pending = request.num_pending_tokens
        if pending < 1 or request.num_computed_tokens + 1 != num_known + pending:
            return None           # not sampling its next token with one token this step
        if pending > 1 and pending != 2 + (len(before.ids) if before is not None else 0):
            return None           # pending from a step this decoder did not see
        # Drafts in flight whose own assumption already failed (known since the step before
        # was applied) are dropped by the workers: that step makes one token.
        flight = before.ids if before is not None and before.valid else []
        k = min(self.config.num_speculative_tokens, budget,
                request.max_num_output_tokens - len(request.output_token_ids) - pending)
        if k <= 0:
            return None
        c, tokens = self.config, self._buffers.tokens(request)
        if pending == 1:
            ids = propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
            return _Sent(ids.tolist()) if len(ids) else None
        if flight:
            tokens = np.concatenate([tokens, np.asarray(flight, dtype=np.int32)])
        ids = propose_ngram(tokens, k + 1, c.prompt_lookup_min, c.prompt_lookup_max)
        if len(ids) < 2:
            return None
        return _Sent(ids[1:].tolist(), [len(tokens) + 1, int(ids[0])])

    def apply(self, step: int, scheduled: dict[int, Request], runner_out: RunnerOutput,
              finish: Callable[[Request, RequestStatus], None],
              max_len: int) -> list[TokenUpdate]:
        """sampled_tokens.apply_sampled_tokens for a step that may hold drafts: a handle's
        consecutive entries are its tokens, applied in order, in one update. The drafts of the
        next step (in flight) that assumed these tokens are checked against them."""
        drafted = self._drafts.pop(step, {})
        following = self._drafts.get(step + 1)
        updates = []
        if runner_out.request_errors:
            updates = fail_on_worker(scheduled, runner_out.request_errors, finish)
        handles, ids, tops = runner_out.handles, runner_out.sampled_token_ids, \
            runner_out.top_logprobs
        lps = runner_out.logprobs
        i, n = 0, len(handles)
        while i < n:
            handle, j = handles[i], i + 1
            while j < n and handles[j] == handle:
                j += 1
            tokens, logprobs = ids[i:j], (lps[i:j] if lps else [])
            i = j
            request = scheduled.get(handle)
            if request is None or request.status > _PREEMPTED:   # finished since scheduled
                continue
            sent = drafted.get(handle)
            if sent is not None:
                rejected = len(sent.ids) + 1 - len(tokens)
                request.num_pending_tokens -= rejected
                if request.status is _RUNNING:
                    request.num_computed_tokens -= rejected
                if sent.valid:           # drafts the workers verified (not dropped)
                    self._count(len(sent.ids), len(tokens) - 1)
                else:
                    self.stats.num_dropped += 1
            update = self._append(request, handle, tokens, logprobs, tops, finish, max_len)
            if update is not None:
                updates.append(update)
            nxt = following and following.get(handle)
            if nxt and nxt.assumed is not None and request.status <= _PREEMPTED:
                num, last = nxt.assumed
                nxt.valid = request.num_tokens == num and request.output_token_ids[-1] == last
        if runner_out.prompt_logprobs:
            attach_prompt_results(scheduled, runner_out, updates)
        if runner_out.pooled:
            updates += finish_pooled(scheduled, runner_out.pooled, finish)
        return updates

    def _count(self, num_drafts: int, accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        for pos in range(accepted):
            stats.accepted_per_pos[pos] += 1

    @staticmethod
    def _append(request: Request, handle: int, tokens: list[int], logprobs: list[float],
                tops: dict, finish, max_len: int) -> TokenUpdate | None:
        """Append the tokens one by one under the stop rules; the request's update."""
        output, taken = request.output_token_ids, 0
        for token in tokens:
            if request.num_pending_tokens:
                request.num_pending_tokens -= 1
            output.append(token)
            taken += 1
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            if token in request.stop_token_ids or len(output) >= request.max_num_output_tokens:
                status = check_stop(request, max_len)
                if status is not None:
                    finish(request, status)
                    top = _per_token(tops, handle, len(tokens))
                    return TokenUpdate.final(request, tokens[:taken], list(logprobs[:taken]),
                                             None if top is None else top[:taken])
        held = request.held_logprobs
        if held is not None:
            held.extend(logprobs)
            return None
        return TokenUpdate(
            request.request_id, list(tokens), list(logprobs),
            _per_token(tops, handle, len(tokens)),
            None, None, request.num_cached_tokens, request.first_scheduled_time,
            request.first_token_time, None, request)


def _per_token(tops: dict, handle: int, n: int) -> list[tuple[list[int], list[float]]] | None:
    """The handle's top alternatives split per token: the workers send a handle that produced
    n tokens n * k of each, token after token (the codec checks the multiple)."""
    top = tops.get(handle) if tops else None
    if top is None:
        return None
    ids, lps = top
    k = len(ids) // n
    return [(ids[t * k:(t + 1) * k], lps[t * k:(t + 1) * k]) for t in range(n)]
