"""One front door: what both public protocols (deltaserve.v1.Generation and
vllm.grpc.engine.VllmEngine) share between their field mapping and the engine.

A protocol's convert module maps its protobuf fields onto the three conversions here
(prompt_from, sampling_from, stopping_from), each told the protocol's field names, and gets one
`ValidatedRequest`. Its servicer checks the message with `FrontDoor.check_limits` first (the
protocol's `limited_fields`), then hands the converted request to `FrontDoor.prompt_ids`
(constraint validated and text tokenized on the tokenizer pool, length checked) and
`engine_request` (the engine's Request). Every bad field is a ParamError naming the protocol's field, the value and the allowed
range; the servicer turns it into INVALID_ARGUMENT through `abort_with`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import grpc

from engine_common.text.chat_template import ChatMessage, ChatTemplate, encode_chat
from engine_common.constraints.constraint import Constraint
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import KNOBS, ParamError, SamplingParams, StoppingParams
from engine_common.request.pooling import PoolerConfig
from engine_common.text.tokenizer import Tokenizer
from engine_common.wire.codec import given_knobs
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.request_quota import RequestQuota
from scheduler_service.api.request_limits import (LimitedFields, check_messages_count,
                                                  check_prompt_can_fit, check_request_limits)
from scheduler_service.api.status import status_for
from scheduler_service.api.tokenizer_pool import TokenizerPool
from scheduler_service.core.lora_registry import LoRARegistry
from scheduler_service.core.request import Request
from scheduler_service.errors import EngineUnavailable, WrongRunner

log = logging.getLogger(__name__)

# Most top alternatives a request may ask for per token.
MAX_LOGPROBS = 20
_ABORT_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class ServedModel:
    """What both services publish about the model and the engine's shape."""

    info: ModelInfo
    tokenizer: Tokenizer
    block_size: int
    num_workers: int = 1
    default_sampling: SamplingParams = SamplingParams()
    chat_template: ChatTemplate | None = None
    # --runner pooling: how Embed pools (engine_common/request/pooling.py); None: generation.
    pooler: PoolerConfig | None = None
    # The LoRA adapters served now, by name (core/lora_registry.py); empty without LoRA
    lora: LoRARegistry = field(default_factory=LoRARegistry)
    # The step's token budget (--max-num-batched-tokens): an encoder's prompt must fit it.
    max_step_tokens: int | None = None
    # Requests in a step's batch (--max-num-seqs): one Classify / Score call keeps at most
    # this many of its own in flight (scoring.py), so it never floods the shared waiting queue.
    max_num_seqs: int | None = None
    # Characters beyond which a prompt cannot fit max_model_len whatever its text: refused
    # before tokenizing (request_limits.check_prompt_can_fit). Derived here, once, at start.
    prompt_chars_fit: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "prompt_chars_fit",
                           self.info.max_model_len * self.tokenizer.max_token_bytes())

    def check_runner(self, call: str) -> None:
        """WrongRunner unless this server's runner serves `call` (Embed or Generate; Classify
        and Score: a classification model's pooling runner)."""
        pooling = self.pooler is not None
        if call in ("Classify", "Score"):
            if not (pooling and self.pooler.classify):
                does = "embeds" if pooling else "generates"
                raise WrongRunner(f"{call}: this server's model {does}; {call} needs a "
                                  "sequence classification model (*ForSequenceClassification) "
                                  "with --runner pooling")
        elif pooling != (call == "Embed"):
            runner = "pooling" if pooling else "generate"
            raise WrongRunner(f"{call}: this server runs --runner {runner}; {call} needs "
                              f"--runner {'generate' if pooling else 'pooling'}")

    def chat_prompt_ids(self, messages) -> list[int]:
        """Token ids of chat messages, rendered with the model's template (ParamError if none,
        or if the rendered text is longer than any prompt that fits: not tokenized then)."""
        return encode_chat(self.tokenizer, self.chat_template, messages, repr(self.info.name),
                           max_chars=self.prompt_chars_fit)


@dataclass(frozen=True)
class FieldNames:
    """Where a protocol keeps the parts of a request: the prefixes its errors name."""

    sampling: str
    stopping: str
    constraint: str


