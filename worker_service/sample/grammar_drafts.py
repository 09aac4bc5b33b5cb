"""Grammar masks at speculative draft positions (docs/speculative-decoding.md, "Who drafts").

A constrained request with k drafts d_0..d_{k-1} is drawn at k + 1 positions in one step:
position p follows its known tokens and d_0..d_{p-1} (position k: the bonus). The mask at
position p is the grammar's after those drafts, so the matcher is walked through them:

    position   0        1            ...   valid                 valid+1 .. k
    state      now      after d_0    ...   after d_0..d_{valid-1} never reached: d_valid is
                                                                  forbidden at `valid`, so its
                                                                  draw differs and stops there
                                                                  (mask: a copy of `valid`'s)
or, when d_valid is an eos id the grammar allows there: positions after it are unconstrained
(the grammar is done, `terminated`, as when one-token decoding samples eos).

`walk` runs on the step thread before the step's inputs are prepared (spec_verify.grammar_trim
then cuts the drafts from `valid` on unless it is an allowed eos, so the runner never masks a
position past `valid`; the per-position `stopped` flags exempt eos from min_tokens) on a copy of
the matcher, which stays where it was; the
masks are computed on the mask helper thread (llguidance's draft-aware batch call advances each
matcher through `drafts[:valid]` and rolls it back). A mask's failure checks apply only to a
position the step reaches: position 0 at once, later ones when the accepted run reaches them
(GrammarBook.advance). After the step the matcher consumes what was accepted, one id at a
time, as without drafts, so it follows the tokens the worker actually kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import (fill_next_token_bitmask_par,
                              fill_next_token_bitmask_par_with_draft_tokens)


@dataclass
class DraftWalk:
    """One drafted constrained request's grammar over its drafts: `valid` drafts the matcher
    consumes in turn, whether the one after them is an allowed eos (`eos`: the positions after
    it are unconstrained), and per position 0..k whether the grammar is stopped (only eos may
    follow) and accepting there. `draws`: per position its index among the step's draws."""

    drafts: list[int]
    valid: int
    eos: bool
    stopped: list[bool]
    accepting: list[bool]
    draws: list[int] | None = None
    # The last position the run may reach: computing the mask after it failed (a resource
    # limit of llguidance, on a copy), so the draw here ends the run (SpecStep.accept).
    reach: int | None = None

    def reached(self, position: int) -> bool:
        """Whether the accepted run can reach `position` (its mask is checked then)."""
        return self.state_of(position) == position and (self.reach is None
                                                         or position <= self.reach)

    def state_of(self, position: int) -> int:
        """The position whose matcher state the mask at `position` uses (-1: unconstrained)."""
        if position <= self.valid:
            return position
        return -1 if self.eos else self.valid

    def cut(self) -> "DraftWalk":
        """The walk of `drafts[:valid]` alone (grammar_trim: the drafts from the refused one
        on are never sent to the model)."""
        n = self.valid + 1
        return DraftWalk(self.drafts[:self.valid], self.valid, False, self.stopped[:n],
                         self.accepting[:n])

    def cut_after_eos(self) -> "DraftWalk":
        """The walk of the drafts up to the allowed eos at `valid` (grammar_trim: a draft after
        it only computes a token the request never keeps, as it ends at that eos)."""
        n = self.valid + 2
        return DraftWalk(self.drafts[:self.valid + 1], self.valid, True, self.stopped[:n],
                         self.accepting[:n])

    @property
    def masked_positions(self) -> list[int]:
        """The positions that get a mask row, in order (all but those after an eos)."""
        return [p for p in range(len(self.drafts) + 1) if self.state_of(p) >= 0]


