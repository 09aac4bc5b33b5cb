"""What vLLM's LLM takes and LLM now takes the same way: a max_tokens past max_model_len stops
there (finish_reason LENGTH) instead of failing the whole call, and `LLM(..., seed=N)` makes the
seeds drawn for unseeded requests, so a script that samples answers the same on every run.

Before: prompt + max_tokens past max_model_len refused the call (RequestRejected), and
LLM(seed=0), common in vLLM scripts, was a TypeError."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from scheduler_service.core.admission import RequestRejected
from scheduler_service.core.request import RequestStatus
from tests.support.engine_checks import assert_no_leaked_blocks

MAX_LEN = 64
LONG, SHORT = [5] * 60, [6, 7, 8]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("qwen3"), num_kv_blocks=32, max_num_seqs=4, max_model_len=MAX_LEN)


def test_max_tokens_past_max_model_len_stops_there(llm):
    stop = StoppingParams(max_tokens=10**6, ignore_eos=True)
    long, short = llm.generate([LONG, SHORT], None, [stop, StoppingParams(max_tokens=20,
                                                                          ignore_eos=True)])
    assert (len(long.token_ids), long.finish_reason) == (4, RequestStatus.FINISHED_LENGTH)
    assert len(short.token_ids) == 20
    exact = llm.generate([LONG], None, StoppingParams(max_tokens=4, ignore_eos=True))[0]
    assert long.token_ids == exact.token_ids
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("prompt, stop, match", [
    ([5] * MAX_LEN, StoppingParams(max_tokens=10), "max_model_len"),   # no room at all
    (LONG, StoppingParams(max_tokens=10, min_tokens=8), "max_model_len"),  # min_tokens
])
def test_what_cannot_fit_is_still_refused(llm, prompt, stop, match):
    with pytest.raises(RequestRejected, match=match):
        llm.generate([SHORT, prompt], None, stop)
    assert_no_leaked_blocks(llm)


def test_the_llm_seed_makes_unseeded_sampling_repeat_across_runs(tiny_models):
    def sampled(seed):
        llm = LLM(tiny_models("qwen3"), num_kv_blocks=32, max_num_seqs=4, seed=seed)
        outs = llm.generate([SHORT, SHORT, LONG], SamplingParams(temperature=1.0),
                            StoppingParams(max_tokens=8, ignore_eos=True))
        llm.close()
        return [c.token_ids for c in outs]

    first = sampled(5)
    assert first[0] != first[1]          # each request its own seed, as before
    assert sampled(5) == first
    assert sampled(6) != first


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "0"])
def test_a_bad_seed_is_refused_by_name(tiny_models, seed):
    with pytest.raises(ParamError, match=r"seed=.* is invalid: must be None or an integer"):
        LLM(tiny_models("qwen3"), num_kv_blocks=8, seed=seed)
