"""Generation API protobuf <-> domain objects. Pure functions: no I/O, no engine state.

Requests come in as `GenerateRequest` and leave as a `GenerateInput` of validated domain params;
every bad field raises `ParamError` naming the field (in proto terms, e.g. `sampling.top_p`), the
value and the allowed range, which the servicer maps to INVALID_ARGUMENT. Outputs of the output
processor go back as `GenerateResponse` messages.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Callable

from engine_common.chat_template import ChatMessage
from engine_common.constraint import Constraint
from engine_common.params import ParamError, SamplingParams, StoppingParams
from engine_common.protos import generation_pb2 as pb
from scheduler_service.engine.output_processor import RequestOutput, RequestTimings, TokenLogprob
from scheduler_service.core.request import RequestStatus

# Most top alternatives a request may ask for per token.
MAX_LOGPROBS = 20

# Proto field names equal the domain SamplingParams field names.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed")

_FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: pb.LENGTH,
    RequestStatus.FINISHED_STOP_TOKEN: pb.STOP_TOKEN,
    RequestStatus.FINISHED_STOP_STRING: pb.STOP_STRING,
    RequestStatus.FINISHED_ABORTED: pb.ABORT,
}


@dataclass(frozen=True)
class GenerateInput:
    """A validated GenerateRequest. Exactly one of prompt_text / prompt_token_ids /
    prompt_messages is not None."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: SamplingParams
    stopping: StoppingParams
    num_logprobs: int
    priority: int
    prompt_messages: tuple[ChatMessage, ...] | None = None
    constraint: Constraint | None = None


def new_request_id() -> str:
    """A fresh server-assigned request id (32 hex characters)."""
    return uuid.uuid4().hex


def request_from_proto(msg: pb.GenerateRequest, *, defaults: SamplingParams = SamplingParams(),
                       vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS,
                       default_max_tokens: int | None = None,
                       make_request_id: Callable[[], str] = new_request_id) -> GenerateInput:
    """Validate a GenerateRequest and convert it; raises ParamError on the first bad field.

    `defaults` fills unset sampling fields (temperature excepted: unset means greedy).
    `vocab_size`, when given, bounds prompt token ids and stop token ids.
    `default_max_tokens` applies when stopping.max_tokens is unset (None: up to max_model_len).
    The prompt's length against max_model_len is checked after tokenization: check_prompt_length.
    """
    text, token_ids, messages = _prompt_from_proto(msg, vocab_size)
    check_bias_vocab("sampling.logit_bias", msg.sampling.logit_bias, vocab_size)
    if msg.logprobs > max_logprobs:
        raise ParamError("logprobs", msg.logprobs, f"in [0, {max_logprobs}]")
    return GenerateInput(
        request_id=msg.request_id or make_request_id(),
        prompt_text=text,
        prompt_token_ids=token_ids,
        sampling=sampling_from_proto(msg.sampling, defaults),
        stopping=stopping_from_proto(msg.stopping, default_max_tokens, vocab_size),
        num_logprobs=msg.logprobs,
        priority=msg.priority,
        prompt_messages=messages,
        constraint=constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None,
    )


def _prompt_from_proto(msg: pb.GenerateRequest, vocab_size: int | None):
    """(text, token_ids, messages) with exactly one not None."""
    given = [name for name, present in (("text", msg.HasField("text")),
                                        ("token_ids", len(msg.token_ids) > 0),
                                        ("messages", len(msg.messages) > 0)) if present]
    if len(given) != 1:
        raise ParamError("prompt", " and ".join(given) if given else "none given",
                         "exactly one of text, token_ids or messages")
    if given == ["text"]:
        if not msg.text:
            raise ParamError("text", msg.text, "a non-empty string")
        return msg.text, None, None
    if given == ["messages"]:
        return None, None, messages_from_proto(msg.messages)
    ids = tuple(msg.token_ids)
    _check_vocab("token_ids", ids, vocab_size)
    return None, ids, None


def messages_from_proto(msgs) -> tuple[ChatMessage, ...]:
    """ChatMessage protos -> domain messages; every role must be non-empty."""
    for i, m in enumerate(msgs):
        if not m.role:
            raise ParamError(f"messages[{i}].role", m.role,
                             "a non-empty string (system, user, assistant, ...)")
    return tuple(ChatMessage(m.role, m.content) for m in msgs)


def check_bias_vocab(name: str, logit_bias, vocab_size: int | None) -> None:
    """Every logit_bias token id below vocab_size (ParamError names the id)."""
    for token_id in sorted(logit_bias):
        if vocab_size is not None and token_id >= vocab_size:
            raise ParamError(f"{name}[{token_id}]", token_id,
                             f"a token id in [0, {vocab_size - 1}] (vocab_size)")


