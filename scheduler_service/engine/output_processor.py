"""Token updates -> client-facing outputs: streaming text, stop strings, logprobs, usage.

The output processor never touches the engine: it reads TokenUpdates (copies of what a step did)
and reports which requests matched a stop string; its owner finishes those in the engine (the
offline LLMEngine at once, the serving side of AsyncEngine with a command to the engine thread).

Stop strings are matched and cut, and text held back for them, by the rules of stop_strings.py;
a request's state is request_text_state.py's RequestTextState. Every token id is reported, even
those whose text was cut. Bytes of a character the generation leaves unfinished never become text
(no U+FFFD at the end), as vLLM v1's detokenizers.

Tokens that arrive for a request after its stop string matched (the engine learns of the match
a step or two late when the text is made on another thread) are dropped: they never reach the
client and are not counted in usage.

A failure while processing one request's output (a tokenizer bug, say) ends that request alone:
its final output carries `error` (RequestFailed) and the owner aborts it in the engine. A request
the engine aborted because it failed on the worker (TokenUpdate.error: its grammar) ends the same
way, with the engine's message.

Final-only requests (`final_only`: the offline `LLM.generate`, which reads nothing but each
request's result; vLLM's RequestOutputKind.FINAL_ONLY) get one output, at the finish, equal to
the merge (`merge_outputs`) of every per-step output they would have had (kept by
request_text_state.keep_for_final): no per-step RequestOutput is built. Without stop strings, on
a byte-level decoder, their text is decoded once at the finish (`RequestTextState.defer_text`):
such a decoder's text after whole characters does not depend on the ids before (see
Tokenizer.token_texts), so the incremental pieces join into the text of all the ids at once.
With stop strings (matching needs the text as it grows) and on other decoders the text is still
made token by token.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from engine_common.text.tokenizer import IncrementalDetokenizer, Tokenizer, streamed_text
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_result import TokenUpdate
from scheduler_service.engine.request_output import (PromptLogprobList, RequestOutput,
                                                     RequestTimings, TokenLogprob,
                                                     merge_outputs)
from scheduler_service.engine.request_text_state import (KeptOutputs, RequestTextState,
                                                         keep_for_final, with_kept)
from scheduler_service.engine.stop_strings import append_text, take_sendable_text
from scheduler_service.errors import RequestFailed

# The output types live in request_output.py; importers of this module may name them here too.
__all__ = ["OutputProcessor", "RequestOutput", "RequestTimings", "TokenLogprob",
           "merge_outputs"]

log = logging.getLogger(__name__)


class OutputProcessor:
    """Keeps one detokenizer per live request and turns `TokenUpdate`s into `RequestOutput`s.
    Not thread-safe: one thread owns it (the engine's in the offline engine, the event loop's in
    the server). `final_only`: every request added gets only its final output (see the module
    docstring); the default is one output per step, for streaming."""

    def __init__(self, tokenizer: Tokenizer, final_only: bool = False):
        self._tokenizer = tokenizer
        self._final_only = final_only
        self._states: dict[str, RequestTextState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add_request(self, request: Request) -> None:
        """Start tracking `request`. Only the fields fixed at creation are read (id, prompt,
        stopping, num_logprobs, arrival time): the engine may own the object from now on."""
        stops = request.stopping.stop
        skip = request.stopping.skip_special_tokens
        detok = IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids, skip)
        window = max((len(s) for s in stops), default=1) - 1
        include = request.stopping.include_stop_str_in_output
        state = RequestTextState(request.request_id, request.num_prompt_tokens,
                                 request.stopping, request.num_logprobs, detok,
                                 0 if include else window, window if include else 0,
                                 RequestTimings(request.arrival_time, None, None))
        if request.num_prompt_logprobs is not None:
            state.prompt_ids = request.prompt_token_ids
        if self._final_only:
            state.kept = KeptOutputs()
            state.defer_text = not stops and self._tokenizer.token_texts(skip) is not None
        self._states[request.request_id] = state

    def reads_final_update_only(self, request: Request) -> bool:
        """Whether `request`'s outputs need only its final TokenUpdate: a final-only request
        without stop strings (matching needs the text as it grows) or top alternatives. Its
        owner may then hold its updates until the finish (Request.held_logprobs): the final
        update carries every token, and the output is the same."""
        return (self._final_only and not request.stopping.stop and not request.num_logprobs
                and request.num_prompt_logprobs is None)

    def drop(self, request_id: str) -> None:
        """Forget a request without an output (its stream ended with an error)."""
        self._states.pop(request_id, None)

    def process(self, updates: list[TokenUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """One output per update of a tracked request, and the ids that matched a stop string.

        The caller must finish the returned ids in the engine with FINISHED_STOP_STRING. Updates
        for requests no longer tracked (finished, or stopped by a string earlier) are dropped.
        An output with `error` set is final: the caller must abort that request in the engine.
        """
        outputs, stopped_ids = [], []
        get, append = self._states.get, outputs.append
        for update in updates:
            state = get(update.request_id)
            if state is None:
                continue
            ids = update.new_token_ids
            if update.error is not None:    # the engine ended it: it failed on the worker
                outputs.append(self._failed(state, update.error))
                continue
            try:
                kept = state.kept
                if (state.steady and len(ids) == 1 and update.finish_reason is None
                        and update.top_logprobs is None):
                    # The common case inline (every request, every step): one new token of an
                    # unfinished `steady` request (no stop strings, first token timed) with no
                    # top alternatives. Same result as _process_one (nothing is held back then).
                    state.num_cached_tokens = update.num_cached_tokens
                    state.num_output_tokens += 1
                    token_id = ids[0]
                    # a request that asked for none may still have them (its batch's others
                    # did): never reported
                    lps = update.new_logprobs if state.num_logprobs is not None else None
                    if kept is None:
                        append(RequestOutput(
                            state.request_id, ids, state.detokenizer.add(token_id),
                            [TokenLogprob(int(token_id), float(lps[0]))] if lps else [],
                            False, None, None, state.num_prompt_tokens,
                            state.num_output_tokens, state.num_cached_tokens, state.timings))
                        continue
                    # Final-only: kept instead of sent, in the same order (a failing
                    # detokenizer leaves the same state behind).
                    if not state.defer_text:
                        piece = state.detokenizer.add(token_id)
                        if piece:
                            kept.text.append(piece)
                    kept.token_ids.append(token_id)
                    if lps:
                        kept.logprobs.append(TokenLogprob(int(token_id), float(lps[0])))
                    continue
                out = self._process_one(state, update)
                if kept is not None and (out := keep_for_final(state, out)) is None:
                    continue
            except Exception as e:  # noqa: BLE001 - one request's bug must not end the others
                outputs.append(self._fail(state, e))
                continue
            outputs.append(out)
            if state.stop_string is not None and not update.finished:
                stopped_ids.append(out.request_id)
        return outputs, stopped_ids

    def _fail(self, state: RequestTextState, exc: Exception) -> RequestOutput:
        rid = state.request_id
        log.exception("processing the output of request %r failed; aborting it alone", rid)
        return self._failed(state, f"request {rid!r} failed while its output was processed "
                                   f"({type(exc).__name__}: {exc})")

    def _failed(self, state: RequestTextState, message: str) -> RequestOutput:
        """The final output of a request that failed: no more text, `error` RequestFailed."""
        rid = state.request_id
        self._states.pop(rid, None)
        state.unsent = ""       # text past the failure point cannot be trusted
        if state.timings.finish_time is None:
            state.timings = dataclasses.replace(state.timings, finish_time=time.monotonic())
        out = self._output(state, [], [], True, RequestStatus.FINISHED_ABORTED, None)
        if state.kept is not None:
            # Deferred text was never made: a final-only request's failed output has none.
            out = with_kept(state, out)
        out.error = RequestFailed(f"{message}; other requests are unaffected")
        return out

    def _process_one(self, state: RequestTextState, update: TokenUpdate) -> RequestOutput:
        out = self._process_tokens(state, update)
        if update.prompt_logprobs is not None and state.prompt_ids is not None:
            out.prompt_logprobs = PromptLogprobList(state.prompt_ids, update.prompt_logprobs)
        if update.pooled is not None:
            out.embedding = update.pooled
        return out

    def _process_tokens(self, state: RequestTextState, update: TokenUpdate) -> RequestOutput:
        self._note_times(state, update)
        token_ids = update.new_token_ids
        kept = self._detokenize(state, token_ids, update.finish_reason)
        if kept < len(token_ids):     # a stop string before the last of several (drafts)
            update = update.first(kept)
            token_ids = update.new_token_ids
        logprobs = self._logprobs(state.num_logprobs, token_ids, update.new_logprobs,
                                  update.top_logprobs)
        # An aborted update carries no tokens, so a stop string here matched in this step's text.
        if state.stop_string is not None:
            return self._finish(state, token_ids, logprobs, RequestStatus.FINISHED_STOP_STRING,
                                state.stop_string, None)
        if update.finished:
            # Ids the detokenizer still holds (a character left unfinished) are dropped, never
            # sent as U+FFFD: vLLM v1 flushes nothing (docs/serving_text_path.md).
            if state.defer_text:
                append_text(state, self._deferred_text(state, token_ids,
                                                       update.finish_reason))
            return self._finish(state, token_ids, logprobs, update.finish_reason,
                                update.stop_token_id, update.finish_time)
        return self._output(state, token_ids, logprobs, False, None, None)

    @staticmethod
    def _note_times(state: RequestTextState, update: TokenUpdate) -> None:
        state.num_cached_tokens = update.num_cached_tokens
        t = state.timings
        if t.first_scheduled_time is not None and t.first_token_time is not None:
            state.steady = not state.stopping.stop
            return                              # every step after the first token
        scheduled = t.first_scheduled_time or update.first_scheduled_time
        first_token = t.first_token_time or update.first_token_time
        if first_token is None and update.new_token_ids:
            first_token = time.monotonic()
        if (scheduled, first_token) != (t.first_scheduled_time, t.first_token_time):
            state.timings = dataclasses.replace(t, first_scheduled_time=scheduled,
                                                first_token_time=first_token)

    @staticmethod
    def _drops_last(state: RequestTextState, finish_reason: RequestStatus | None) -> bool:
        """The text of a stop token (eos or stop_token_ids) is not part of the output."""
        return (finish_reason == RequestStatus.FINISHED_STOP_TOKEN
                and not state.stopping.include_stop_str_in_output)

    def _deferred_text(self, state: RequestTextState, token_ids: list[int],
                       finish_reason: RequestStatus | None) -> str:
        """A deferred-text request's whole text, at its finish: what the incremental pieces
        join into (a byte-level decoder; no stop strings)."""
        ids = state.kept.token_ids + token_ids
        if token_ids and self._drops_last(state, finish_reason):
            ids.pop()
        return streamed_text(self._tokenizer, ids, state.stopping.skip_special_tokens)

    def _detokenize(self, state: RequestTextState, token_ids: list[int],
                    finish_reason: RequestStatus | None) -> int:
        if state.defer_text:                    # the text is made at the finish
            state.num_output_tokens += len(token_ids)
            return len(token_ids)
        drop_last = self._drops_last(state, finish_reason)
        for i, token_id in enumerate(token_ids):
            if state.stop_string is not None:   # the tokens after a stop string's: dropped
                return i
            state.num_output_tokens += 1
            if drop_last and i == len(token_ids) - 1:
                continue
            # A kept stop token's text is checked for stop strings too, as vLLM's.
            append_text(state, state.detokenizer.add(token_id))
        return len(token_ids)

    def _finish(self, state, token_ids, logprobs, reason, stop_reason,
                finish_time: float | None) -> RequestOutput:
        del self._states[state.request_id]
        if state.timings.finish_time is None:
            state.timings = dataclasses.replace(state.timings,
                                                finish_time=finish_time or time.monotonic())
        return self._output(state, token_ids, logprobs, True, reason, stop_reason)

    def _output(self, state: RequestTextState, token_ids, logprobs, finished: bool,
                reason: RequestStatus | None, stop_reason) -> RequestOutput:
        new_text = take_sendable_text(state, finished)
        return RequestOutput(state.request_id, token_ids, new_text, logprobs, finished, reason,
                             stop_reason, state.num_prompt_tokens, state.num_output_tokens,
                             state.num_cached_tokens, state.timings)

    @staticmethod
    def _logprobs(k: int | None, token_ids, new_logprobs, top_logprobs) -> list[TokenLogprob]:
        """Entries for the new tokens, each with at most `k` top alternatives (None: none)."""
        if not new_logprobs or k is None:
            return []
        if top_logprobs is None or k == 0:         # the sampled tokens' own logprobs only
            # map, not a comprehension: a held request's final update has every token's
            return list(map(TokenLogprob, map(int, token_ids), map(float, new_logprobs)))
        out = []
        for i, (token_id, logprob) in enumerate(zip(token_ids, new_logprobs)):
            entry = TokenLogprob(int(token_id), float(logprob))
            if top_logprobs is not None and k > 0:
                ids, lps = top_logprobs[i]
                entry.top_token_ids = [int(t) for t in ids[:k]]
                entry.top_logprobs = [float(v) for v in lps[:k]]
            out.append(entry)
        return out
