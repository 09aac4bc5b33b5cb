"""The sampling knobs on the step diff are the public API's SamplingParams message: every knob
round-trips by its field of the same name, a neutral knob costs no byte, and bad bytes are
refused naming what is wrong."""
from __future__ import annotations

import pytest

from engine_common.request.params import KNOBS, ParamError, SamplingParams, WorkerSamplingParams
from engine_common.wire.codec import (CodecError, decode_scheduler_output,
                                      encode_scheduler_output, sampling_from_wire,
                                      sampling_to_wire)
from engine_common.wire.diff import NewRequestData, SchedulerOutput
from engine_common.wire.protos import generation_pb2 as pb


def test_neutral_sampling_is_empty_and_each_knob_round_trips_under_its_name():
    assert sampling_to_wire(SamplingParams()) == b""
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05,
                            repetition_penalty=1.1, presence_penalty=-0.5,
                            frequency_penalty=0.25, seed=2**63 - 1,
                            logit_bias={9: -100, 4: 2.5}, allowed_token_ids=[9, 4, 7])
    data = sampling_to_wire(params)
    msg = pb.SamplingParams.FromString(data)
    assert {f.name for f, _ in msg.ListFields()} == {k.name for k in KNOBS} | {"logit_bias"}
    assert sampling_from_wire(data) == params
    assert sampling_from_wire(sampling_to_wire(SamplingParams(top_k=5))) == SamplingParams(
        top_k=5)


def test_bad_sampling_bytes_are_refused_naming_the_knob_or_the_field():
    with pytest.raises(ParamError, match=r"temperature=-1\.0 is invalid: must be in \[0\.0"):
        sampling_from_wire(pb.SamplingParams(temperature=-1.0).SerializeToString())
    with pytest.raises(ParamError, match=r"top_k=-5 is invalid"):
        sampling_from_wire(pb.SamplingParams(top_k=-5).SerializeToString())
    with pytest.raises(CodecError, match="unknown field number 111"):
        sampling_from_wire(b"\xf8\x06\x01")
    with pytest.raises(CodecError, match="not a SamplingParams message"):
        sampling_from_wire(b"\xff\xff")


def test_a_new_request_carries_its_sampling_through_the_codec():
    wsp = WorkerSamplingParams(SamplingParams(temperature=0.5, allowed_token_ids=[3]), seed=7,
                               min_tokens=2, stop_ids=(0, 9))
    diff = SchedulerOutput(3, new_requests=[NewRequestData(1, [5, 6], wsp, [0], 0)])
    assert decode_scheduler_output(encode_scheduler_output(diff)).new_requests[0].sampling == wsp
    bad = SchedulerOutput(3, new_requests=[NewRequestData(1, [5, 6], WorkerSamplingParams(
        SamplingParams(), seed=0), [0], 0)])
    payload = encode_scheduler_output(bad).replace(
        b"\xc4\x00", pb.SamplingParams(min_p=2.0).SerializeToString().join([b"\xc4\x09", b""]))
    with pytest.raises(CodecError, match=r"min_p=2\.0 is invalid"):
        decode_scheduler_output(payload)


def test_shared_params_encode_like_their_own_copies_and_the_identity_cache_is_bounded():
    """New requests sharing one SamplingParams object encode to the bytes equal but distinct
    objects give; the encoder's identity cache keeps at most MAX_WIRE_BY_ID objects."""
    from engine_common.wire import sampling_wire

    shared = SamplingParams(temperature=0.5, top_k=3, logit_bias={2: 1.0})

    def diff(params_of):
        return SchedulerOutput(0, new_requests=[
            NewRequestData(h, [1, 2], WorkerSamplingParams(params_of(h), seed=h), [h], 0)
            for h in range(4)])
    payload = encode_scheduler_output(diff(lambda h: shared))
    assert sampling_wire._WIRE_BY_ID.get(shared) == sampling_to_wire(shared)
    assert payload == encode_scheduler_output(diff(
        lambda h: SamplingParams(temperature=0.5, top_k=3, logit_bias={2: 1.0})))
    decoded = decode_scheduler_output(payload).new_requests
    assert [r.sampling.sampling for r in decoded] == [shared] * 4
    for t in range(sampling_wire.MAX_WIRE_BY_ID + 5):
        sampling_wire.cached_sampling_bytes(SamplingParams(temperature=0.01 * (t + 1)))
    assert len(sampling_wire._WIRE_BY_ID) <= sampling_wire.MAX_WIRE_BY_ID
    large = SamplingParams(logit_bias={j: 1.0 for j in range(100)})
    assert sampling_wire.cached_sampling_bytes(large) == sampling_to_wire(large)
    assert large not in sampling_wire._WIRE_BY_ID, "large params are not pinned"
