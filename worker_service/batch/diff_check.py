"""Checks a decoded step diff against the runner's limits and cached requests before any of it
is applied (and long before a tensor is touched).

The worker trusts nothing a diff says: an id that indexes device memory (a block id, a token id),
a handle, a count or a size out of range is refused with an error naming the field, the value
and the allowed range; the step is not run and the epoch fails (Reset or Init starts a clean
one). Parts are checked in the order the runner applies them (diff.py), tracking which handles
each part adds or removes, so the whole diff is judged against the state it will meet:

    finished_handles       cached requests, at most max_cached_requests of them
    preempted_handles      requests in the batch, at most max_num_seqs of them
    new_requests           the cached requests after it <= max_cached_requests (preempted ones
                           hold no KV blocks: engine_common/request/diff_limits.py derives the
                           bound from the scheduler's admission); handles not cached;
                           prompt ids < vocab_size, 1 .. max_model_len - 1 of them (up
                           to max_model_len for a pooling request: it samples none); block
                           ids < num_kv_blocks, at most a request's share; prefix hit within
                           the prompt and its blocks; sampling, stop ids, logprobs, a
                           constraint's characters and nesting depth
    resumed_requests       cached requests not in the batch; blocks as above; computed tokens
                           within the request's tokens
    new_block_ids          requests in the batch; blocks as above
    new_window_block_ids   (a hybrid model's only) requests in the batch; ids <
                           num_window_blocks, a request's share at most
    num_scheduled_tokens   requests in the batch; the step's tokens <= max_num_batched_tokens;
                           the batch <= max_num_seqs
    spec_token_ids         requests in the batch whose count is 1 + their drafts (at least
                           one); draft ids < vocab_size
    spec_assumed           drafted handles only; [num tokens 1 .. max_model_len - 1, last id
                           < vocab_size]

Cost: proportional to the diff, not to the batch (a decode step checks nearly nothing). A row's
computed + scheduled tokens against its known tokens and blocks, and a sampling row's room below
max_model_len, are checked, vectorised, by step_inputs.prepare_step_inputs, still before any
tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_common.wire.codec import CodecError
from engine_common.constraints.constraint import Constraint
from engine_common.runtime.identity_cache import IdentityCache
from engine_common.wire.diff import (NO_LOGPROBS, NewRequestData, ResumedRequestData,
                                     SchedulerOutput)
from engine_common.request.diff_limits import (MAX_CONSTRAINT_CHARS, MAX_CONSTRAINT_DEPTH, MAX_HANDLE,
                                       MAX_MIN_TOKENS, MAX_SEED, MAX_STOP_IDS,
                                       MAX_TOP_LOGPROBS)
from engine_common.request.params import ID_SET_KNOBS, clip, quoted
from engine_common.request.pooling import NO_POOLING
from worker_service.failures import StepProtocolError


class BadDiff(CodecError):
    """A value out of its range (BAD_PAYLOAD); names the field, the value and the range."""

    def __init__(self, field_name: str, value, allowed: str):
        super().__init__(f"{clip(field_name)}={quoted(value)} is invalid: must be {allowed}")


@dataclass(frozen=True)
class DiffBounds:
    """What the runner was built for."""

    num_kv_blocks: int
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_blocks_per_request: int
    max_cached_requests: int     # running + preempted (diff_limits.max_cached_requests)
    num_window_blocks: int = 0   # a hybrid model's window-group pool; 0: no window group


@dataclass
class _View:
    """The runner's cached requests and batch as the diff changes them, part by part."""

    cached: dict                 # handle -> CachedRequestState (the runner's, read only)
    batch: dict                  # handle -> row (the runner's, read only)
    batch_blocks: object         # row -> blocks held (numpy array, read only)
    gone: set = field(default_factory=set)          # dropped from the cache
    out: set = field(default_factory=set)           # taken out of the batch
    added: dict = field(default_factory=dict)       # handle -> blocks held, new or resumed

    def is_cached(self, handle: int) -> bool:
        return handle in self.added or (handle in self.cached and handle not in self.gone)

    def in_batch(self, handle: int) -> bool:
        return handle in self.added or (handle in self.batch and handle not in self.out)

    def blocks(self, handle: int) -> int:
        if handle in self.added:
            return self.added[handle]
        return int(self.batch_blocks[self.batch[handle]])

    def batch_size(self) -> int:
        return len(self.batch) - len(self.out) + len(self.added)


