"""SimWorker with speculative drafts (docs/speculative-decoding.md), for driving the scheduler.

Each drafted request's drafts are computed as query tokens after its last token: the fake KV of
their positions names the draft-extended prefix. Verification is greedy against `sample_fn`
(the sim's "model": the token after a prefix): drafts are accepted while they equal it, then
one more token. So a block the scheduler caches while it holds a rejected draft's KV, or a slot
not written again after a rejection, fails the sim's KV read-back check (with a window, of the
positions the step's first query sees on, as SimWorker reads).
"""
from __future__ import annotations

from engine_common.wire.diff import RunnerOutput, SchedulerOutput
from tests.support.scheduler_sim import SimRequest, SimWorker


def periodic_sample(period: int = 3, noise_every: int = 0):
    """The token `period` back (a repeating output that n-gram drafts predict); with
    noise_every, every noise_every-th position (by length) a hashed token instead."""
    def sample(state: SimRequest) -> int:
        n = len(state.tokens)
        if n < period or (noise_every and n % noise_every == 0):
            return hash((state.seed, tuple(state.tokens))) % 500 + 100
        return state.tokens[n - period]
    return sample


class SpecSimWorker(SimWorker):
    """Also counts per step the tokens each request produced (`produced`); drops the drafts
    whose spec_assumed does not hold, as the runner does (spec_verify.held_drafts)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.produced: list[dict[int, int]] = []
        self.dropped = 0          # drafted handles whose assumption (spec_assumed) failed
        self.verified: list[tuple[int, int]] = []     # (drafts, accepted) per verified run

    def _virtual_prefix(self, state: SimRequest, drafts: list[int], pos: int) -> int:
        """The prefix id of position `pos` of tokens + drafts (never cached in state)."""
        num_known = len(state.tokens)
        if pos < num_known:
            return state.prefix_id(pos)
        pid = state.prefix_id(num_known - 1)
        for tok in drafts[:pos - num_known + 1]:
            pid = hash((pid, tok))
        return pid

    def _sample_after(self, state: SimRequest, extra: list[int]) -> int:
        saved = state.tokens
        state.tokens = saved + extra
        try:
            return self.sample_fn(state)
        finally:
            state.tokens = saved

    def _run(self, out: SchedulerOutput) -> RunnerOutput:
        assert not self.compiling, "SpecSimWorker does not compile grammars"
        drafts, counts = dict(out.spec_token_ids), dict(out.num_scheduled_tokens)
        for h, (num, last) in out.spec_assumed.items():   # async: drafts over a step before
            tokens = self.reqs[h].tokens
            if len(tokens) != num or tokens[-1] != last:
                del drafts[h]
                counts[h] = 1
                self.dropped += 1
        work = [(self.reqs[h], counts.get(h, 1)) for h in self.batch]
        work = [(s, n) for s, n in work if n > 0]
        self.step_tokens.append({s.handle: n for s, n in work})
        for state, n in work:
            d = drafts.get(state.handle, [])
            end = state.num_computed + n
            assert end <= len(state.tokens) + len(d), f"handle {state.handle}: past its tokens"
            if d:
                assert end == len(state.tokens) + len(d), "drafts not all scheduled"
            assert len(state.block_ids) * self.block_size >= end, "block table too short"
            for pos in range(state.num_computed, end):
                self.kv[self._slot(state, pos)] = self._virtual_prefix(state, d, pos)
        result, produced = RunnerOutput(out.step), {}
        for state, n in work:
            d = drafts.get(state.handle, [])
            first = max(0, state.num_computed - self.window + 1) if self.window else 0
            state.num_computed += n
            num_known = len(state.tokens)
            if state.num_computed < num_known:        # a prefill chunk
                assert all(self.kv[self._slot(state, p)] == state.prefix_id(p)
                           for p in range(first, state.num_computed)), \
                    f"handle {state.handle}: KV"
                continue
            tokens = []
            for j in range(len(d) + 1):
                tokens.append(self._sample_after(state, d[:j]))
                if j == len(d) or tokens[-1] != d[j]:
                    break
            state.num_computed = num_known + len(tokens) - 1     # rejected drafts undone
            state.tokens += tokens
            for pos in range(first, state.num_computed):
                assert self.kv[self._slot(state, pos)] == state.prefix_id(pos), (
                    f"handle {state.handle}: wrong KV at position {pos}")
            produced[state.handle] = len(tokens)
            if d:
                self.verified.append((len(d), len(tokens) - 1))
            for tok in tokens:
                result.handles.append(state.handle)
                result.sampled_token_ids.append(tok)
                result.logprobs.append(-0.5)
        self.produced.append(produced)
        return result
