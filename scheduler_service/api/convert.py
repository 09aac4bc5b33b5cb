"""Generation API protobuf <-> domain objects. Pure functions: no I/O, no engine state.

Requests come in as `GenerateRequest` and leave as the front door's `ValidatedRequest` (this
module keeps only the field mapping; front_door.py does the conversions);
every bad field raises `ParamError` naming the field (in proto terms, e.g. `sampling.top_p`), the
value and the allowed range, which the servicer maps to INVALID_ARGUMENT. Outputs of the output
processor go back as `GenerateResponse` messages.
"""
from __future__ import annotations

from typing import Callable

from engine_common.request.params import KNOBS, ParamError, SamplingParams
from engine_common.wire.protos import generation_pb2 as pb
from scheduler_service.api.front_door import (MAX_LOGPROBS, FieldNames, ValidatedRequest,
                                              constraint_from_oneof, given_knobs, new_request_id,
                                              prompt_from, sampling_from, stopping_from)
from scheduler_service.api.request_limits import LimitedFields
from scheduler_service.engine.output_processor import RequestOutput, RequestTimings, TokenLogprob
from scheduler_service.engine.request_output import PromptLogprob
from scheduler_service.core.request import RequestStatus

NAMES = FieldNames(sampling="sampling", stopping="stopping", constraint="constraint")

_FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: pb.LENGTH,
    RequestStatus.FINISHED_STOP_TOKEN: pb.STOP_TOKEN,
    RequestStatus.FINISHED_STOP_STRING: pb.STOP_STRING,
    RequestStatus.FINISHED_ABORTED: pb.ABORT,
}


def request_from_proto(msg: pb.GenerateRequest, *, defaults: SamplingParams = SamplingParams(),
                       vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS,
                       default_max_tokens: int | None = None,
                       make_request_id: Callable[[], str] = new_request_id) -> ValidatedRequest:
    """Validate a GenerateRequest and convert it; raises ParamError on the first bad field.

    `defaults` fills unset sampling fields (temperature excepted: unset means greedy).
    `vocab_size`, when given, bounds prompt token ids and stop token ids.
    `default_max_tokens` applies when stopping.max_tokens is unset (None: up to max_model_len).
    The prompt's length against max_model_len is checked after tokenization (FrontDoor).
    """
    prompt = {name: value for name, value in (("text", msg.text), ("token_ids", msg.token_ids),
                                              ("messages", msg.messages))
              if (msg.HasField("text") if name == "text" else len(value) > 0)}
    text, token_ids, messages = prompt_from(
        prompt, vocab_size, field_name="prompt", ids_field="token_ids",
        allowed="exactly one of text, token_ids or messages")
    sampling = sampling_from_proto(msg.sampling, defaults, vocab_size)
    if msg.logprobs > max_logprobs:
        raise ParamError("logprobs", msg.logprobs, f"in [0, {max_logprobs}]")
    prompt_logprobs = msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > max_logprobs:
        raise ParamError("prompt_logprobs", prompt_logprobs, f"unset or in [0, {max_logprobs}]")
    return ValidatedRequest(
        request_id=msg.request_id or make_request_id(),
        prompt_text=text, prompt_token_ids=token_ids, prompt_messages=messages,
        sampling=sampling,
        stopping=stopping_from(msg.stopping, NAMES.stopping, default_max_tokens, vocab_size,
                               # optional here; unset: true, vLLM's default
                               not msg.stopping.HasField("skip_special_tokens")
                               or msg.stopping.skip_special_tokens),
        num_logprobs=msg.logprobs, priority=msg.priority, names=NAMES,
        constraint=constraint_from_oneof(msg.constraint, "kind"),
        num_prompt_logprobs=prompt_logprobs, lora_name=msg.lora_name or None)


def limited_fields(msg: pb.GenerateRequest) -> LimitedFields:
    """What request_limits bounds, in this protocol's names (logprobs: request_from_proto)."""
    st = msg.stopping
    return LimitedFields(request_id=msg.request_id, text=msg.text, messages=msg.messages,
                         stop_prefix=NAMES.stopping, stop=st.stop, stop_token_ids=st.stop_token_ids,
                         constraint_prefix=NAMES.constraint, constraint_holder=msg.constraint,
                         constraint_oneof="kind", prompt_ids=msg.token_ids,
                         sampling_prefix=NAMES.sampling, sampling_holder=msg.sampling)