def check_diff(diff: SchedulerOutput, bounds: DiffBounds, cached: dict, batch: dict,
               batch_blocks, window_blocks=None) -> None:
    """Raise BadDiff (a value out of range) or StepProtocolError (a handle the state does not
    have) for the first violation; return when the whole diff fits. `cached`: handle -> cached
    request; `batch`: handle -> row; `batch_blocks`: row -> blocks held (none is changed);
    `window_blocks`: row -> window-group blocks held (a hybrid model's)."""
    view = _View(cached, batch, batch_blocks)
    _check_lengths(diff, bounds)
    for i, handle in enumerate(diff.finished_handles):
        if not view.is_cached(handle):
            raise StepProtocolError(f"finished_handles[{i}]={handle} is not a cached request")
        if view.in_batch(handle):      # a preempted one is cached but holds no row
            view.out.add(handle)
        view.gone.add(handle)
        view.added.pop(handle, None)
    for i, handle in enumerate(diff.preempted_handles):
        if not view.in_batch(handle):
            raise StepProtocolError(f"preempted_handles[{i}]={handle} is not in the batch")
        view.out.add(handle)
    # Every finished handle was a distinct cached request (checked above), and each new one
    # must be a distinct uncached one: so many are cached once the diff is applied.
    num_cached = len(cached) - len(diff.finished_handles) + len(diff.new_requests)
    if num_cached > bounds.max_cached_requests:
        raise BadDiff("cached requests after the diff", num_cached,
                      f"<= {bounds.max_cached_requests} (max_num_seqs {bounds.max_num_seqs} + "
                      f"the scheduler's most waiting requests)")
    for i, new in enumerate(diff.new_requests):
        _check_new(f"new_requests[{i}]", new, bounds, view)
    for i, res in enumerate(diff.resumed_requests):
        _check_resumed(f"resumed_requests[{i}]", res, bounds, view)
    if view.batch_size() > bounds.max_num_seqs:
        raise BadDiff("requests in the batch", view.batch_size(),
                      f"<= max_num_seqs ({bounds.max_num_seqs})")
    if diff.new_block_ids and not _new_blocks_fit(diff.new_block_ids, bounds, view):
        for handle, block_ids in diff.new_block_ids.items():     # find and name the first
            name = f"new_block_ids[{handle}]"
            if not view.in_batch(handle):
                raise StepProtocolError(f"{name}: handle {handle} is not in the batch")
            _check_blocks(name, block_ids, bounds, view.blocks(handle))
    if diff.new_window_block_ids:
        _check_window_blocks(diff.new_window_block_ids, bounds, view, window_blocks)
    _check_counts(diff.num_scheduled_tokens, bounds, view)
    if diff.spec_token_ids:
        _check_drafts(diff.spec_token_ids, diff.num_scheduled_tokens, bounds, view)
    if diff.spec_assumed:
        _check_assumed(diff.spec_assumed, diff.spec_token_ids, bounds)


def _check_assumed(assumed: dict[int, list[int]], drafts: dict[int, list[int]],
                   bounds: DiffBounds) -> None:
    """Each assumption is of a drafted handle: a length the row may have, a token id."""
    for handle, value in assumed.items():
        name = f"spec_assumed[{handle}]"
        if handle not in drafts:
            raise BadDiff(name, value, "absent: the handle has no spec_token_ids")
        if len(value) != 2:
            raise BadDiff(name, value, "[num tokens, last token id]")
        if not 1 <= value[0] < bounds.max_model_len:
            raise BadDiff(f"{name}[0]", value[0], f"in [1, {bounds.max_model_len - 1}] "
                          "(max_model_len - 1)")
        if value[1] >= bounds.vocab_size:
            raise BadDiff(f"{name}[1]", value[1], f"< vocab_size ({bounds.vocab_size})")


