"""What the output processor knows of one request (RequestTextState), and a final-only request's
outputs kept for its final one (KeptOutputs, keep_for_final, with_kept).

Final-only requests (`final_only`: the offline `LLM.generate`; vLLM's RequestOutputKind.FINAL_ONLY)
get one output, at the finish, equal to the merge of every per-step output they would have had:
the outputs before it are kept here instead of sent.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine_common.request.params import StoppingParams
from engine_common.text.tokenizer import IncrementalDetokenizer
from scheduler_service.engine.request_output import RequestOutput, RequestTimings, TokenLogprob


@dataclass(slots=True)
class KeptOutputs:
    """A final-only request's tokens, logprobs and text (pieces) so far."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None


@dataclass(slots=True)
class RequestTextState:
    """What the processor knows of one request: fixed facts copied at add time, the text state."""

    request_id: str
    num_prompt_tokens: int
    stopping: StoppingParams
    num_logprobs: int | None       # None: the request wants no logprob (its outputs carry none)
    detokenizer: IncrementalDetokenizer
    hold_back: int                 # characters of unsent text held while stop strings are cut
    tail_len: int                  # characters of sent text kept for matching (included stops)
    timings: RequestTimings
    num_cached_tokens: int = 0
    # Text not sent yet, and the end of the text sent (`tail_len` characters): a stop string
    # begins in one or the other (with hold-back, never in text sent).
    unsent: str = ""
    sent_tail: str = ""
    num_output_tokens: int = 0
    stop_string: str | None = None
    # No stop strings and both first times known: one plain token takes `process`'s short path.
    steady: bool = False
    # Final-only: what the outputs before the final one would have carried, kept for the final
    # one (None: per-step outputs). `defer_text`: no text is made until the finish.
    kept: KeptOutputs | None = None
    defer_text: bool = False
    # The prompt's ids, kept only for a request that asked for prompt logprobs.
    prompt_ids: list[int] | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self.stopping.stop


def keep_for_final(state: RequestTextState, out: RequestOutput) -> RequestOutput | None:
    """A final-only request's output: kept (None) until the final one, which then carries
    what every output before it would have (`with_kept`)."""
    if out.finished:
        return with_kept(state, out)
    kept = state.kept
    kept.token_ids += out.new_token_ids
    kept.logprobs += out.logprobs
    kept.prompt_logprobs = kept.prompt_logprobs or out.prompt_logprobs
    if out.new_text:
        kept.text.append(out.new_text)
    return None


def with_kept(state: RequestTextState, out: RequestOutput) -> RequestOutput:
    """`out` (a final output) with the kept tokens, logprobs and text before its own."""
    kept = state.kept
    out.new_token_ids = kept.token_ids + out.new_token_ids
    out.logprobs = kept.logprobs + out.logprobs
    out.prompt_logprobs = kept.prompt_logprobs or out.prompt_logprobs
    out.new_text = "".join(kept.text) + out.new_text
    return out