def sampling_from_proto(msg: pb.SamplingParams, defaults: SamplingParams = SamplingParams(),
                        vocab_size: int | None = None) -> SamplingParams:
    """Unset fields take `defaults`; an unset temperature is 0 (greedy) whatever the defaults."""
    given = given_knobs(msg)
    given.setdefault("temperature", 0.0)
    return sampling_from(given, msg.logit_bias, defaults, NAMES.sampling, vocab_size)


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every scalar knob set (seed only when not None): for publishing defaults in
    GetModelInfo."""
    msg = pb.SamplingParams()
    for k in KNOBS:
        value = getattr(params, k.name)
        if value is not None and not k.meta.ids:
            setattr(msg, k.name, value)
    return msg


def finish_reason_to_proto(status: RequestStatus | None) -> int:
    """The FinishReason of a finished status; FINISH_REASON_UNSPECIFIED while not finished."""
    if status is None or not status.finished:
        return pb.FINISH_REASON_UNSPECIFIED
    return _FINISH_REASONS[status]


# An output with more tokens than this has its message built on a worker thread, not on the event
# loop: a consumer that lagged 20,000 steps at 20 top logprobs gets one output whose message took
# ~1 s of CPU (each alternative's text decoded). One step's output stays inline (a thread hop
# costs more than it).
OFF_LOOP_TOKENS = 128


def builds_off_loop(out: RequestOutput) -> bool:
    """Whether `out`'s message is too costly for the event loop (prompt logprobs, or the
    tokens of many steps)."""
    return out.prompt_logprobs is not None or len(out.new_token_ids) > OFF_LOOP_TOKENS


def output_to_proto(out: RequestOutput, token_text: Callable[[int], str] | None = None,
                    request_id: str | None = None, prompt_ids: list[int] | None = None
                    ) -> pb.GenerateResponse:
    """One GenerateResponse for one RequestOutput. `token_text` (a token id's text on its own)
    fills TopLogprob.text; without it the text is left empty. `request_id`: the id the client
    knows (default: the output's). `prompt_ids`: the request's, naming the first prompt token
    of its prompt logprobs.

    finish_reason, the matched stop and the timings are set only when the output is finished.
    NOTE built in place (`add`, field by field): a stream sends one of these per step, and
    sub-messages passed to the constructor are built, then copied (twice the time).
    """
    msg = pb.GenerateResponse(request_id=out.request_id if request_id is None else request_id,
                              token_ids=out.new_token_ids, text=out.new_text)
    add_logprob = msg.logprobs.add
    for entry in out.logprobs:
        if entry.top_token_ids:
            _add_top_logprobs(add_logprob(token_id=entry.token_id, logprob=entry.logprob),
                              entry, token_text)
        else:
            add_logprob(token_id=entry.token_id, logprob=entry.logprob)
    if out.prompt_logprobs is not None:
        _add_prompt_logprobs(msg, out.prompt_logprobs, token_text, prompt_ids)
    usage = msg.usage
    usage.prompt_tokens = out.num_prompt_tokens
    usage.completion_tokens = out.num_output_tokens
    usage.cached_prompt_tokens = max(0, out.num_cached_tokens)
    if out.finished:
        msg.finish_reason = finish_reason_to_proto(out.finish_reason)
        if isinstance(out.stop_reason, str):
            msg.stop_string = out.stop_reason
        elif out.stop_reason is not None:
            msg.stop_token_id = out.stop_reason
        msg.timings.CopyFrom(timings_to_proto(out.timings))
    return msg


def _add_prompt_logprobs(msg: pb.GenerateResponse, entries: list[PromptLogprob | None],
                         token_text: Callable[[int], str] | None,
                         prompt_ids: list[int] | None) -> None:
    """vLLM's prompt logprobs (None first) as PromptTokenLogprob entries: the first names the
    first prompt token (from `prompt_ids`) and has no logprob."""
    add = msg.prompt_logprobs.add
    for entry in entries:
        if entry is None:
            add(token_id=prompt_ids[0] if prompt_ids else 0)
            continue
        _add_top_logprobs(add(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank),
                          entry, token_text)


def _add_top_logprobs(msg: pb.TokenLogprob, entry: TokenLogprob,
                      token_text: Callable[[int], str] | None) -> None:
    add_top = msg.top_logprobs.add
    for t, lp in zip(entry.top_token_ids, entry.top_logprobs):
        add_top(token_id=t, logprob=lp, text=token_text(t) if token_text else "")


def timings_to_proto(timings: RequestTimings) -> pb.Timings:
    """Seconds since arrival. A moment that has not happened leaves its field 0."""
    start = timings.arrival_time

    def since(moment: float | None) -> float:
        return max(0.0, moment - start) if moment is not None else 0.0

    return pb.Timings(queued_s=since(timings.first_scheduled_time),
                      time_to_first_token_s=since(timings.first_token_time),
                      total_s=since(timings.finish_time))