def _check_drafts(drafts: dict[int, list[int]], counts: dict[int, int], bounds: DiffBounds,
                  view: _View) -> None:
    """Each drafted handle is in the batch and scheduled for its last token plus its drafts
    (whether that reaches exactly its known tokens is checked with the batch: spec_verify)."""
    for handle, ids in drafts.items():
        name = f"spec_token_ids[{handle}]"
        if not view.in_batch(handle):
            raise StepProtocolError(f"{name}: handle {handle} is not in the batch")
        if not ids or counts.get(handle, 1) != 1 + len(ids):
            raise BadDiff(f"num_scheduled_tokens[{handle}]", counts.get(handle, 1),
                          f"1 + the {len(ids)} drafts of {name} (at least one)")
        _ids_below(name, ids, bounds.vocab_size, "vocab_size")


def _check_lengths(diff: SchedulerOutput, bounds: DiffBounds) -> None:
    """The lists of handles that leave, by count, before any is looked at: each names a
    distinct cached request (finished) or a distinct request in the batch (preempted)."""
    for name, handles, limit, what in (
            ("finished_handles", diff.finished_handles, bounds.max_cached_requests,
             "max_cached_requests"),
            ("preempted_handles", diff.preempted_handles, bounds.max_num_seqs, "max_num_seqs")):
        if len(handles) > limit:
            raise BadDiff(f"{name} length", len(handles), f"<= {what} ({limit})")


def _new_blocks_fit(new_block_ids: dict[int, list[int]], bounds: DiffBounds,
                    view: _View) -> bool:
    """Whether every growing request is in the batch and its blocks fit, without building an
    error message (a step where only running requests grow: the usual one)."""
    if view.out or view.added:
        return False                  # membership changed in this diff: check one by one
    batch, held = view.batch, view.batch_blocks.tolist()
    most, limit = bounds.max_blocks_per_request, bounds.num_kv_blocks
    for handle, ids in new_block_ids.items():
        row = batch.get(handle)
        if row is None or held[row] + len(ids) > most or (ids and max(ids) >= limit):
            return False
    return True


def _check_new(name: str, new: NewRequestData, bounds: DiffBounds, view: _View) -> None:
    if not _new_fits(new, bounds, view):
        _check_new_named(name, new, bounds, view)      # raises, naming the first violation
    view.added[new.handle] = len(new.block_ids)


def _new_fits(new: NewRequestData, bounds: DiffBounds, view: _View) -> bool:
    """Whether _check_new_named passes, without building a field name per check (a prefill
    step brings dozens of new requests); the sampling knobs once per params object. False
    for every request it would refuse (and for a constrained one or one asking for prompt
    logprobs: that one it checks)."""
    prompt, blocks, s, vocab = new.prompt_token_ids, new.block_ids, new.sampling, \
        bounds.vocab_size
    return (0 <= new.handle <= MAX_HANDLE and not view.is_cached(new.handle)
            and 1 <= len(prompt) < bounds.max_model_len and _max_id(prompt) < vocab
            and len(blocks) <= bounds.max_blocks_per_request
            and (not len(blocks) or _max_id(blocks) < bounds.num_kv_blocks)
            and 0 <= new.num_computed_tokens <= min(len(prompt), len(blocks) * bounds.block_size)
            and NO_LOGPROBS <= new.num_logprobs <= min(MAX_TOP_LOGPROBS, vocab)
            and 0 <= s.seed <= MAX_SEED and 0 <= s.min_tokens <= MAX_MIN_TOKENS
            and len(s.stop_ids) <= MAX_STOP_IDS
            and (not len(s.stop_ids) or _max_id(s.stop_ids) < vocab)
            and _knobs_fit(s.sampling, vocab) and new.constraint is None
            and new.prompt_logprobs == NO_LOGPROBS)


