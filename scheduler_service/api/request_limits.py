"""Per-request limits of the public API, checked on the protobuf before anything costly (the
tokenizer, the stop-string matcher, the engine) sees the request: deltaserve.v1.Generation's and
vllm.grpc.engine.VllmEngine's requests alike. Each violation is a ParamError (INVALID_ARGUMENT)
naming the field, what was sent and the flag that sets the limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine_common.request.diff_limits import MAX_CONSTRAINT_CHOICES, MAX_WAITING
from engine_common.request.params import ID_SET_KNOBS, ParamError
from engine_common.request.sampling_knobs import MAX_LOGIT_BIAS
from engine_common.wire.protos import generation_pb2 as pb
from scheduler_service.api.api_options import ApiOptions

MAX_REQUEST_ID_CHARS = 256
# Ids one Abort may name: as many requests as the waiting queue can ever hold (the ceiling of
# --max-waiting); a caller with more live requests aborts them in several calls. Only the
# message size bounded them: 8 MiB of empty ids is 4 million, 0.5 s of the event loop to walk.
MAX_ABORT_IDS = MAX_WAITING


@dataclass(frozen=True)
class LimitedFields:
    """The parts of a request the limits bound, as its protocol names them (each protocol's
    convert module maps its message onto this: `limited_fields`)."""

    request_id: str
    text: str
    messages: Sequence
    stop_prefix: str                 # errors name `<stop_prefix>.stop` / `.stop_token_ids`
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    constraint_prefix: str           # errors name `<constraint_prefix>.<kind>`
    constraint_holder: object        # the message whose oneof `constraint_oneof` holds it
    constraint_oneof: str
    logprobs_field: str = ""         # "" when the protocol checks logprobs while converting
    logprobs: int = 0
    prompt_ids: Sequence[int] = ()   # a prompt of token ids (FrontDoor.check_limits)
    sampling_prefix: str = ""        # errors name `<sampling_prefix>.logit_bias` and the id sets
    sampling_holder: object = None   # the SamplingParams message (logit_bias, allowed_token_ids)


def check_request_limits(f: LimitedFields, options: ApiOptions) -> None:
    """Every per-request limit, the first one exceeded a ParamError naming the field."""
    check_request_id(f.request_id)
    check_prompt_chars("text", f.text, options)
    check_messages_chars(f.messages, options)
    check_stops(f.stop_prefix, f.stop, f.stop_token_ids, options)
    check_constraint_chars(f.constraint_prefix, f.constraint_holder, f.constraint_oneof, options)
    check_sampling_sizes(f.sampling_prefix, f.sampling_holder)
    if f.logprobs_field and f.logprobs > options.max_logprobs:
        raise ParamError(f.logprobs_field, f.logprobs,
                         f"in [0, {options.max_logprobs}] (--max-logprobs)")


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ParamError("request_id", f"{len(request_id)} characters",
                         f"at most {MAX_REQUEST_ID_CHARS} characters")


def check_abort_ids(request_ids: Sequence[str]) -> None:
    """An Abort's `request_ids`, by count, before any id is looked at."""
    if len(request_ids) > MAX_ABORT_IDS:
        raise ParamError("request_ids", f"{len(request_ids)} ids",
                         f"at most {MAX_ABORT_IDS} ids (abort more in several calls)")


def check_stops(prefix: str, stop, stop_token_ids, options: ApiOptions) -> None:
    """Count and total length of the stop strings, count of the stop token ids (fields
    `<prefix>.stop` and `<prefix>.stop_token_ids`)."""
    if len(stop) > options.max_stop_strings:
        raise ParamError(f"{prefix}.stop", f"{len(stop)} strings",
                         f"at most {options.max_stop_strings} strings (--max-stop-strings)")
    total = sum(len(s) for s in stop)
    if total > options.max_stop_chars:
        raise ParamError(f"{prefix}.stop", f"{total} characters in all",
                         f"at most {options.max_stop_chars} characters (--max-stop-chars)")
    if len(stop_token_ids) > options.max_stop_token_ids:
        raise ParamError(f"{prefix}.stop_token_ids", f"{len(stop_token_ids)} ids",
                         f"at most {options.max_stop_token_ids} ids (--max-stop-token-ids)")


