"""vllm.grpc.engine protobuf (the Shepherd Model Gateway's worker protocol) <-> domain objects.
Pure functions: no I/O, no engine state.

Requests: a `GenerateRequest` becomes the front door's `ValidatedRequest` (this module keeps
only the field mapping; front_door.py does the conversions). A field we cannot honour is
refused, never ignored: ParamError naming it (INVALID_ARGUMENT at the edge). The `constraint`
oneof of SamplingParams (structured output) maps 1:1 onto engine_common's Constraint
(json_schema, regex, grammar, json_object, choice), its shape checked here and validated by the
grammar engine at admission (FrontDoor.prompt_ids, on the tokenizer pool); `structural_tag` is
refused by name.
Proto3 scalars have no "unset": a sampling field left at 0 takes the server default (published
in GetModelInfo.default_sampling_params_json), and so does an unset `temperature`.

Responses follow vLLM's own servicer, which the gateway is written against:
  * streaming: one `chunk` per engine step that produced tokens (the step's token ids, its own
    count as completion_tokens: the gateway adds them up), then, when the request ends, a
    `complete` carrying the last step's ids again with the finish reason and the matched stop;
  * not streaming: one `complete` per choice with every output id and logprob;
  * finish_reason "stop" (eos, a stop token id or a stop string), "length" or "abort".
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Callable

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import KNOBS, ParamError, SamplingParams, StoppingParams
from engine_common.wire.protos import smg_common_pb2 as cpb
from engine_common.wire.protos import vllm_engine_pb2 as pb
from scheduler_service.api.front_door import (MAX_LOGPROBS, FieldNames, ValidatedRequest,
                                              constraint_from_oneof, constraint_named,
                                              given_knobs,
                                              new_request_id, prompt_from, sampling_from,
                                              stopping_from)
from scheduler_service.api.request_limits import LimitedFields
from scheduler_service.core.kv_events import (FULL_GROUP, AllBlocksCleared, BlockRemoved,
                                              BlockStored, KvGroupTag)
from scheduler_service.core.request import RequestStatus
from scheduler_service.engine.kv_event_publisher import KvEventBatch
from scheduler_service.engine.output_processor import RequestOutput, TokenLogprob
from scheduler_service.engine.request_output import PromptLogprob

# Most parallel samples (`n`) one request may ask for.
MAX_N = 128
# The sampling defaults published in default_sampling_params_json (the keys vLLM publishes).
DEFAULT_SAMPLING_KEYS = tuple(k.name for k in KNOBS if k.meta.generation_config)
_SEED_RANGE = 2**32          # a negative int32 seed s samples as s + 2**32
_CHILD_SEED_MODULUS = 2**63  # child i of a seeded n > 1 request samples with seed + i

FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_STOP_TOKEN: "stop",
    RequestStatus.FINISHED_STOP_STRING: "stop",
    RequestStatus.FINISHED_ABORTED: "abort",
}

# GenerateRequest / SamplingParams fields we cannot honour: (field, why) -> INVALID_ARGUMENT.
_UNSUPPORTED_REQUEST_FIELDS = (
    ("kv_transfer_params", "unset: KV transfer (prefill/decode disaggregation) is not supported"),
    ("kv_transfer_params_json",
     "unset: KV transfer (prefill/decode disaggregation) is not supported"),
    ("mm_inputs", "unset: multimodal input is not supported"),
    ("media_refs", "unset: multimodal input is not supported"),
)
_UNSUPPORTED_SAMPLING_FIELDS = (
    ("truncate_prompt_tokens", "unset: prompt truncation is not supported"),
    ("structural_tag", "unset: structural tags are not supported (structured output supports "
                       "json_schema, regex, grammar, json_object and choice)"),
)


NAMES = FieldNames(sampling="sampling_params", stopping="sampling_params",
                   constraint="sampling_params")


def request_from_proto(msg: pb.GenerateRequest, *, defaults: SamplingParams = SamplingParams(),
                       vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS,
                       make_request_id: Callable[[], str] = new_request_id) -> ValidatedRequest:
    """Validate a GenerateRequest and convert it; raises ParamError on the first bad field.
    `max_logprobs`: the most alternatives per token a request may ask for (--max-logprobs)."""
    refuse_unsupported(msg)
    kind = msg.WhichOneof("input")
    prompt = {} if kind is None else {
        "text": msg.text} if kind == "text" else {"tokenized.input_ids": msg.tokenized.input_ids}
    text, ids, _ = prompt_from(prompt, vocab_size, field_name="input", ids_field=
                               "tokenized.input_ids", allowed="tokenized.input_ids or text")
    sp = msg.sampling_params
    n = sp.n or 1
    if n > MAX_N:
        raise ParamError("sampling_params.n", n, f"in [1, {MAX_N}]")
    num_logprobs = None
    if sp.HasField("logprobs"):
        num_logprobs = sp.logprobs
        if not 0 <= num_logprobs <= max_logprobs:
            raise ParamError("sampling_params.logprobs", num_logprobs,
                             f"in [0, {max_logprobs}] (-1, every token, is not supported)")
    num_prompt_logprobs = None
    if sp.HasField("prompt_logprobs"):
        num_prompt_logprobs = sp.prompt_logprobs
        if not 0 <= num_prompt_logprobs <= max_logprobs:
            raise ParamError("sampling_params.prompt_logprobs", num_prompt_logprobs,
                             f"in [0, {max_logprobs}] (-1, every token, is not supported)")
    with constraint_named(NAMES.constraint):
        constraint = constraint_from_oneof(sp, "constraint")
    return ValidatedRequest(
        request_id=msg.request_id or make_request_id(), prompt_text=text, prompt_token_ids=ids,
        sampling=sampling_from_proto(sp, defaults, vocab_size),
        # a plain bool its clients set (smg: true; false for Harmony's special-token stops)
        stopping=stopping_from(sp, NAMES.stopping, None, vocab_size, sp.skip_special_tokens),
        num_logprobs=num_logprobs, names=NAMES, n=n, stream=msg.stream, constraint=constraint,
        num_prompt_logprobs=num_prompt_logprobs)


def limited_fields(msg: pb.GenerateRequest) -> LimitedFields:
    """What request_limits bounds, in this protocol's names."""
    sp = msg.sampling_params
    return LimitedFields(request_id=msg.request_id, text=msg.text, messages=(),
                         stop_prefix=NAMES.stopping, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
                         constraint_prefix=NAMES.constraint, constraint_holder=sp,
                         constraint_oneof="constraint", logprobs_field="sampling_params.logprobs",
                         logprobs=sp.logprobs if sp.HasField("logprobs") else 0,
                         prompt_ids=msg.tokenized.input_ids, sampling_prefix=NAMES.sampling,
                         sampling_holder=sp)