def _knobs_fit(sp, vocab_size: int) -> bool:
    """top_k in range and every id of logit_bias and the id sets below vocab_size, remembered
    per params object (a decoded diff shares one per distinct message)."""
    if _KNOBS_FIT.get_by_id(id(sp)) == vocab_size:
        return True
    id_lists = ([t for t, _ in sp.logit_bias], *(getattr(sp, k.name) for k in ID_SET_KNOBS))
    fits = -1 <= sp.top_k <= MAX_MIN_TOKENS and all(
        not len(ids) or _max_id(ids) < vocab_size for ids in id_lists)
    if fits and sum(map(len, id_lists)) <= MAX_REMEMBERED_IDS:   # no large params pinned
        _KNOBS_FIT.put(sp, vocab_size)
    return fits


_KNOBS_FIT = IdentityCache(256)     # params -> the vocab size it fits
MAX_REMEMBERED_IDS = 16       # as input_batch's row cache: params with more ids are rechecked


def _check_new_named(name: str, new: NewRequestData, bounds: DiffBounds, view: _View) -> None:
    _in_range(f"{name}.handle", new.handle, MAX_HANDLE)
    if view.is_cached(new.handle):
        raise StepProtocolError(f"{name}.handle={new.handle} is already a cached request")
    prompt = new.prompt_token_ids
    room = bounds.max_model_len - (new.pooling == NO_POOLING)   # a pooling one samples none
    if not 1 <= len(prompt) <= room:
        raise BadDiff(f"{name}.prompt_token_ids length", len(prompt),
                      f"in [1, {room}] (max_model_len{' - 1' * (room < bounds.max_model_len)})")
    _ids_below(f"{name}.prompt_token_ids", prompt, bounds.vocab_size, "vocab_size")
    _check_blocks(f"{name}.block_ids", new.block_ids, bounds, 0)
    limit = min(len(prompt), len(new.block_ids) * bounds.block_size)
    _in_range(f"{name}.num_computed_tokens", new.num_computed_tokens, limit)
    _in_range(f"{name}.num_logprobs", new.num_logprobs,
              min(MAX_TOP_LOGPROBS, bounds.vocab_size), lo=NO_LOGPROBS)
    _in_range(f"{name}.prompt_logprobs", new.prompt_logprobs,
              min(MAX_TOP_LOGPROBS, bounds.vocab_size), lo=NO_LOGPROBS)
    if new.prompt_logprobs >= 0 and new.num_computed_tokens:   # its prompt must all be computed
        raise BadDiff(f"{name}.num_computed_tokens", new.num_computed_tokens,
                      "0 for a request that asks for prompt logprobs")
    s = new.sampling
    _in_range(f"{name}.sampling.seed", s.seed, MAX_SEED)
    _in_range(f"{name}.sampling.min_tokens", s.min_tokens, MAX_MIN_TOKENS)
    _in_range(f"{name}.sampling.top_k", s.sampling.top_k, MAX_MIN_TOKENS, lo=-1)
    if len(s.stop_ids) > MAX_STOP_IDS:
        raise BadDiff(f"{name}.sampling.stop_ids length", len(s.stop_ids), f"<= {MAX_STOP_IDS}")
    _ids_below(f"{name}.sampling.stop_ids", s.stop_ids, bounds.vocab_size, "vocab_size")
    _ids_below(f"{name}.sampling.logit_bias", [t for t, _ in s.sampling.logit_bias],
               bounds.vocab_size, "vocab_size")
    for k in ID_SET_KNOBS:
        _ids_below(f"{name}.sampling.{k.name}", getattr(s.sampling, k.name), bounds.vocab_size,
                   "vocab_size")
    if new.constraint is not None:
        _check_constraint(f"{name}.constraint", new.constraint)


