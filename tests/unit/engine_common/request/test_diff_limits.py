"""max_diff_bytes bounds every legal step diff, the constraints new requests carry included."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_common.wire.codec import encode_scheduler_output
from engine_common.constraints.constraint import Constraint
from engine_common.wire.diff import SchedulerOutput
from engine_common.request.diff_limits import (MAX_CONSTRAINT_CHARS, MAX_CONSTRAINT_CHOICES,
                                             max_cached_requests, max_diff_bytes)
from tests.support.garbage_diffs import new
from worker_service.batch.diff_check import BadDiff, DiffBounds, check_diff

SEQS, TOKENS, MODEL_LEN, BLOCK = 4, 8, 64, 4
# The widest constraints on the wire: 4-byte characters, and as many choices (string headers)
# as MAX_CONSTRAINT_CHOICES allows, sharing MAX_CONSTRAINT_CHARS characters.
_SHORT = MAX_CONSTRAINT_CHARS // MAX_CONSTRAINT_CHOICES
WIDEST = (Constraint("choice", ("\U0001F600" * _SHORT,) * (MAX_CONSTRAINT_CHOICES - 1)
                     + ("\U0001F600" * (MAX_CONSTRAINT_CHARS
                                         - _SHORT * (MAX_CONSTRAINT_CHOICES - 1)),)),
          Constraint("regex", "\U0001F600" * MAX_CONSTRAINT_CHARS))
BOUNDS = DiffBounds(num_kv_blocks=SEQS * 16, vocab_size=2**31, max_model_len=MODEL_LEN,
                    max_num_seqs=SEQS, max_num_batched_tokens=TOKENS, block_size=BLOCK,
                    max_blocks_per_request=MODEL_LEN // BLOCK,
                    max_cached_requests=max_cached_requests(SEQS))


def _step(constraint: Constraint) -> SchedulerOutput:
    """max_num_seqs new requests, each with the longest prompt of the largest ids, all its
    blocks and `constraint`."""
    prompt = [2**31 - 1] * (MODEL_LEN - 1)
    requests = [dataclasses.replace(
        new(h, prompt=prompt, blocks=range(h * 16, h * 16 + 16)), constraint=constraint)
        for h in range(SEQS)]
    return SchedulerOutput(0, new_requests=requests,
                           num_scheduled_tokens={h: TOKENS // SEQS for h in range(SEQS)})


@pytest.mark.parametrize("constraint", WIDEST, ids=["choice", "regex"])
def test_a_step_of_max_num_seqs_maximal_constraints_fits_and_is_accepted(constraint):
    diff = _step(constraint)
    payload = encode_scheduler_output(diff)
    assert len(payload) > SEQS * 4 * MAX_CONSTRAINT_CHARS         # the constraints dominate
    assert len(payload) <= max_diff_bytes(SEQS, TOKENS, MODEL_LEN, BLOCK)
    check_diff(diff, BOUNDS, {}, {}, np.zeros(SEQS, dtype=np.int32))     # no BadDiff


def test_a_constraint_beyond_the_bound_is_refused():
    over = Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1))
    with pytest.raises(BadDiff, match=rf"constraint characters={MAX_CONSTRAINT_CHARS + 1} is "
                                      rf"invalid: must be <= {MAX_CONSTRAINT_CHARS}"):
        check_diff(_step(over), BOUNDS, {}, {}, np.zeros(SEQS, dtype=np.int32))
