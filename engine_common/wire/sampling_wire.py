"""The sampling knobs on the step wire: a new request's SamplingParams travels as the public
API's own SamplingParams protobuf message (proto/dswire/v1/generation.proto), serialized, with
only the knobs off their neutral value set (a greedy request's is 0 bytes); decoded by the knobs'
names and validated by their declarations, so a bad value is refused naming the knob. Both ways
are cached, since a prefill step's hundreds of new requests share a few kinds of sampling.

The step layouts around it are engine_common/wire/codec.py's.
"""
from __future__ import annotations

from functools import lru_cache

from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from engine_common.runtime.identity_cache import IdentityCache
from engine_common.request.params import KNOBS, SamplingParams
from engine_common.wire.codec_error import CodecError
from engine_common.wire.protos import generation_pb2 as pb


# Every knob (engine_common/request/sampling_knobs.py) has a field of its name in the message;
# a knob at its neutral value is left unset, so a greedy request's sampling is 0 bytes.

def given_knobs(msg) -> dict[str, object]:
    """The sampling knobs (params.KNOBS) a SamplingParams message of either protocol sets, by
    name: a field of the knob's name with presence counts when set, a proto3 scalar without it
    when not 0, a repeated one when not empty."""
    given = {}
    for k in KNOBS:
        fd = msg.DESCRIPTOR.fields_by_name.get(k.name)
        if fd is None:
            continue
        value = getattr(msg, k.name)
        if fd.is_repeated:
            value = tuple(value)
        if msg.HasField(k.name) if fd.has_presence else value:
            given[k.name] = value
    return given


@lru_cache(maxsize=1024)      # requests mostly share their sampling: one message per kind
def sampling_to_wire(params: SamplingParams) -> bytes:
    """The knobs off their neutral value, and the logit bias, as SamplingParams bytes."""
    msg = pb.SamplingParams(logit_bias=dict(params.logit_bias))
    for k in KNOBS:
        value = getattr(params, k.name)
        if value != k.neutral:
            if k.meta.ids:
                getattr(msg, k.name).extend(value)
            else:
                setattr(msg, k.name, value)
    return msg.SerializeToString(deterministic=True)


def sampling_from_wire(data: bytes) -> SamplingParams:
    """The domain SamplingParams of sampling_to_wire's bytes; raises CodecError (not a message,
    unknown fields) or ParamError (a knob out of its range, by name)."""
    try:
        msg = pb.SamplingParams.FromString(data)
    except DecodeError as e:
        raise CodecError(f"sampling: not a SamplingParams message ({e})") from None
    unknown = unknown_fields.UnknownFieldSet(msg)
    if len(unknown):
        raise CodecError(f"sampling: unknown field number {unknown[0].field_number} (not a "
                         "SamplingParams field)")
    return SamplingParams(**given_knobs(msg), logit_bias=dict(msg.logit_bias))


# A prefill step brings hundreds of new requests, mostly of one or a few kinds of sampling: the
# message is parsed and validated once per kind (SamplingParams is frozen, so sharing one is
# safe; a refused message raises each time, lru_cache keeps no exceptions).
_cached_sampling_from_wire = lru_cache(maxsize=1024)(sampling_from_wire)
# Only messages this small are cached: every scalar knob fits in ~100 bytes, while one with 1024
# logit_bias entries and 1024 allowed ids is ~16 KB and parses to ~140 KB of Python objects, so
# a client sending 1024 distinct ones would pin ~160 MB in every rank process.
MAX_CACHED_SAMPLING_BYTES = 256


def cached_sampling_params(data: bytes) -> SamplingParams:
    """sampling_from_wire, parsed once per small message (above)."""
    if len(data) <= MAX_CACHED_SAMPLING_BYTES:
        return _cached_sampling_from_wire(data)
    return sampling_from_wire(data)


def cached_sampling_bytes(params: SamplingParams) -> bytes:
    """sampling_to_wire, found by the params object's identity first: a prefill step's new
    requests mostly share one object (the caller's), and sampling_to_wire's lru_cache hashes
    every field of the frozen dataclass per request."""
    data = _WIRE_BY_ID.get_by_id(id(params))
    if data is None:
        data = sampling_to_wire(params)
        if len(data) <= MAX_CACHED_SAMPLING_BYTES:     # no params with many ids pinned here
            _WIRE_BY_ID.put(params, data)
    return data


MAX_WIRE_BY_ID = 256
_WIRE_BY_ID = IdentityCache(MAX_WIRE_BY_ID)
