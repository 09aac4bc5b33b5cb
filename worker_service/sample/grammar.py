"""Structured output on the worker: compiled grammars, one matcher per constrained request, and
the token masks computed from them, identically on every rank.

A mask depends only on the constraint and the ids the request sampled, and every rank samples
the same ids, so every rank computes the same masks itself: nothing about grammars travels on the
step diff after the constraint itself (sent once, with the new request).

Per step (the model runner drives it):
    start_masks(handles)  -> on a helper thread, while the forward pass runs: the masks of the
                             sampling rows whose request is constrained (GrammarMasks)
    the sampler           -> -inf outside each row's mask (sampler.apply_grammar_bias: the mask
                             as a 0 / -inf bias, unpacked on the helper thread on CPU)
    advance(handles, ids) -> after the read-back: every matcher consumes its sampled id
A speculative step also masks every draft position of a constrained row: walk_drafts (before
the step's inputs: spec_verify.grammar_trim) and the masks of each position
(grammar_drafts.py); advance then
consumes the accepted run.

Bitmask layout (llguidance's and xgrammar's): int32 [rows, ceil(vocab / 32)]; token t is allowed
when bit (t % 32) of word t // 32 is set. Ids past the tokenizer's vocabulary are never allowed.

Compiling is off the step path (docs/structured-output.md, "Compiling off the step"): a new
constraint is compiled on the compile thread, the request's matcher is made from it the first
time its row samples (blocking then only if it is not done, which the scheduler avoids by never
scheduling that row's sampling before the output rank reported the handle compiled:
`newly_compiled`, sent back in RunnerOutput.compiled_handles). Resolving a matcher only where a
row samples keeps every rank's state, and so its digest, the same whenever its compile ends.

When a grammar is complete and nothing may follow, its mask allows only the eos ids, so the
request ends with STOP_TOKEN. Once an eos id is sampled the constraint is done (`terminated`): the
row is masked no more (with ignore_eos it goes on unconstrained, as in vLLM). A preempted request
drops its matcher; on resumption the matcher is rebuilt by replaying the request's output ids.

A grammar that fails mid-request (no compile on this worker, the matcher's error state, a mask
that leaves none of the row's allowed_token_ids, a mask offering only special tokens before the
text is complete) fails that request alone: `take_errors` hands
it to RunnerOutput.request_errors and the scheduler ends it with the error
(docs/structured-output.md, "A grammar that fails on the worker").
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
from dataclasses import dataclass
from typing import Sequence

import llguidance
import numpy as np

from engine_common.constraints.constraint import Constraint
from worker_service.sample.grammar_compiler import GrammarCompiler
from worker_service.sample.grammar_checks import mask_failure
from worker_service.sample.grammar_drafts import DraftWalk, fill_masks, walk

__all__ = ["GrammarBook", "GrammarCompiler", "GrammarMasks", "RequestGrammar", "bitmask_bias"]

log = logging.getLogger(__name__)


# byte value -> the bias of its 8 ids (bit j of the byte is id 8b + j): 0 allowed, -inf not.
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                    bitorder="little").astype(bool),
                      np.float32(0), np.float32(-np.inf)).astype(np.float32)


def bitmask_bias(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """float32 [K, vocab]: the bitmask as an additive bias (0 allowed, -inf not)."""
    k = bitmask.shape[0]
    return np.ascontiguousarray(_BYTE_BIAS[bitmask.view(np.uint8)].reshape(k, -1)[:, :vocab_size])


@dataclass
class RequestGrammar:
    """One constrained request's matcher and how far it got. `error`: the grammar failed here
    (it did not compile on this worker, a library or tokenizer fault since admission validated
    it; its matcher entered its error state; or the step left no id to sample): the request is
    reported once in `take_errors`, the scheduler ends it with that error, and until then its
    mask allows only eos (no matcher) or what the failed matcher allows, and it consumes
    nothing more. The step goes on for the others."""

    matcher: llguidance.LLMatcher | None
    num_consumed: int = 0          # output ids the matcher has seen
    terminated: bool = False       # an eos id was sampled: the constraint is done
    # Until its row first samples: the compiled grammar's Future and the ids to replay then.
    compiling: concurrent.futures.Future | None = None
    replay: Sequence[int] = ()
    error: str | None = None

    @property
    def stopped(self) -> bool:
        """Complete (or failed): only eos may follow."""
        return self.matcher is None or self.matcher.is_stopped()


@dataclass
class GrammarMasks:
    """One step's masks: row `indices` (into the step's sampling rows), their bitmask, and
    (when asked for: a CPU device) the same as an additive bias, unpacked on the helper thread."""

    indices: np.ndarray            # int64 [K]
    bitmask: np.ndarray            # int32 [K, ceil(vocab / 32)]
    bias: np.ndarray | None = None  # float32 [K, vocab]: 0 allowed, -inf not
    all_rows: bool = False         # indices == every sampling row, in order


class GrammarBook:
    """The matchers of the cached requests that carry a constraint, by handle."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        # every cached constrained request: its compiled grammar (a Future)
        self._constraints: dict[int, concurrent.futures.Future] = {}
        self._live: dict[int, RequestGrammar] = {}      # those in the batch
        self._unreported: set[int] = set()    # handles whose compile end is not reported yet
        # handle -> why its grammar failed, not reported yet (take_errors). Written on the step
        # thread and on the mask thread, read only after the step joined the masks.
        self._errors: dict[int, str] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._last_masks_digest = b""
        # handle -> (draft position, why) of a mask failure past position 0 this step: it
        # fails the request only if the accepted run reaches that position (advance)
        self._deferred: dict[int, tuple[int, str]] = {}

    # -- membership (the diff) ------------------------------------------------------------------

    def add(self, handle: int, constraint: Constraint | None,
            output_token_ids: Sequence[int] = ()) -> None:
        """A new request: its grammar starts compiling (or is cached); its matcher is made, and
        replays `output_token_ids`, when its row first samples."""
        if constraint is None:
            return
        compiled = self.compiler.prepare(constraint)
        self._constraints[handle] = compiled
        self._unreported.add(handle)
        self._live[handle] = RequestGrammar(None, compiling=compiled, replay=output_token_ids)

    def resume(self, handle: int, output_token_ids: Sequence[int]) -> None:
        """A preempted request back in the batch: a new matcher replays its output ids."""
        if handle in self._constraints:
            self._live[handle] = RequestGrammar(None, compiling=self._constraints[handle],
                                                replay=list(output_token_ids))

    def preempt(self, handle: int) -> None:
        self._live.pop(handle, None)

    def finish(self, handle: int) -> None:
        self._live.pop(handle, None)
        self._constraints.pop(handle, None)
        self._unreported.discard(handle)
        self._errors.pop(handle, None)

    def apply(self, diff, requests) -> None:
        """A step's diff (a SchedulerOutput; `requests`: the cached states by handle)."""
        for handle in diff.finished_handles:
            self.finish(handle)
        for handle in diff.preempted_handles:
            self.preempt(handle)
        for new in diff.new_requests:
            self.add(new.handle, new.constraint)
        for res in diff.resumed_requests:
            self.resume(res.handle, requests[res.handle].output_token_ids)

    def clear(self) -> None:
        self._live.clear()
        self._constraints.clear()
        self._unreported.clear()
        self._errors.clear()

    def take_errors(self) -> dict[int, str]:
        """handle -> why its grammar failed, for each request whose grammar failed since the
        last call (RunnerOutput.request_errors). Every rank decides them alike: the same
        constraint, ids and masks give the same failures; the scheduler reads the output
        rank's."""
        errors, self._errors = self._errors, {}
        return errors

    def newly_compiled(self, wait_s: float = 0.0) -> list[int]:
        """Handles whose grammar finished compiling (or failing) since the last call, sorted;
        waits up to `wait_s` for one when none has (a step with nothing else to do)."""
        if not self._unreported:
            return []
        if wait_s > 0 and not any(self._constraints[h].done() for h in self._unreported):
            concurrent.futures.wait([self._constraints[h] for h in self._unreported], wait_s,
                                    concurrent.futures.FIRST_COMPLETED)
        done = sorted(h for h in self._unreported if self._constraints[h].done())
        self._unreported.difference_update(done)
        return done

    def __bool__(self) -> bool:
        return bool(self._live)

    # -- one step -------------------------------------------------------------------------------

    def stopped(self, handles: Sequence[int]) -> np.ndarray | None:
        """bool per handle: its grammar is complete (only eos allowed), so min_tokens must not
        mask eos; None when no row is constrained."""
        if not self._live:
            return None
        return np.array([(g := self._masked(h)) is not None and g.stopped for h in handles],
                        dtype=bool)

    def walk_drafts(self, handles: Sequence[int], drafts: Sequence[list[int]]
                    ) -> dict[int, DraftWalk]:
        """Per drafted constrained handle, its grammar walked through its drafts (the matcher
        left where it was; grammar_drafts.py), its matcher resolved first (a drafted row
        always samples: SpecStep.unstage)."""
        walks = {}
        for handle, ids in zip(handles, drafts):
            state = self._masked(handle)
            if state is None:
                continue
            matcher = None if state.error is not None else state.matcher
            try:
                walks[handle] = walk(matcher, list(ids), self.compiler.eos_token_ids)
            except Exception as e:        # a library fault: this request fails, not the step
                self._fail(handle, state, f"its grammar failed on drafts: {_first_line(str(e))}")
                walks[handle] = walk(None, list(ids), self.compiler.eos_token_ids)
        return walks

    def start_masks(self, handles: Sequence[int], bias: bool = False,
                    allowed: Sequence[Sequence[int]] | None = None,
                    walks: dict[int, DraftWalk] | None = None, num_draws: int | None = None
                    ) -> concurrent.futures.Future | None:
        """Compute the masks of `handles` on the helper thread (a Future of GrammarMasks, with
        the additive bias too when `bias`); None when no handle is constrained. `allowed`: per
        handle its allowed_token_ids (empty: every id); a constrained row whose mask allows
        none of them fails (nothing could be sampled but a -inf row's argmax). `walks`: the
        drafted handles' (walk_drafts, their `draws` set): a mask per draft position too, of
        the step's `num_draws` draws (default: one per handle)."""
        walks = walks or {}
        jobs = [(i, self._live[h], walks.get(h)) for i, h in enumerate(handles)
                if self._masked(h)]
        self._deferred = {}
        if not jobs:
            self._last_masks_digest = b""
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-masks")
        handles_of = [handles[i] for i, _, _ in jobs]
        allowed_of = None if allowed is None else [allowed[i] for i, _, _ in jobs]
        return self._pool.submit(self._masks, jobs, handles_of, allowed_of,
                                 len(handles) if num_draws is None else num_draws, bias)

    def _masks(self, jobs, handles, allowed, num_rows: int, bias: bool) -> GrammarMasks:
        masks = self.compute_masks(jobs)
        masks.all_rows = len(masks.indices) == num_rows and bool(
            (masks.indices == np.arange(num_rows)).all())
        self._check_masks(jobs, handles, allowed, masks.bitmask)
        if bias:
            masks.bias = bitmask_bias(masks.bitmask, self.compiler.vocab_size)
        return masks

    def compute_masks(self, jobs: list[tuple]) -> GrammarMasks:
        """The masks of `jobs` ((sampling index, state, walk or None) each): one row per
        job, or one per masked draft position of a walk, indexed by their draws."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = -(-self.compiler.vocab_size // 32)
        indices, firsts = [], []
        for i, _, w in jobs:
            firsts.append(len(indices))
            indices += [i] if w is None else [w.draws[p] for p in w.masked_positions]
        bitmask = np.zeros((len(indices), words), dtype=np.int32)
        fill_masks(self._executor, [(g.matcher, row, w) for (_, g, w), row in zip(jobs, firsts)],
                   bitmask)
        ends = firsts[1:] + [len(indices)]
        for (_, g, w), row, end in zip(jobs, firsts, ends):
            if g.matcher is None:
                for eos in self.compiler.eos_token_ids:
                    bitmask.view(np.uint32)[row:end, eos // 32] |= np.uint32(1 << eos % 32)
        self._last_masks_digest = hashlib.blake2b(bitmask.tobytes(), digest_size=16).digest()
        return GrammarMasks(np.array(indices, dtype=np.int64), bitmask)

    def _check_masks(self, jobs, handles: Sequence[int], allowed, bitmask: np.ndarray) -> None:
        """Record the rows whose grammar failed computing this mask (a resource limit: the
        matcher is now in its error state) or whose mask leaves none of their allowed ids;
        at a draft position p >= 1 only once the step's accepted run reaches it (`advance`)."""
        bits, row = bitmask.view(np.uint32), 0
        for k, ((_, g, w), handle) in enumerate(zip(jobs, handles)):
            ids = None if allowed is None or not len(allowed[k]) else \
                np.asarray(allowed[k], dtype=np.int64)
            positions = [0] if w is None else w.masked_positions
            first, row = row, row + len(positions)
            if g.error is not None:
                continue
            m = g.matcher
            if m is not None and m.is_error():
                self._fail(handle, g, f"its grammar failed: {_first_line(m.get_error())}")
                continue
            for at, p in enumerate(positions):
                if w is not None and not w.reached(p):
                    break         # never reached: its draft is refused, or a mask failed
                accepting = m is None or (m.is_accepting() if w is None else w.accepting[p])
                why = mask_failure(self.compiler.tokenizer, bits[first + at], accepting, ids)
                if why is not None:
                    if p == 0:
                        self._fail(handle, g, why)
                    else:
                        self._deferred[handle] = (p, why)
                    break

    def _fail(self, handle: int, state: RequestGrammar, why: str) -> None:
        state.error = why
        self._errors[handle] = why
        log.warning("request handle %d: structured output failed: %s", handle, why)

    def advance(self, handles: Sequence[int], token_ids: Sequence[int]) -> None:
        """Every constrained request consumes the ids it sampled (a drafted one: its accepted
        run, in order); a failure found at a draft position counts once the run reaches it."""
        deferred, self._deferred = self._deferred, {}
        if not self._live:
            return
        at = 0                     # the token's index in its handle's run this step
        for i, (handle, token_id) in enumerate(zip(handles, token_ids)):
            state = self._live.get(handle)
            if state is not None:
                if state.compiling is not None:     # sampled without masks: never expected
                    self._resolve(handle, state)
                if deferred:
                    at = at + 1 if i and handles[i - 1] == handle else 0
                    failed = deferred.get(handle)
                    if failed is not None and failed[0] == at and state.error is None:
                        self._fail(handle, state, failed[1])
                self._consume(handle, state, token_id)

    def digest(self) -> bytes:
        """The matchers' state for verify_symmetry: per constrained request (by handle) the ids
        consumed, terminated/stopped/accepting/error, and the last step's masks."""
        h = hashlib.blake2b(digest_size=16)
        for handle in sorted(self._live):
            g, m = self._live[handle], self._live[handle].matcher
            if g.compiling is not None:          # not resolved: the same on every rank
                h.update(np.array([handle, -1], dtype=np.int64).tobytes())
                continue
            flags = [True, False, True] if m is None else [m.is_stopped(), m.is_accepting(),
                                                          m.is_error()]
            h.update(np.array([handle, g.num_consumed, g.terminated, *flags,
                               g.error is not None], dtype=np.int64).tobytes())
        h.update(self._last_masks_digest)
        return h.digest()

    # -- internals ------------------------------------------------------------------------------

    def _masked(self, handle: int) -> RequestGrammar | None:
        """The state of a sampling row's request, its matcher resolved; None if unconstrained
        or done."""
        state = self._live.get(handle)
        if state is not None and state.compiling is not None:
            self._resolve(handle, state)
        return None if state is None or state.terminated else state

    def _resolve(self, handle: int, state: RequestGrammar) -> None:
        """Its row samples: the matcher from the compiled grammar (waiting for the compile if
        the scheduler did not), then the replayed ids."""
        try:
            state.matcher = state.compiling.result().deep_copy()
        except Exception as e:           # never fail the step for one request's grammar
            log.exception("request handle %d: its constraint did not compile", handle)
            self._fail(handle, state, "its grammar did not compile on the worker: "
                       f"{_first_line(str(e)) or type(e).__name__}")
        state.compiling = None
        for token_id in state.replay:
            self._consume(handle, state, token_id)
        state.replay = ()

    def _consume(self, handle: int, state: RequestGrammar, token_id: int) -> None:
        state.num_consumed += 1
        if state.terminated or state.error is not None:
            return
        if token_id in self.compiler.eos_token_ids:
            state.terminated = True
            return
        if state.matcher is None:
            return
        # Masked sampling never picks a refused id; one refused anyway (a replay, a library
        # fault) leaves the matcher in its error state: the request fails.
        if not state.matcher.consume_token(token_id):
            self._fail(handle, state, f"its grammar refused token {token_id}: "
                       f"{_first_line(state.matcher.get_error())}")


def _first_line(message: str, limit: int = 300) -> str:
    """llguidance's message without the parser state it appends, clipped."""
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit] + "..."