def refuse_unsupported(msg: pb.GenerateRequest) -> None:
    """ParamError for the first field set that DeltaServe cannot honour."""
    for name, allowed in _UNSUPPORTED_REQUEST_FIELDS:
        if msg.HasField(name):
            raise ParamError(name, "set", allowed)
    if msg.extra_mm_inputs:
        raise ParamError("extra_mm_inputs", f"{len(msg.extra_mm_inputs)} batches",
                         "empty: multimodal input is not supported")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise ParamError("data_parallel_rank", msg.data_parallel_rank,
                         "unset or 0: a DeltaServe replica is one data-parallel rank")
    sp = msg.sampling_params
    for name, allowed in _UNSUPPORTED_SAMPLING_FIELDS:
        if sp.HasField(name):
            raise ParamError(f"sampling_params.{name}", getattr(sp, name), allowed)


def sampling_from_proto(sp: pb.SamplingParams, defaults: SamplingParams = SamplingParams(),
                        vocab_size: int | None = None) -> SamplingParams:
    """A field at 0 (and an unset temperature or seed) takes `defaults`. A negative seed s
    samples as s + 2**32 (the proto's seed is int32; ours is non-negative)."""
    given = given_knobs(sp)
    if sp.HasField("seed"):
        given["seed"] = sp.seed if sp.seed >= 0 else sp.seed + _SEED_RANGE
    return sampling_from(given, sp.logit_bias, defaults, NAMES.sampling, vocab_size)


