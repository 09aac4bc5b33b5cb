"""Stop strings in a request's growing text, and how much of the text may be sent.

Rules:
- checked only in the text of tokens after the first `stopping.min_tokens` (as vLLM, and as stop
  ids, which the sampler masks until then); the match may still begin in text produced earlier;
- checked after each token, so the first stop string to *complete* wins; among those that
  complete in the same token's text, the first in the request's list (vLLM's
  check_stop_strings), at its first place there;
- the text is cut before the stop string, or after it with `include_stop_str_in_output`;
- while a request's stop strings are cut (include_stop_str_in_output=False), the last (longest
  stop - 1) characters of unsent text are held back, so a stop string straddling two steps never
  reaches the client in part; held text is sent when the request finishes for any other reason.
  With include_stop_str_in_output nothing is held back (vLLM's stop_buffer_length 0): a stop
  string may then begin in text already sent, so the last (longest stop - 1) characters sent
  are kept for matching (`sent_tail`), and the text still ends at the stop string's end.
"""
from __future__ import annotations

from scheduler_service.engine.request_text_state import RequestTextState


def append_text(state: RequestTextState, piece: str) -> None:
    """Add a token's text to the unsent text, then look for a stop string completing in it."""
    if not piece or state.stop_string is not None:
        return
    start = len(state.unsent)
    state.unsent += piece
    if state.stops and state.num_output_tokens > state.stopping.min_tokens:
        check_stop(state, start)


def check_stop(state: RequestTextState, new_start: int) -> None:
    """Find a stop string that completes in unsent[new_start:] (the first listed, as vLLM);
    cut the text there. It may begin in `sent_tail`; it ends in unsent text, so the cut
    (before it with hold-back, after it without) never reaches text already sent."""
    sent = len(state.sent_tail)
    text = state.sent_tail + state.unsent if sent else state.unsent
    for stop in state.stops:
        pos = text.find(stop, max(0, sent + new_start - len(stop) + 1))
        if pos >= 0:
            break
    else:
        return
    keep = pos + len(stop) if state.stopping.include_stop_str_in_output else pos
    state.unsent = text[sent:keep]
    state.stop_string = stop


def take_sendable_text(state: RequestTextState, finished: bool) -> str:
    """The unsent text that may be sent now (all of it once finished; else all but the
    held-back characters), remembering the end of what is sent for later matches."""
    send_upto = len(state.unsent)
    if not finished and state.hold_back:
        send_upto = max(0, send_upto - state.hold_back)
    new_text, state.unsent = state.unsent[:send_upto], state.unsent[send_upto:]
    if state.tail_len and new_text:
        state.sent_tail = (state.sent_tail + new_text)[-state.tail_len:]
    return new_text