def _check_constraint(name: str, constraint: Constraint) -> None:
    """Its size, then its nesting (the grammar engine's compiler would overflow its stack and
    kill the worker: engine_common/constraints/constraint_depth.py; the scan is linear in the size)."""
    if constraint.num_chars > MAX_CONSTRAINT_CHARS:
        raise BadDiff(f"{name} characters", constraint.num_chars, f"<= {MAX_CONSTRAINT_CHARS}")
    depth = constraint.depth
    if depth > MAX_CONSTRAINT_DEPTH:
        raise BadDiff(f"{name} depth", depth, f"<= {MAX_CONSTRAINT_DEPTH}")


def _check_resumed(name: str, res: ResumedRequestData, bounds: DiffBounds,
                   view: _View) -> None:
    if not view.is_cached(res.handle) or view.in_batch(res.handle):
        raise StepProtocolError(f"{name}.handle={res.handle} is not a preempted request")
    _check_blocks(f"{name}.block_ids", res.block_ids, bounds, 0)
    state = view.cached[res.handle]
    limit = min(state.num_tokens, len(res.block_ids) * bounds.block_size)
    _in_range(f"{name}.num_computed_tokens", res.num_computed_tokens, limit)
    view.added[res.handle] = len(res.block_ids)


def _check_blocks(name: str, block_ids: list[int], bounds: DiffBounds, held: int) -> None:
    if held + len(block_ids) > bounds.max_blocks_per_request:
        raise BadDiff(f"{name} length", len(block_ids),
                      f"<= {bounds.max_blocks_per_request - held} (a request holds at most "
                      f"{bounds.max_blocks_per_request} blocks of {bounds.block_size} tokens)")
    _ids_below(name, block_ids, bounds.num_kv_blocks, "num_kv_blocks")


def _check_window_blocks(new_ids: dict[int, list[int]], bounds: DiffBounds, view: _View,
                         window_blocks) -> None:
    """Each handle in the batch; ids < num_window_blocks; a table within a request's share (a
    new or resumed request's starts empty)."""
    for handle, block_ids in new_ids.items():
        name = f"new_window_block_ids[{handle}]"
        if not bounds.num_window_blocks:
            raise BadDiff(name, block_ids, "absent: the model has no window group")
        if not view.in_batch(handle):
            raise StepProtocolError(f"{name}: handle {handle} is not in the batch")
        held = 0 if handle in view.added else int(window_blocks[view.batch[handle]])
        if held + len(block_ids) > bounds.max_blocks_per_request:
            raise BadDiff(f"{name} length", len(block_ids),
                          f"<= {bounds.max_blocks_per_request - held} (a request holds at most "
                          f"{bounds.max_blocks_per_request} blocks of {bounds.block_size} "
                          "tokens)")
        _ids_below(name, block_ids, bounds.num_window_blocks, "num_window_blocks")


def _check_counts(counts: dict[int, int], bounds: DiffBounds, view: _View) -> None:
    """Named handles in the batch; every unnamed one computes one token; the step's total."""
    total = view.batch_size()
    for handle, n in counts.items():
        name = f"num_scheduled_tokens[{handle}]"
        if not view.in_batch(handle):
            raise StepProtocolError(f"{name}: handle {handle} is not in the batch")
        _in_range(name, n, bounds.max_num_batched_tokens)
        total += n - 1
    if total > bounds.max_num_batched_tokens:
        raise BadDiff("tokens in the step", total,
                      f"<= max_num_batched_tokens ({bounds.max_num_batched_tokens})")


def _in_range(name: str, value: int, hi: int, lo: int = 0) -> None:
    if not lo <= value <= hi:
        raise BadDiff(name, value, f"in [{lo}, {hi}]")


def _ids_below(name: str, ids, limit: int, limit_name: str) -> None:
    """Every id < limit (ids are non-negative integers: the codec checked that). `ids`: a list,
    or a numpy array (a decoded prompt: one vectorised max, no Python int per id)."""
    if len(ids) and _max_id(ids) >= limit:
        i = next(i for i, v in enumerate(ids) if v >= limit)
        raise BadDiff(f"{name}[{i}]", int(ids[i]), f"< {limit_name} ({limit})")


def _max_id(ids) -> int:
    return int(ids.max()) if hasattr(ids, "dtype") else max(ids)
