"""msgpack codec for the step payloads. No pickle: every field is a plain msgpack value, but for
the sampling knobs, which travel as the public API's SamplingParams protobuf message.

Layouts (positional arrays keep steady-state messages tiny):

    SchedulerOutput = [step, [new...], [resumed...], new blocks, {handle: n},
                       [finished handles], [preempted handles]
                       (, {handle: [draft ids]}: only when a request has speculative drafts)
                       (, {handle: [num tokens, last id]}: drafts assumed over a step in flight)]
    new        = [handle, prompt ids (uint32 bytes: decoded as a read-only numpy array),
                  sampling, block ids,
                  num_computed_tokens, num_logprobs (-1: none), constraint
                  (, prompt_logprobs: when asked, 0 or more, or a pooling request or lora id
                   follows: -1) (, pooling: a pooling request's code,
                   engine_common/request/pooling.py, or -1 before a lora id) (, lora id: a LoRA
                   adapter's, 1 or more; absent for the base model)]
    sampling   = [SamplingParams message, seed, min_tokens, stop ids]: the message is the public
                 API's own (proto/dswire/v1/generation.proto), serialized, holding the knobs off
                 their neutral value (none: 0 bytes); decoded by the knobs' names and validated
                 by their declarations, so a bad value is refused naming the knob
                 (engine_common/wire/sampling_wire.py)
    constraint = nil, or [kind, value] (engine_common/constraints/constraint.py): sent once, here only
    resumed    = [handle, block ids, num_computed_tokens]
    new blocks = nil when no request grows, else bytes: sorted handle gaps and block counts,
                 then the block ids as runs of consecutive ids (engine_common/wire/new_blocks.py)

    RunnerOutput = [step, handles (uint32 bytes), sampled ids (uint32 bytes),
                    logprobs (float32 bytes), {handle: [ids bytes, logprobs bytes]: k
                    alternatives per token the handle produced, token after token}
                    (, compiled handles (uint32 bytes): only when there are any or errors
                     follow) (, {handle: error message}: only when a request failed or
                     prompt logprobs follow) (, {handle: [logprobs f32, ranks u32, top ids u32,
                     top logprobs f32]}: only when a request's prompt logprobs are done or
                     pooled vectors follow) (, {handle: pooled f32}: pooling requests done)]

A steady decode step of any batch size is [step, [], [], nil, {}, [], []]: 7 bytes plus the step
(1 byte below 128, 3 below 65536, 5 above); a step where requests grow a block adds about 1 byte
per growing request plus a few bytes per run of consecutive block ids.
"""
from __future__ import annotations

from array import array
from collections import Counter

import msgpack
import numpy as np

from engine_common.constraints.constraint import Constraint
from engine_common.wire.diff import (NO_LOGPROBS, NewRequestData, PromptLogprobs,
                                     ResumedRequestData, RunnerOutput, SchedulerOutput)
from engine_common.wire.new_blocks import pack_new_blocks, unpack_new_blocks
from engine_common.wire.codec_error import CodecError
# given_knobs, sampling_to_wire and sampling_from_wire: importable from here, as before the split
from engine_common.wire.sampling_wire import (MAX_CACHED_SAMPLING_BYTES,  # noqa: F401
                                              cached_sampling_bytes, cached_sampling_params,
                                              given_knobs, sampling_from_wire, sampling_to_wire)
from engine_common.request.params import WorkerSamplingParams, clip, quoted
from engine_common.request.pooling import NO_POOLING, decode_code


def _why(e: Exception) -> str:
    """An error's own message; its type too when that says more (msgpack's are often empty)."""
    return clip(str(e) if isinstance(e, CodecError) else f"{type(e).__name__}: {e}", 1000)


def _u32(values) -> bytes:
    """A list, or a numpy integer array straight from its buffer (no Python int per value:
    the runner's sampled ids and logprobs come as arrays)."""
    if hasattr(values, "dtype"):
        return values.astype("=u4", copy=False).tobytes()
    return array("I", values).tobytes()


def _from_u32(data: bytes) -> list[int]:
    return array("I", _packed(data, "uint32 array")).tolist()


def _u32_array(data: bytes, what: str) -> np.ndarray:
    """A read-only uint32 view of the bytes: a prompt's ids, for a worker that checks them with
    one max() and copies them into its token buffer by slice (no Python int per id)."""
    return np.frombuffer(_packed(data, what), dtype=np.uint32)


