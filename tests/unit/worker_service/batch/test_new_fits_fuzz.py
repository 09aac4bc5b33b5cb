"""worker_service/batch/diff_check.py: the unnamed pass over a new request (_new_fits) against
the named check (_check_new_named) on seeded random requests at the edges of every bound
(handle, prompt length and ids, blocks, num_computed_tokens, logprobs, prompt logprobs, seed,
min_tokens, stop ids, top_k, logit_bias and allowed ids, a handle already cached): _new_fits
never passes a request the named check refuses."""
from __future__ import annotations

import random

import numpy as np

from engine_common.request.params import ID_SET_KNOBS, SamplingParams, WorkerSamplingParams
from engine_common.wire.diff import NewRequestData
from worker_service.batch.diff_check import (BadDiff, DiffBounds, _check_new_named, _new_fits,
                                             _View)
from worker_service.failures import StepProtocolError

BOUNDS = DiffBounds(num_kv_blocks=10, vocab_size=100, max_model_len=32, max_num_seqs=2,
                    max_num_batched_tokens=16, block_size=4, max_blocks_per_request=8,
                    max_cached_requests=6)


def _params(rng: random.Random) -> list[SamplingParams]:
    out = []
    for _ in range(40):
        kw = {}
        if rng.random() < .5:
            kw["top_k"] = rng.choice([-1, 0, 1, 5, 2**31 - 1])
        if rng.random() < .4:
            kw["logit_bias"] = {rng.choice([0, 99, 100, 5000]): 1.0}
        if rng.random() < .4:
            kw[rng.choice(ID_SET_KNOBS).name] = [rng.choice([0, 99, 100])]
        out.append(SamplingParams(**kw))
    return out


def test_the_unnamed_pass_never_passes_what_the_named_check_refuses():
    rng = random.Random(39)
    params = _params(rng)

    def edge(lo: int, hi: int) -> int:
        if rng.random() < .8:                         # mostly in range: both sides run
            return rng.choice([lo, hi, rng.randint(lo, hi)])
        return rng.choice([lo - 1, lo + 1, hi - 1, hi + 1, 2**63])

    passed = refused = 0
    for _ in range(4000):
        prompt = np.array([rng.choice([0, 99, 100]) if rng.random() < .05 else 1
                           for _ in range(rng.choice([0, 1, 2, 2, 31, 31, 32]))], dtype=np.uint32)
        blocks = [rng.choice([0, 1, 9, 9, 9, 10]) for _ in range(rng.choice([0, 1, 2, 8, 8, 9]))]
        sampling = WorkerSamplingParams(rng.choice(params), edge(0, 2**63 - 1),
                                        edge(0, 2**31 - 1),
                                        tuple(rng.choice([0, 99, 100])
                                              for _ in range(rng.choice([0, 1, 2]))))
        request = NewRequestData(rng.choice([edge(0, 2**31 - 1), 7]), prompt, sampling, blocks,
                                 rng.choice([0, 0, 0, 1, 4, 9]), edge(-1, 100), None,
                                 rng.choice([-1, -1, -1, 0, 5, 101, -2]))
        view = _View({}, {}, np.zeros(2, dtype=np.int32),
                     added={7: 1} if rng.random() < .3 else {})
        fits = _new_fits(request, BOUNDS, view)
        try:
            _check_new_named("new", request, BOUNDS, view)
        except (BadDiff, StepProtocolError):
            refused += 1
            assert not fits, request
        else:
            passed += fits
    assert passed > 50 and refused > 1000            # both sides were exercised