def _check_vocab(name: str, ids, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise ParamError(f"{name}[{i}]", token_id, f"in [0, {vocab_size - 1}] (vocab_size)")


def constraint_from_proto(msg: pb.Constraint) -> Constraint | None:
    """The set kind of a Constraint with its shape checked (ParamError naming
    `constraint.<kind>`); None when no kind is set. Not yet validated by the grammar engine:
    that is checked_constraint, which the servicer runs on the tokenizer pool."""
    return constraint_from_oneof(msg, "kind")


def constraint_from_oneof(msg, oneof: str) -> Constraint | None:
    """The same from any message whose oneof `oneof` has the Constraint fields (names and
    shapes as in vLLM's SamplingParams.constraint): a kind we do not support (structural_tag)
    is a ParamError naming it."""
    kind = msg.WhichOneof(oneof)
    if kind is None:
        return None
    value = tuple(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return Constraint(kind, value)


def checked_constraint(constraint: Constraint | None) -> Constraint | None:
    """The constraint once the grammar engine accepts it (ParamError naming
    `constraint.<kind>` and quoting the engine's message). It costs up to the constraint's size
    in llguidance time (which releases the GIL): servicers run it on the tokenizer pool, never
    on the event loop."""
    return None if constraint is None else constraint.validate()


def sampling_from_proto(msg: pb.SamplingParams,
                        defaults: SamplingParams = SamplingParams()) -> SamplingParams:
    """Unset fields take `defaults`; an unset temperature is 0 (greedy) whatever the defaults."""
    values = {name: getattr(msg, name) if msg.HasField(name) else getattr(defaults, name)
              for name in _SAMPLING_FIELDS}
    if not msg.HasField("temperature"):
        values["temperature"] = 0.0
    try:
        return SamplingParams(**values, logit_bias=dict(msg.logit_bias))
    except ParamError as e:
        raise ParamError(f"sampling.{e.field}", e.value, e.allowed) from None


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every field set (seed only when not None): for publishing defaults in GetModelInfo."""
    msg = pb.SamplingParams()
    for name in _SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def stopping_from_proto(msg: pb.StoppingCriteria, default_max_tokens: int | None = None,
                        vocab_size: int | None = None) -> StoppingParams:
    """Unset max_tokens takes `default_max_tokens` (None: until max_model_len)."""
    _check_vocab("stopping.stop_token_ids", msg.stop_token_ids, vocab_size)
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens
    try:
        return StoppingParams(
            max_tokens=max_tokens, min_tokens=msg.min_tokens, stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            include_stop_str_in_output=msg.include_stop_str_in_output)
    except ParamError as e:
        raise ParamError(f"stopping.{e.field}", e.value, e.allowed) from None


def check_prompt_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raise ParamError unless the prompt leaves room for at least one token (and max_tokens)."""
    if num_prompt_tokens >= max_model_len:
        raise ParamError("prompt", f"{num_prompt_tokens} tokens",
                         f"at most {max_model_len - 1} tokens (max_model_len {max_model_len})")
    room = max_model_len - num_prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise ParamError("stopping.max_tokens", max_tokens,
                         f"<= {room} (max_model_len {max_model_len} - {num_prompt_tokens} "
                         "prompt tokens)")


def finish_reason_to_proto(status: RequestStatus | None) -> int:
    """The FinishReason of a finished status; FINISH_REASON_UNSPECIFIED while not finished."""
    if status is None or not status.finished:
        return pb.FINISH_REASON_UNSPECIFIED
    return _FINISH_REASONS[status]


def output_to_proto(out: RequestOutput,
                    token_text: Callable[[int], str] | None = None) -> pb.GenerateResponse:
    """One GenerateResponse for one RequestOutput. `token_text` (a token id's text on its own)
    fills TopLogprob.text; without it the text is left empty.

    finish_reason, the matched stop and the timings are set only when the output is finished.
    """
    msg = pb.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text,
        logprobs=[_logprob_to_proto(entry, token_text) for entry in out.logprobs],
        usage=pb.Usage(prompt_tokens=out.num_prompt_tokens,
                       completion_tokens=out.num_output_tokens,
                       cached_prompt_tokens=max(0, out.num_cached_tokens)))
    if out.finished:
        msg.finish_reason = finish_reason_to_proto(out.finish_reason)
        if isinstance(out.stop_reason, str):
            msg.stop_string = out.stop_reason
        elif out.stop_reason is not None:
            msg.stop_token_id = out.stop_reason
        msg.timings.CopyFrom(timings_to_proto(out.timings))
    return msg


def _logprob_to_proto(entry: TokenLogprob,
                      token_text: Callable[[int], str] | None) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=t, logprob=lp, text=token_text(t) if token_text else "")
           for t, lp in zip(entry.top_token_ids, entry.top_logprobs)]
    return pb.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, top_logprobs=top)


def timings_to_proto(timings: RequestTimings) -> pb.Timings:
    """Seconds since arrival. A moment that has not happened leaves its field 0."""
    start = timings.arrival_time

    def since(moment: float | None) -> float:
        return max(0.0, moment - start) if moment is not None else 0.0

    return pb.Timings(queued_s=since(timings.first_scheduled_time),
                      time_to_first_token_s=since(timings.first_token_time),
                      total_s=since(timings.finish_time))