def child_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of an n > 1 request: a seeded request's choices sample with seed + index
    (so they differ and stay reproducible); unseeded ones each get a seed of their own."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % _CHILD_SEED_MODULUS)


# -- responses --------------------------------------------------------------------------------

def output_logprobs_to_proto(entries: list[TokenLogprob], num_logprobs: int
                             ) -> pb.OutputLogProbs:
    """Each token's logprob; with num_logprobs > 0 also its best alternatives (best first)."""
    msg = pb.OutputLogProbs(token_logprobs=[e.logprob for e in entries],
                            token_ids=[e.token_id for e in entries])
    if num_logprobs > 0:
        msg.top_logprobs.extend(pb.TopLogProbs(values=e.top_logprobs, token_ids=e.top_token_ids)
                                for e in entries)
    return msg


def input_logprobs_to_proto(entries: list[PromptLogprob | None], prompt_ids: list[int],
                            k: int) -> pb.InputLogProbs:
    """vLLM's servicer's InputLogProbs: every prompt token's id and logprob (unset for the
    first), and with k > 0 each position's best alternatives (empty for the first)."""
    msg = pb.InputLogProbs(token_ids=prompt_ids)
    for e in entries:
        if e is None:
            msg.token_logprobs.add()
        else:
            msg.token_logprobs.add(value=e.logprob)
        if k > 0:
            msg.top_logprobs.add() if e is None else msg.top_logprobs.add(
                values=e.top_logprobs, token_ids=e.top_token_ids)
    return msg


def chunk_to_proto(out: RequestOutput, index: int, num_logprobs: int | None,
                   prompt_ids: list[int] = (), num_prompt_logprobs: int = 0
                   ) -> pb.GenerateResponse:
    """One streamed step: its new token ids (completion_tokens counts only them), and on the
    first one the prompt logprobs of a request that asked for them."""
    chunk = pb.GenerateStreamChunk(
        token_ids=out.new_token_ids, prompt_tokens=out.num_prompt_tokens,
        completion_tokens=len(out.new_token_ids), cached_tokens=out.num_cached_tokens,
        index=index)
    if num_logprobs is not None and out.logprobs:
        chunk.output_logprobs.CopyFrom(output_logprobs_to_proto(out.logprobs, num_logprobs))
    if out.prompt_logprobs:
        chunk.input_logprobs.CopyFrom(input_logprobs_to_proto(
            out.prompt_logprobs, prompt_ids, num_prompt_logprobs))
    return pb.GenerateResponse(chunk=chunk)


def complete_to_proto(final: RequestOutput, index: int, num_logprobs: int | None,
                      token_ids: list[int], logprobs: list[TokenLogprob],
                      eos_token_id: int | None = None,
                      input_logprobs: pb.InputLogProbs | None = None) -> pb.GenerateResponse:
    """The end of one choice. `token_ids`/`logprobs`: every output (not streaming) or the last
    step's (streaming, as vLLM sends them). `eos_token_id`: the tokenizer's eos (None under
    ignore_eos); a finish on it names no matched token, as vLLM's stop_reason is None there
    (only stop_token_ids and the generation config's other eos ids are named).
    `input_logprobs`: the prompt logprobs, when the request asked for them."""
    complete = pb.GenerateComplete(
        output_ids=token_ids, finish_reason=FINISH_REASONS.get(final.finish_reason, "abort"),
        prompt_tokens=final.num_prompt_tokens, completion_tokens=len(token_ids),
        cached_tokens=final.num_cached_tokens, index=index)
    if isinstance(final.stop_reason, str):
        complete.matched_stop_str = final.stop_reason
    elif final.stop_reason is not None and final.stop_reason != eos_token_id:
        complete.matched_token_id = final.stop_reason
    if num_logprobs is not None and logprobs:
        complete.output_logprobs.CopyFrom(output_logprobs_to_proto(logprobs, num_logprobs))
    if input_logprobs is not None:
        complete.input_logprobs.CopyFrom(input_logprobs)
    return pb.GenerateResponse(complete=complete)