@dataclass(frozen=True)
class ValidatedRequest:
    """A request of either protocol, every field checked. Exactly one of prompt_text /
    prompt_token_ids / prompt_messages is not None. `num_logprobs` None: none asked; k: the
    sampled token's and k alternatives. `n` choices, each its own engine request."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: SamplingParams
    stopping: StoppingParams
    num_logprobs: int | None
    names: FieldNames
    priority: int = 0
    prompt_messages: tuple[ChatMessage, ...] | None = None
    constraint: Constraint | None = None
    n: int = 1
    stream: bool = True
    # Prompt logprobs: None none asked; k each prompt token's logprob and rank, with k
    # alternatives per position (every choice of an n > 1 request computes them, as vLLM's).
    num_prompt_logprobs: int | None = None
    # The LoRA adapter's name (GenerateRequest.lora_name); None: the base model
    lora_name: str | None = None


def new_request_id() -> str:
    """A fresh server-assigned request id (32 hex characters)."""
    return uuid.uuid4().hex


# -- the three conversions ---------------------------------------------------------------------

def prompt_from(given: dict[str, object], vocab_size: int | None, *, field_name: str,
                allowed: str, ids_field: str
                ) -> tuple[str | None, tuple[int, ...] | None, tuple[ChatMessage, ...] | None]:
    """(text, token_ids, messages), exactly one not None, from the prompt fields a request set
    (`given`: "text", `ids_field` or "messages" -> value). `field_name`/`allowed` name the
    choice when not exactly one is set."""
    if len(given) != 1:
        raise ParamError(field_name, " and ".join(given) if given else "none given", allowed)
    (name, value), = given.items()
    if name == "text":
        if not value:
            raise ParamError("text", value, "a non-empty string")
        return value, None, None
    if name == "messages":
        return None, None, messages_from_proto(value)
    ids = tuple(value)
    if not ids:
        raise ParamError(ids_field, [], "at least one token id")
    check_vocab(ids_field, ids, vocab_size)
    return None, ids, None


def sampling_from(given: dict[str, object], logit_bias, defaults: SamplingParams,
                  prefix: str, vocab_size: int | None) -> SamplingParams:
    """`defaults` with the knobs a request set (`given`, by SamplingParams name) and its
    logit_bias; errors name `<prefix>.<knob>`."""
    check_bias_vocab(f"{prefix}.logit_bias", logit_bias, vocab_size)
    for k in KNOBS:
        if k.meta.ids and k.name in given:
            check_vocab(f"{prefix}.{k.name}", given[k.name], vocab_size)
    try:
        return dataclasses.replace(defaults, **given, logit_bias=dict(logit_bias))
    except ParamError as e:
        raise ParamError(f"{prefix}.{e.field}", e.value, e.allowed) from None


def stopping_from(msg, prefix: str, default_max_tokens: int | None,
                  vocab_size: int | None, skip_special_tokens: bool) -> StoppingParams:
    """StoppingParams from the message holding the stopping fields (the same names in both
    protocols); an unset max_tokens takes `default_max_tokens` (None: until max_model_len).
    `skip_special_tokens` as each protocol reads its own field."""
    check_vocab(f"{prefix}.stop_token_ids", msg.stop_token_ids, vocab_size)
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens
    try:
        return StoppingParams(
            max_tokens=max_tokens, min_tokens=msg.min_tokens, stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            include_stop_str_in_output=msg.include_stop_str_in_output,
            skip_special_tokens=skip_special_tokens)
    except ParamError as e:
        raise ParamError(f"{prefix}.{e.field}", e.value, e.allowed) from None


# -- checks both protocols make ------------------------------------------------------------------

def messages_from_proto(msgs) -> tuple[ChatMessage, ...]:
    """ChatMessage protos -> domain messages; every role must be non-empty."""
    for i, m in enumerate(msgs):
        if not m.role:
            raise ParamError(f"messages[{i}].role", m.role,
                             "a non-empty string (system, user, assistant, ...)")
    return tuple(ChatMessage(m.role, m.content) for m in msgs)


def check_vocab(name: str, ids, vocab_size: int | None) -> None:
    """Every id of the list `ids` below vocab_size (ParamError names `<name>[index]`)."""
    if vocab_size is None:
        return
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise ParamError(f"{name}[{i}]", token_id, f"in [0, {vocab_size - 1}] (vocab_size)")


def check_bias_vocab(name: str, logit_bias, vocab_size: int | None) -> None:
    """Every logit_bias token id below vocab_size (ParamError names `<name>[id]`)."""
    for token_id in sorted(logit_bias):
        if vocab_size is not None and token_id >= vocab_size:
            raise ParamError(f"{name}[{token_id}]", token_id,
                             f"a token id in [0, {vocab_size - 1}] (vocab_size)")


def constraint_from_oneof(msg, oneof: str) -> Constraint | None:
    """The Constraint in `msg`'s oneof `oneof` (names and shapes as in vLLM's
    SamplingParams.constraint), None when unset; its shape is checked, its grammar not yet
    (checked_constraint, on the tokenizer pool)."""
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


@contextmanager
def constraint_named(prefix: str):
    """ParamErrors on `constraint.<kind>` renamed to the protocol's `<prefix>.<kind>`."""
    try:
        yield
    except ParamError as e:
        name = e.field.replace("constraint.", f"{prefix}.", 1)
        raise ParamError(name, e.value, e.allowed) from None


