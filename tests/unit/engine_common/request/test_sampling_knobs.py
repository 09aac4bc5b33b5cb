"""Each sampling knob declared once: what the table promises holds for every knob it lists,
so a new declaration is checked without a new test."""
from __future__ import annotations

import argparse

import msgpack
import pytest

from engine_common.request import diff_limits
from engine_common.request.params import COLUMN_KNOBS, KNOBS, ParamError, SamplingParams
from engine_common.wire.protos import generation_pb2, vllm_engine_pb2
from engine_common.wire.codec import sampling_to_wire
from deltaserve.client import FLAG_KNOBS, add_sampling_flags
from worker_service.batch.input_batch import InputBatch


@pytest.mark.parametrize("message", [generation_pb2.SamplingParams, vllm_engine_pb2.SamplingParams],
                         ids=["deltaserve.v1", "vllm"])
def test_every_knob_is_a_field_of_both_apis_sampling_message(message):
    missing = [k.name for k in KNOBS if k.name not in message.DESCRIPTOR.fields_by_name]
    assert missing == []


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.meta.lo is not None],
                         ids=lambda k: k.name)
def test_a_value_below_a_knobs_range_is_refused_naming_the_knob(knob):
    SamplingParams(**{knob.name: knob.neutral})       # the neutral value passes
    below = knob.meta.lo - 1 if knob.meta.integer else knob.meta.lo - 0.5
    with pytest.raises(ParamError) as err:
        SamplingParams(**{knob.name: below})
    assert err.value.field == knob.name and err.value.allowed.startswith("in ")


def test_the_widest_sampling_fits_the_diffs_sampling_bound():
    widest = {}
    for k in KNOBS:
        if k.meta.ids:
            widest[k.name] = range(2**31 - k.meta.max_ids, 2**31)
        elif k.meta.integer:
            widest[k.name] = int(k.meta.hi) if k.meta.hi is not None else 2**31 - 1
        else:
            widest[k.name] = k.meta.lo + 0.125 if k.meta.lo is not None else 0.125
    widest["logit_bias"] = {2**31 - 1 - i: -99.5 for i in range(diff_limits.MAX_LOGIT_BIAS)}
    size = len(msgpack.packb(sampling_to_wire(SamplingParams(**widest))))
    assert size <= diff_limits._SAMPLING + diff_limits._LOGIT_BIAS


def test_the_batch_has_a_neutral_column_per_knob_and_the_client_a_flag():
    batch = InputBatch(2, 8, 2)
    for k in COLUMN_KNOBS:
        column = getattr(batch, k.name)
        assert column.dtype.name == k.meta.column and (column == k.column_neutral).all()
    parser = argparse.ArgumentParser()
    add_sampling_flags(parser)
    flags = {a.dest for a in parser._actions} - {"help"}
    assert flags == {k.name for k in FLAG_KNOBS} >= {"temperature", "top_p", "top_k", "min_p",
                                                     "seed"}
