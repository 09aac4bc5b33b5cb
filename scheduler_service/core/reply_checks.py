"""A worker's step reply checked against the step it answers, before anything of it is applied.

The workers are authenticated and fenced, but a buggy or version-skewed worker must not corrupt
the streams: before, a handle sent twice appended two tokens to one request (past its
max_tokens, and a wrong text), an id outside the vocabulary reached the client and the
detokenizer, and a payload naming another step was applied to this one's requests. A reply that
breaks a rule here fails the step as a worker fault does (BadReply is a WorkerFailure of kind
"protocol", like a reply to the wrong epoch or step on the stream): every open stream ends
UNAVAILABLE naming what was wrong, the engine drops its core (every KV block with it) and starts
a new epoch, whose Init gives every worker a clean cache.

Rules (each once per step, in C where it can be: min() and max() of the ids, one set op on
the handles):
  - the payload's step is the step sent;
  - every sampled id, and every top-alternative and prompt-logprob id, is in [0, vocab_size)
    (a negative one indexed the vocabulary from its end);
  - every handle that sampled is one of the step's requests (request_errors, pooled and
    prompt_logprobs of another handle are dropped where they are applied, as before), and
    every handle the reply names anywhere (those maps' keys, compiled_handles) is >= 0;
  - a handle samples once, or with speculative drafts in one run of at most the tokens
    scheduled for it (its drafts + 1);
  - a step request's prompt logprobs, if any, are ones it asked for, one position per prompt
    token after the first with its k alternatives each; a pooled vector is a pooling
    request's. Values (logprobs, vectors) are not checked: a NaN is the model's numerics on
    one request, and failing the step for it would let one tenant's prompt end every stream.
"""
from __future__ import annotations

from collections import Counter
from itertools import islice
from operator import ne

from engine_common.request.pooling import NO_POOLING
from engine_common.wire.diff import RunnerOutput
from scheduler_service.errors import WorkerFailure


class BadReply(WorkerFailure):
    """A step reply that breaks the protocol's rules (this module's docstring)."""

    default_kind = "protocol"


def check_reply(step: int, scheduled: dict, counts: dict[int, int] | None,
                out: RunnerOutput, vocab_size: int | None, spec: bool) -> None:
    """BadReply naming the field, its value and what it must be, when `out` is not a valid reply
    to step `step`. `scheduled`: handle -> request of the step's computing requests; `counts`:
    handle -> tokens scheduled when not 1; `vocab_size`: None skips the id checks; `spec`: a
    handle may produce a run of tokens (its drafts verified)."""
    if out.step != step:
        _bad(step, "step", out.step, f"{step}: the step it answers")
    handles = out.handles
    if handles:
        ids = out.sampled_token_ids
        if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
            _bad_id(step, "sampled_token_ids", ids, vocab_size)
        # One set op: every handle one of the step's and none repeated (the usual reply).
        if len(scheduled.keys() & handles) != len(handles):
            _check_handles(step, handles, scheduled, counts or {}, spec)
    for handle, (ids, _) in out.top_logprobs.items():
        if len(ids) and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
            _bad_id(step, f"top_logprobs[{handle}]", ids, vocab_size)
    for handle, entry in out.prompt_logprobs.items():
        ids = entry.top_ids
        if len(ids) and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
            _bad_id(step, f"prompt_logprobs[{handle}].top_ids", ids, vocab_size)
        request = scheduled.get(handle)
        if request is not None:
            _check_prompt_shape(step, handle, entry, request)
    for handle in out.pooled:
        request = scheduled.get(handle)
        if request is not None and request.pooling == NO_POOLING:
            _bad(step, f"pooled[{handle}]", "a vector", "absent: the request pools nothing")
    _check_named_handles(step, out)


def _check_prompt_shape(step: int, handle: int, entry, request) -> None:
    """One position per prompt token after the first, k alternatives each, as the request
    asked: the API zips them with the prompt's ids (one too many was an IndexError where the
    servicer builds them, one too few a short list to the client)."""
    name = f"prompt_logprobs[{handle}]"
    if request.num_prompt_logprobs is None:
        _bad(step, name, "an entry", "absent: the request asked for no prompt logprobs")
    want = len(request.prompt_token_ids) - 1
    if len(entry.logprobs) != want:
        _bad(step, f"{name} (positions)", len(entry.logprobs),
             f"{want}: one per prompt token after the first")
    if want and entry.k != request.num_prompt_logprobs:
        _bad(step, f"{name} (alternatives per position)", entry.k,
             f"{request.num_prompt_logprobs}: the request's prompt_logprobs")


def _check_named_handles(step: int, out: RunnerOutput) -> None:
    """Handles are never negative; those outside the step's sampling rule are dropped where
    they are applied, but a negative one is no handle the scheduler gave out."""
    for name, named in (("compiled_handles", out.compiled_handles),
                        ("top_logprobs", out.top_logprobs),
                        ("request_errors", out.request_errors),
                        ("prompt_logprobs", out.prompt_logprobs), ("pooled", out.pooled)):
        if len(named) and min(named) < 0:
            _bad(step, f"{name} (a handle)", min(named), "a handle (>= 0)")


def _check_handles(step: int, handles: list[int], scheduled: dict, counts: dict[int, int],
                   spec: bool) -> None:
    """Some handle is not of the step or repeats: allowed only with drafts, a request's tokens
    in one run no longer than its scheduled tokens."""
    distinct = set(handles)
    if not scheduled.keys() >= distinct:
        _bad(step, "handles", min(distinct - scheduled.keys()),
             f"one of the {len(scheduled)} handles of the step's requests")
    num_runs = 1 + sum(map(ne, handles, islice(handles, 1, None)))
    if not spec or num_runs != len(distinct):
        seen: set[int] = set()
        for i, handle in enumerate(handles):
            if handle in seen and (not spec or handles[i - 1] != handle):
                _bad(step, f"handles[{i}]", handle, "a handle not sent before in this reply "
                     + ("(a request's tokens come in one run)" if spec else
                        "(one sampled token per request)"))
            seen.add(handle)
    for handle, n in Counter(handles).items():
        if n > counts.get(handle, 1):
            _bad(step, f"handles (handle {handle})", f"{n} tokens",
                 f"at most {counts.get(handle, 1)}: the tokens scheduled for it")


def _bad_id(step: int, name: str, ids: list[int], vocab_size: int | None) -> None:
    hi = float("inf") if vocab_size is None else vocab_size
    i = next(i for i, t in enumerate(ids) if not 0 <= t < hi)
    _bad(step, f"{name}[{i}]", int(ids[i]), "a token id >= 0" if vocab_size is None else
         f"a token id in [0, {vocab_size - 1}] (vocab_size)")


def _bad(step: int, name: str, value, allowed: str) -> None:
    raise BadReply(f"the workers' reply to step {step} is invalid: {name}={value!r} must be "
                   f"{allowed}; the step fails as a worker fault (a buggy or version-skewed "
                   "worker)")