# -- model, server, loads ---------------------------------------------------------------------

def default_sampling_json(defaults: SamplingParams) -> str:
    """The sampling defaults a gateway fills unset client fields with, as compact JSON."""
    return json.dumps({k: getattr(defaults, k) for k in DEFAULT_SAMPLING_KEYS},
                      separators=(",", ":"))


def model_info_to_proto(info: ModelInfo, bos_token_id: int | None,
                        defaults: SamplingParams) -> pb.GetModelInfoResponse:
    config = info.hf_config
    return pb.GetModelInfoResponse(
        model_path=info.path, is_generation=True, max_context_length=info.max_model_len,
        vocab_size=info.vocab_size, supports_vision=False, served_model_name=info.name,
        tokenizer_path=info.path, model_type=str(config.get("model_type") or ""),
        architectures=[str(a) for a in config.get("architectures") or [info.architecture]],
        eos_token_ids=list(info.eos_token_ids),
        pad_token_id=_int_or_zero(config.get("pad_token_id")),
        bos_token_id=_int_or_zero(config.get("bos_token_id", bos_token_id)),
        max_req_input_len=info.max_model_len - 1,
        default_sampling_params_json=default_sampling_json(defaults))


def _int_or_zero(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass(frozen=True)
class EngineShape:
    """What GetServerInfo and GetLoads report about the engine's configuration."""

    block_size: int
    max_num_seqs: int
    dtype: str
    attention_backend: str
    # The scheduler's waiting-queue bound: a Generate's n choices queue together, so n above
    # it can never be admitted (refused by name, not answered RESOURCE_EXHAUSTED forever).
    max_waiting: int | None = None
    kv_cache_dtype: str = "auto"      # --kv-cache-dtype as given (vLLM reports its flag too)


def server_info_to_proto(num_active: int, uptime_s: float, last_receive_s: float,
                         shape: EngineShape) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(
        active_requests=num_active, is_paused=False, last_receive_timestamp=last_receive_s,
        uptime_seconds=uptime_s, server_type="deltaserve-grpc", data_parallel_size=1,
        kv_cache_dtype=shape.kv_cache_dtype, block_size=shape.block_size,
        attention_backend="" if shape.attention_backend == "auto" else shape.attention_backend,
        model_dtype=shape.dtype, max_num_seqs=shape.max_num_seqs)


def scheduler_load_to_proto(stats, gen_tokens_per_s: float,
                            shape: EngineShape) -> pb.SchedulerLoad:
    """`stats`: the engine's EngineStats snapshot. Token counts are whole KV blocks."""
    return pb.SchedulerLoad(
        dp_rank=0, num_running_reqs=stats.num_running, num_waiting_reqs=stats.num_waiting,
        num_total_reqs=stats.num_running + stats.num_waiting,
        num_used_tokens=stats.num_used_blocks * shape.block_size,
        max_total_num_tokens=stats.num_total_blocks * shape.block_size,
        token_usage=stats.kv_cache_usage, gen_throughput=gen_tokens_per_s,
        cache_hit_rate=stats.prefix_cache_hit_rate,
        utilization=stats.num_running / shape.max_num_seqs,
        max_running_requests=shape.max_num_seqs)


# -- KV events --------------------------------------------------------------------------------

def block_hash_to_int64(block_hash: bytes) -> int:
    """The protocol's int64 block hash: the first 8 bytes of ours, little-endian, signed."""
    return int.from_bytes(block_hash[:8], "little", signed=True)


def kv_batch_to_proto(batch: KvEventBatch, announced: set[int] | None = None
                      ) -> cpb.KvEventBatch:
    """Events get consecutive ids from batch.first_event_id.

    `announced`: one stream's groups whose kind it has sent (SubscribeKvEvents keeps one set
    per stream). A removal names only its group_idx, and SMG takes a group it has not yet seen
    a kind for as full attention: a window-group removal first on a stream (blocks stored
    before the subscriber came) would drop the full group's block of the same hash from its
    index. So before such a removal the stream gets the group's kind as a KvBlocksStored with
    no blocks (it shares the removal's event id)."""
    events = []
    for i, event in enumerate(batch.events):
        event_id = batch.first_event_id + i
        group = getattr(event, "group", None)
        if announced is not None and group is not None and group.index not in announced:
            announced.add(group.index)
            if isinstance(event, BlockRemoved) and group.kind != FULL_GROUP.kind:
                events.append(cpb.KvCacheEvent(event_id=event_id,
                                               stored=_group_fields(cpb.KvBlocksStored(), group)))
        events.append(_kv_event_to_proto(event, event_id))
    return cpb.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp,
                            events=events)