def check_constraint_chars(prefix: str, holder, oneof: str, options: ApiOptions) -> None:
    """The size of the constraint in `holder`'s oneof `oneof` (field `<prefix>.<kind>`), before
    the grammar engine validates it (on the tokenizer pool)."""
    kind = holder.WhichOneof(oneof)
    if kind is None or kind == "json_object":
        return
    value = holder.choice.choices if kind == "choice" else getattr(holder, kind)
    if kind == "choice" and len(value) > MAX_CONSTRAINT_CHOICES:   # empty ones count 0 chars
        raise ParamError(f"{prefix}.choice", f"{len(value)} choices",
                         f"at most {MAX_CONSTRAINT_CHOICES} choices")
    total = len(value) if isinstance(value, str) else sum(len(c) for c in value)
    if total > options.max_constraint_chars:
        raise ParamError(f"{prefix}.{kind}", f"{total} characters",
                         f"at most {options.max_constraint_chars} characters "
                         "(--max-constraint-chars)")


def check_sampling_sizes(prefix: str, sampling) -> None:
    """How many logit_bias entries and ids of each id set (allowed_token_ids) a SamplingParams
    message holds, before anything walks them: an 8 MiB message holds millions of one-byte ids,
    which the conversion copied, checked against the vocabulary and sorted on the event loop
    before it counted them."""
    if sampling is None:
        return
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS:
        raise ParamError(f"{prefix}.logit_bias", f"{len(sampling.logit_bias)} entries",
                         f"at most {MAX_LOGIT_BIAS}")
    for k in ID_SET_KNOBS:
        ids = getattr(sampling, k.name)
        if len(ids) > k.meta.max_ids:
            raise ParamError(f"{prefix}.{k.name}", f"{len(ids)} ids",
                             f"at most {k.meta.max_ids} ids")


def check_prompt_chars(field: str, text: str, options: ApiOptions) -> None:
    if len(text) > options.max_prompt_chars:
        raise ParamError(field, f"{len(text)} characters",
                         f"at most {options.max_prompt_chars} characters (--max-prompt-chars)")


def check_messages_chars(messages, options: ApiOptions) -> None:
    """A chat's roles and contents together count against --max-prompt-chars (before the
    template renders them)."""
    total = sum(len(m.role) + len(m.content) for m in messages)
    if total > options.max_prompt_chars:
        raise ParamError("messages", f"{total} characters",
                         f"at most {options.max_prompt_chars} characters (--max-prompt-chars)")


def check_messages_count(messages, max_model_len: int) -> None:
    """More messages than max_model_len tokens cannot fit (a template writes at least a role
    marker a message): refused before anything walks them. 671,744 one-character messages (3.4
    MB, within SmolLM2's character bound) cost the event loop 2 s to count and convert."""
    if len(messages) > max_model_len:
        raise ParamError("messages", f"{len(messages)} messages",
                         f"at most {max_model_len} messages (max_model_len {max_model_len} "
                         "tokens: every message renders to at least one)")


def check_prompt_can_fit(msg, chars_fit: int, max_model_len: int) -> None:
    """A text prompt or chat (`text`, `messages` of any of the three request messages) longer
    than `chars_fit` characters would tokenize to more than max_model_len tokens: refused before
    the tokenizer spends seconds on it. `chars_fit` is max_model_len x the most characters one
    token of the vocabulary covers (ServedModel.prompt_chars_fit), so no prompt that fits is
    refused."""
    for field, num_chars in (("text", len(msg.text)),
                             ("messages", sum(len(m.role) + len(m.content)
                                              for m in getattr(msg, "messages", ())))):
        if num_chars > chars_fit:
            raise ParamError(field, f"{num_chars} characters",
                             f"at most {chars_fit} characters: max_model_len {max_model_len} "
                             f"tokens x {chars_fit // max_model_len}, the most characters one "
                             "token of this model covers (a longer prompt cannot fit)")


def check_tokenize_limits(msg: pb.TokenizeRequest, options: ApiOptions) -> None:
    check_prompt_chars("text", msg.text, options)
    check_messages_chars(msg.messages, options)