def walk(matcher: llguidance.LLMatcher | None, drafts: list[int],
         eos_ids: tuple[int, ...]) -> DraftWalk:
    """A copy of `matcher` (None: its grammar failed; only eos is masked in) walked through
    `drafts`; `matcher` itself is left as it was."""
    k = len(drafts)
    if matcher is None or matcher.is_error():
        stopped = [True] * (k + 1)
        return DraftWalk(drafts, 0, False, stopped, [matcher is None] * (k + 1))
    stopped, accepting = [matcher.is_stopped()], [matcher.is_accepting()]
    # Walked on a copy: a validated draft can still hit a resource limit when consumed (an
    # Earley row past max_items_in_row), and the error state never leaves a matcher; one-token
    # decoding fails only if it consumes that draft (advance does, when the run accepts it).
    probe = matcher.deep_copy()
    text = next((i for i, t in enumerate(drafts) if t in eos_ids), k)
    valid = probe.validate_tokens(drafts[:text]) if text else 0
    for i, token in enumerate(drafts[:valid]):
        if not probe.consume_token(token):
            valid = i                   # masked as a refused draft: allowed at `i`, not past
            break
        stopped.append(probe.is_stopped())
        accepting.append(probe.is_accepting())
    eos = valid == text < k and accepting[valid]
    # never reached (or unconstrained after an eos): the flags of `valid`, resp. off
    tail = [False] * (k - valid) if eos else [stopped[valid]] * (k - valid)
    atail = [False] * (k - valid) if eos else [accepting[valid]] * (k - valid)
    return DraftWalk(drafts, valid, eos, stopped + tail, accepting + atail)


def fill_masks(executor: llguidance.LLExecutor, jobs: list[tuple], bitmask: np.ndarray) -> None:
    """Fill `bitmask`: per job (matcher, first row, walk or None) the masks of its positions
    from its first row on (a walk's `masked_positions` in order; no walk: one row). A failed
    grammar (no matcher) is left for the caller; unreached positions copy `valid`'s row.

    The drafted masks are computed on copies of the matchers: llguidance may fail computing
    the mask at a draft position (a resource limit, e.g. too many Earley items), and the error
    state never leaves a matcher. Such a walk gets its `reach` (`_settle_failure`) and the
    matcher itself fails only if its own position 0 does, as one-token decoding would."""
    # (llguidance refuses an empty draft list: a walk with none valid is one plain mask)
    plain = [(m, row) for m, row, w in jobs if m is not None and (w is None or not w.valid)]
    drafted = [(m, row, w) for m, row, w in jobs if m is not None and w is not None and w.valid]
    copies = [(m.deep_copy(), row, w.drafts[:w.valid]) for m, row, w in drafted]
    if copies:
        # llguidance leaves a row past an invalid draft as it is: zeros here
        fill_next_token_bitmask_par_with_draft_tokens(executor, copies, bitmask)
    if plain:
        fill_next_token_bitmask_par(executor, plain, bitmask)
    for (m, row, w), (copy, _, _) in zip(drafted, copies):
        if copy.is_error():
            _settle_failure(executor, m, row, w, bitmask)
    for m, row, w in jobs:
        if w is not None and not w.eos:
            end = row + len(w.drafts) + 1
            bitmask[row + w.valid + 1:end] = bitmask[row + w.valid]
        if w is not None and w.reach is not None:      # the run never passes `reach`
            bitmask[row + w.reach + 1:row + len(w.masked_positions)] = bitmask[row + w.reach]


def _settle_failure(executor: llguidance.LLExecutor, matcher: llguidance.LLMatcher, row: int,
                    w: DraftWalk, bitmask: np.ndarray) -> None:
    """A drafted mask failed: find the first position p whose mask fails, each position
    recomputed on a fresh copy walked to it (rare: only after a failure). p = 0 is the
    matcher's own state: its mask is computed on the matcher itself, which fails as it would
    without drafts. p >= 1: the run ends at p - 1 (`reach`): its draw there is the token
    one-token decoding samples, and the next step masks p's state on the matcher itself,
    failing the request only if the error is hit again there."""
    for p in range(w.valid + 1):
        probe = matcher if p == 0 else matcher.deep_copy()
        for token in w.drafts[:p]:
            probe.consume_token(token)      # walked already: each is consumed
        fill_next_token_bitmask_par(executor, [(probe, row + p)], bitmask)
        if probe.is_error():
            if p:
                w.reach = p - 1
            return