def _kv_event_to_proto(event, event_id: int) -> cpb.KvCacheEvent:
    if isinstance(event, BlockStored):
        return cpb.KvCacheEvent(event_id=event_id, stored=_stored_to_proto(event))
    if isinstance(event, BlockRemoved):
        removed = cpb.KvBlocksRemoved(
            block_hashes=[block_hash_to_int64(h) for h in event.block_hashes])
        if event.group is not None:
            removed.group_idx = event.group.index
        return cpb.KvCacheEvent(event_id=event_id, removed=removed)
    if isinstance(event, AllBlocksCleared):
        return cpb.KvCacheEvent(event_id=event_id, cleared=cpb.KvCacheCleared())
    raise TypeError(f"not a KV event: {event!r}")


def _stored_to_proto(event: BlockStored) -> cpb.KvBlocksStored:
    """vLLM's BlockStored: the namespace as `lora_name` / `cache_salt` on the event,
    `lora_id` on each block, and each block's `extra_keys` as vLLM lists them (the adapter's
    name on every block, the salt on a prompt's first block only)."""
    bs, ns = event.block_size, event.namespace
    blocks = []
    for i, h in enumerate(event.block_hashes):
        keys = [ns.lora_name] if ns.lora_name else []
        if ns.cache_salt and i == 0 and event.parent_block_hash is None:
            keys.append(ns.cache_salt)
        blocks.append(cpb.KvBlock(block_hash=block_hash_to_int64(h), lora_id=ns.lora_id,
                                  token_ids=event.token_ids[i * bs:(i + 1) * bs], block_size=bs,
                                  extra_keys=[cpb.KvBlockExtraKey(text=k) for k in keys]))
    stored = cpb.KvBlocksStored(blocks=blocks, lora_name=ns.lora_name, cache_salt=ns.cache_salt)
    if event.parent_block_hash is not None:
        stored.parent_block_hash = block_hash_to_int64(event.parent_block_hash)
    if event.group is not None:          # a hybrid model's: vLLM's group_idx and spec kind
        _group_fields(stored, event.group)
    return stored


def _group_fields(stored: cpb.KvBlocksStored, group: KvGroupTag) -> cpb.KvBlocksStored:
    stored.group_idx, stored.kv_cache_spec_kind = group.index, group.kind
    if group.sliding_window is not None:
        stored.kv_cache_spec_sliding_window = group.sliding_window
    return stored