def _f32(values) -> bytes:
    if hasattr(values, "dtype"):
        return values.astype("=f4", copy=False).tobytes()
    return array("f", values).tobytes()


def _from_f32(data: bytes) -> list[float]:
    return array("f", _packed(data, "float32 array")).tolist()


# ---- layout checks on decoded msgpack values (a wrong type is a CodecError, never a crash
# later in the scheduler or the model runner) ----

def _packed(data, what: str) -> bytes:
    if not isinstance(data, bytes) or len(data) % 4:
        raise CodecError(f"{what}: expected bytes of a multiple of 4 in length")
    return data


def _int(value, what: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise CodecError(f"{what}={quoted(value)}: expected an integer >= {lo}")
    return value


def _seq(value, what: str, length: int | None = None) -> list:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise CodecError(f"{what}: expected a list" + ("" if length is None else f" of {length}"))
    return value


def _ints(value, what: str) -> list[int]:
    # The usual list (a new request's block ids: dozens) in C: all exact ints, none negative;
    # anything else is looked at one by one, for the message naming it.
    if not _seq(value, what) or ({*map(type, value)} == {int} and min(value) >= 0):
        return value
    for v in value:
        _int(v, what)
    return value


def _int_map(value, what: str, check) -> dict:
    if not isinstance(value, dict):
        raise CodecError(f"{what}: expected a map")
    return {_int(k, what + " key"): check(v, what) for k, v in value.items()}


def _sampling(value) -> WorkerSamplingParams:
    sampling, seed, min_tokens, stop_ids = _seq(value, "sampling", 4)
    if not isinstance(sampling, bytes):
        raise CodecError("sampling params: expected bytes (a SamplingParams message)")
    return WorkerSamplingParams(cached_sampling_params(sampling), _int(seed, "seed"),
                                _int(min_tokens, "min_tokens"),
                                tuple(_ints(stop_ids, "stop_ids")))


def _constraint(value) -> Constraint | None:
    if value is None:
        return None
    kind, data = _seq(value, "constraint", 2)
    return Constraint.from_wire([kind, data])


def _new_request(value) -> NewRequestData:
    return _usual_new_request(value) or _checked_new_request(value)


def _nonneg_ints(values) -> bool:
    """_ints' test, without its error."""
    return not values or ({*map(type, values)} == {int} and min(values) >= 0)


def _usual_new_request(value) -> NewRequestData | None:
    """_checked_new_request of a well-formed request without a constraint, its checks inline
    (a prefill diff brings dozens of new requests: no helper call per field); None when
    anything differs, and _checked_new_request then names what is wrong."""
    if type(value) is not list or len(value) != 7:
        return None
    h, prompt, sampling, blocks, num_computed, num_logprobs, constraint = value
    if not (type(h) is int and h >= 0 and type(prompt) is bytes and not len(prompt) % 4
            and type(sampling) is list and len(sampling) == 4 and type(blocks) is list
            and type(num_computed) is int and num_computed >= 0
            and type(num_logprobs) is int and num_logprobs >= NO_LOGPROBS
            and constraint is None):
        return None
    message, seed, min_tokens, stop_ids = sampling
    if not (type(message) is bytes and type(seed) is int and seed >= 0
            and type(min_tokens) is int and min_tokens >= 0 and type(stop_ids) is list
            and _nonneg_ints(stop_ids) and _nonneg_ints(blocks)):
        return None
    return NewRequestData(h, np.frombuffer(prompt, dtype=np.uint32), WorkerSamplingParams(
        cached_sampling_params(message), seed, min_tokens, tuple(stop_ids)), blocks, num_computed,
        num_logprobs, None)


def _checked_new_request(value) -> NewRequestData:
    prompt_logprobs, pooling, lora_id = NO_LOGPROBS, NO_POOLING, 0
    if isinstance(value, list) and len(value) == 10:     # a LoRA adapter
        *value, lora_id = value
        _int(lora_id, "lora_id", lo=1)
    if isinstance(value, list) and len(value) == 9:      # a pooling request (or -1)
        *value, pooling = value
        if _int(pooling, "pooling", lo=NO_POOLING) != NO_POOLING:
            decode_code(pooling)
    if isinstance(value, list) and len(value) == 8:      # prompt logprobs asked
        *value, prompt_logprobs = value
        _int(prompt_logprobs, "prompt_logprobs", lo=NO_LOGPROBS)
    h, prompt, sampling, blocks, num_computed, num_logprobs, constraint = _seq(
        value, "new request", 7)
    return NewRequestData(_int(h, "handle"), _u32_array(prompt, "prompt_token_ids"),
                          _sampling(sampling),
                          _ints(blocks, "block_ids"), _int(num_computed, "num_computed_tokens"),
                          _int(num_logprobs, "num_logprobs", lo=NO_LOGPROBS),
                          _constraint(constraint), prompt_logprobs, pooling, lora_id)


def _resumed_request(value) -> ResumedRequestData:
    h, blocks, num_computed = _seq(value, "resumed request", 3)
    return ResumedRequestData(_int(h, "handle"), _ints(blocks, "block_ids"),
                              _int(num_computed, "num_computed_tokens"))


def _new_blocks(value) -> dict[int, list[int]]:
    if value is None:
        return {}
    if not isinstance(value, bytes):
        raise CodecError("new_block_ids: expected nil or bytes")
    return unpack_new_blocks(value)


def _prompt_entry(value, what: str) -> PromptLogprobs:
    lps, ranks, top_ids, top_lps = _seq(value, what, 4)
    out = PromptLogprobs(_from_f32(lps), _from_u32(ranks), _from_u32(top_ids),
                         _from_f32(top_lps))
    n = len(out.logprobs)
    if len(out.ranks) != n or len(out.top_ids) != len(out.top_logprobs) \
            or (len(out.top_ids) % n if n else out.top_ids):
        raise CodecError(f"{what}: {n} positions, {len(out.ranks)} ranks, "
                         f"{len(out.top_ids)} top ids, {len(out.top_logprobs)} top logprobs")
    return out


def _pooled_entry(value, what: str) -> list[float]:
    if not isinstance(value, bytes) or not value:
        raise CodecError(f"{what}: expected a non-empty float32 vector")
    return _from_f32(value)


def _check_top_runs(out: RunnerOutput) -> None:
    """A handle's top alternatives hold k per token it produced (n tokens: n * k, token
    after token; speculative drafts give n > 1)."""
    runs = Counter(out.handles)
    for handle, (ids, _) in out.top_logprobs.items():
        n = runs.get(handle, 0)
        if not n or len(ids) % n:
            raise CodecError(f"top_logprobs[{handle}]: {len(ids)} alternatives is invalid: "
                             f"must be a multiple of the handle's {n} sampled tokens (> 0)")


def _top_entry(value, what: str) -> tuple[list[int], list[float]]:
    ids, lps = _seq(value, what, 2)
    ids, lps = _from_u32(ids), _from_f32(lps)
    if len(ids) != len(lps):
        raise CodecError(f"{what}: {len(ids)} ids but {len(lps)} logprobs")
    return ids, lps


def _worker_sampling(params: WorkerSamplingParams) -> list:
    return [cached_sampling_bytes(params.sampling), params.seed, params.min_tokens,
            list(params.stop_ids)]


def _new_to_wire(r: NewRequestData) -> list:
    fields = [r.handle, _u32(r.prompt_token_ids) if r.prompt_u32 is None else r.prompt_u32,
              _worker_sampling(r.sampling), r.block_ids, r.num_computed_tokens, r.num_logprobs,
              None if r.constraint is None else r.constraint.to_wire()]
    if r.prompt_logprobs != NO_LOGPROBS or r.pooling != NO_POOLING or r.lora_id:
        fields.append(r.prompt_logprobs)
    if r.pooling != NO_POOLING or r.lora_id:
        fields.append(r.pooling)
    if r.lora_id:
        fields.append(r.lora_id)
    return fields


def encode_scheduler_output(out: SchedulerOutput) -> bytes:
    new = [_new_to_wire(r) for r in out.new_requests]
    resumed = [[r.handle, r.block_ids, r.num_computed_tokens] for r in out.resumed_requests]
    grown = pack_new_blocks(out.new_block_ids) if out.new_block_ids else None
    fields = [out.step, new, resumed, grown, out.num_scheduled_tokens, out.finished_handles,
              out.preempted_handles]
    if out.spec_token_ids or out.new_window_block_ids:
        fields.append(out.spec_token_ids)
        if out.spec_assumed or out.new_window_block_ids:
            fields.append(out.spec_assumed)
    if out.new_window_block_ids:          # a hybrid model's: absent for any other
        fields.append(pack_new_blocks(out.new_window_block_ids))
    return msgpack.packb(fields, use_bin_type=True)


def decode_scheduler_output(data: bytes) -> SchedulerOutput:
    try:
        fields, drafts = msgpack.unpackb(data, raw=False, strict_map_key=False), {}
        assumed, window_blocks = {}, None
        if isinstance(fields, list) and len(fields) == 10:
            *fields, window_blocks = fields
        if isinstance(fields, list) and len(fields) == 9:
            *fields, assumed = fields
        if isinstance(fields, list) and len(fields) == 8:
            *fields, drafts = fields
        step, new, resumed, new_blocks, num_sched, finished, preempted = _seq(
            fields, "SchedulerOutput", 7)
        return SchedulerOutput(
            step=_int(step, "step"),
            new_requests=[_new_request(r) for r in _seq(new, "new_requests")],
            resumed_requests=[_resumed_request(r) for r in _seq(resumed, "resumed_requests")],
            new_block_ids=_new_blocks(new_blocks),
            num_scheduled_tokens=_int_map(num_sched, "num_scheduled_tokens", _int),
            finished_handles=_ints(finished, "finished_handles"),
            preempted_handles=_ints(preempted, "preempted_handles"),
            spec_token_ids=_int_map(drafts, "spec_token_ids", _ints) if drafts else {},
            spec_assumed=_int_map(assumed, "spec_assumed", _ints) if assumed else {},
            new_window_block_ids=_new_blocks(window_blocks),
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        raise CodecError(f"malformed SchedulerOutput payload: {_why(e)}") from e


def encode_runner_output(out: RunnerOutput) -> bytes:
    top = {h: [_u32(ids), _f32(lps)] for h, (ids, lps) in out.top_logprobs.items()}
    fields = [out.step, _u32(out.handles), _u32(out.sampled_token_ids), _f32(out.logprobs), top]
    if out.compiled_handles or out.request_errors or out.prompt_logprobs or out.pooled:
        fields.append(_u32(out.compiled_handles))
    if out.request_errors or out.prompt_logprobs or out.pooled:
        fields.append({int(h): str(m)[:MAX_REQUEST_ERROR_CHARS]
                       for h, m in out.request_errors.items()})
    if out.prompt_logprobs or out.pooled:
        fields.append({int(h): [_f32(p.logprobs), _u32(p.ranks), _u32(p.top_ids),
                                _f32(p.top_logprobs)] for h, p in out.prompt_logprobs.items()})
    if out.pooled:
        fields.append({int(h): _f32(v) for h, v in out.pooled.items()})
    return msgpack.packb(fields, use_bin_type=True)


# A request error's message on the wire is clipped to this many characters (llguidance's can
# carry its parser state).
MAX_REQUEST_ERROR_CHARS = 1000


def _message(value, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_REQUEST_ERROR_CHARS:
        raise CodecError(f"{what}: expected a message of at most {MAX_REQUEST_ERROR_CHARS} "
                         "characters")
    return value


def decode_runner_output(data: bytes) -> RunnerOutput:
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
        compiled, errors, prompt, pooled = b"", {}, {}, {}
        if isinstance(fields, list) and len(fields) == 9:
            *fields, pooled = fields
        if isinstance(fields, list) and len(fields) == 8:
            *fields, prompt = fields
        if isinstance(fields, list) and len(fields) == 7:
            *fields, errors = fields
        if isinstance(fields, list) and len(fields) == 6:
            *fields, compiled = fields
        step, handles, ids, lps, top = _seq(fields, "RunnerOutput", 5)
        out = RunnerOutput(_int(step, "step"), _from_u32(handles), _from_u32(ids),
                           _from_f32(lps), _int_map(top, "top_logprobs", _top_entry),
                           _from_u32(compiled), _int_map(errors, "request_errors", _message),
                           _int_map(prompt, "prompt_logprobs", _prompt_entry),
                           _int_map(pooled, "pooled", _pooled_entry))
        if len(out.sampled_token_ids) != len(out.handles):
            raise CodecError("sampled ids must match handles one to one")
        if out.logprobs and len(out.logprobs) != len(out.handles):
            raise CodecError("logprobs must match handles one to one")
        if out.top_logprobs:
            _check_top_runs(out)
        return out
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        raise CodecError(f"malformed RunnerOutput payload: {_why(e)}") from e
