"""A new request's LoRA adapter id on the wire (docs/protocols/step_diff.md): a 10th element only
when set, prompt_logprobs and pooling (-1 each) sent before it; a bad id is refused naming the
field."""
from __future__ import annotations

import msgpack
import pytest

from engine_common.request.params import SamplingParams, WorkerSamplingParams
from engine_common.wire.codec import decode_scheduler_output, encode_scheduler_output
from engine_common.wire.codec_error import CodecError
from engine_common.wire.diff import NewRequestData, SchedulerOutput


def _new(**kw) -> NewRequestData:
    return NewRequestData(4, [5, 6, 7], WorkerSamplingParams(SamplingParams(), 9, 0, ()), [1],
                          0, **kw)


@pytest.mark.parametrize("kw", [{}, {"lora_id": 2}, {"lora_id": 1, "prompt_logprobs": 3},
                                {"prompt_logprobs": 0}, {"lora_id": 3, "pooling": 5},
                                {"pooling": 0}])
def test_round_trip(kw):
    out = SchedulerOutput(step=1, new_requests=[_new(**kw)])
    wire = encode_scheduler_output(out)
    back = decode_scheduler_output(wire)
    assert back.new_requests == out.new_requests
    fields = msgpack.unpackb(wire)[1][0]
    later = [k in kw for k in ("prompt_logprobs", "pooling", "lora_id")]
    assert len(fields) == 7 + (max(i + 1 for i, given in enumerate(later) if given)
                               if any(later) else 0)


def test_bad_lora_id_is_refused():
    fields = msgpack.unpackb(encode_scheduler_output(
        SchedulerOutput(step=1, new_requests=[_new(lora_id=1)])))
    fields[1][0][9] = 0
    with pytest.raises(CodecError, match="lora_id=0: expected an integer >= 1"):
        decode_scheduler_output(msgpack.packb(fields))