def check_prompt_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                        stopping: str = "stopping", min_tokens: int = 0) -> None:
    """Raise ParamError unless the prompt leaves room for at least one token (and max_tokens
    and min_tokens, named `<stopping>.max_tokens` / `.min_tokens`). min_tokens matters when
    max_tokens is unset: no request makes more than the room, and the worker holds min_tokens
    in an int32 (a step carrying 2**31 is refused, failing every stream: admission.py)."""
    if num_prompt_tokens >= max_model_len:
        raise ParamError("prompt", f"{num_prompt_tokens} tokens",
                         f"at most {max_model_len - 1} tokens (max_model_len {max_model_len})")
    room = max_model_len - num_prompt_tokens
    for name, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens)):
        if value is not None and value > room:
            raise ParamError(f"{stopping}.{name}", value,
                             f"<= {room} (max_model_len {max_model_len} - {num_prompt_tokens} "
                             "prompt tokens)")


# -- admission ---------------------------------------------------------------------------------

class FrontDoor:
    """The model, the request limits and the tokenizer pool both servicers admit requests
    through."""

    def __init__(self, model: ServedModel, options: ApiOptions,
                 tokenizer_pool: TokenizerPool | None = None, quota: RequestQuota | None = None):
        """`tokenizer_pool`, `quota`: shared with the port's other services (ones of its own if
        None)."""
        self.model = model
        self.options = options
        self.pool = tokenizer_pool or TokenizerPool(options.tokenizer_threads)
        self.quota = quota or RequestQuota(options.max_requests_per_key)

    def check_limits(self, msg, fields: LimitedFields) -> None:
        """The request limits (`fields`: the protocol's mapping of `msg`) and whether its text
        or token ids can fit max_model_len at all: all before anything costly sees the
        request."""
        check_messages_count(fields.messages, self.model.info.max_model_len)
        check_request_limits(fields, self.options)
        check_prompt_can_fit(msg, self.model.prompt_chars_fit, self.model.info.max_model_len)
        # Token ids too many to fit, refused before they are copied and checked one by one.
        check_prompt_length(len(fields.prompt_ids), None, self.model.info.max_model_len)

    async def offload(self, caller: str, fn, *args):
        """Tokenizing, chat rendering and constraint validation run on the pool, within
        `caller`'s share of it: the event loop keeps serving the other streams meanwhile."""
        return await self.pool.run(fn, *args, caller=caller)

    async def prompt_ids(self, req: ValidatedRequest, caller: str) -> list[int]:
        """The prompt's token ids once its constraint is validated and its text or chat
        tokenized (on the pool), its length checked against max_model_len."""
        if req.constraint is not None:
            with constraint_named(req.names.constraint):
                await self.offload(caller, checked_constraint, req.constraint)
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        elif req.prompt_messages is not None:
            ids = await self.offload(caller, self.model.chat_prompt_ids, req.prompt_messages)
        else:
            ids = await self.offload(caller, self.model.tokenizer.encode, req.prompt_text)
        check_prompt_length(len(ids), req.stopping.max_tokens, self.model.info.max_model_len,
                            req.names.stopping, req.stopping.min_tokens)
        return ids

    def engine_request(self, req: ValidatedRequest, request_id: str, prompt_ids: list[int],
                       cache_salt: str, sampling: SamplingParams | None = None) -> Request:
        """The engine's Request (`sampling`: this choice's, when not the request's own).
        `prompt_ids` (prompt_ids()'s own list) is shared, not copied: nothing changes a
        prompt, and a copy per choice cost n=1024 choices of a 100k-token prompt ~0.8 GB and
        ~1 s of the event loop."""
        lora_id, generation = self.model.lora.resolve(req.lora_name, "lora_name")
        return Request(request_id, prompt_ids, sampling or req.sampling, req.stopping,
                       self.model.info.eos_token_ids, num_logprobs=req.num_logprobs,
                       priority=req.priority, constraint=req.constraint, cache_salt=cache_salt,
                       num_prompt_logprobs=req.num_prompt_logprobs, lora_id=lora_id,
                       lora_generation=generation, lora_name=req.lora_name or "")


async def abort_requests(engine, ids: list[str], context: grpc.aio.ServicerContext) -> int:
    """Abort the engine requests `ids`; UNAVAILABLE when the engine does not answer."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(engine.abort(ids)),
                                      _ABORT_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        await abort_with(context, EngineUnavailable("the engine did not answer the abort"))


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """End the call with the status status_for gives `error` (logged when INTERNAL)."""
    code, message = status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error", exc_info=error)
    await context.abort(code, message)
