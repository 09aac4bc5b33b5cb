"""Offline logprobs as vLLM's SamplingParams.logprobs: None (LLM.generate's default) computes
and returns none, 0 each token's own logprob, k that and k alternatives. A batch mixing them
gives each request what it asked, with the same tokens, through the final-only output
processor (held updates) and the per-step one. A 9000-id vocabulary takes the tiled LM head
(kernels/cpu/linear.py TILED_FROM_N), whose argmax-only mode runs when no row wants a logprob;
the seeded random request takes the sampler's torch path."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.engine.output_processor import OutputProcessor

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
SAMPLINGS = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8, seed=3),
             SamplingParams()]
STOP = StoppingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    llm = LLM(tiny_models("llama", vocab_size=9000), num_kv_blocks=64, max_num_seqs=8)
    assert llm.runner.model.lm_head.cpu_linear.fuses_greedy     # the tiled, fused head
    return llm


@pytest.fixture(scope="module")
def reference(llm):
    """Each prompt's tokens and logprobs (with 2 alternatives), the batch asking for them."""
    assert llm.reset_prefix_cache()
    return llm.generate(PROMPTS, SAMPLINGS, STOP, num_logprobs=2)


def test_default_returns_no_logprobs_and_the_same_tokens_as_zero(llm, reference):
    assert llm.reset_prefix_cache()
    bare = llm.generate(PROMPTS, SAMPLINGS, STOP)
    assert llm.reset_prefix_cache()
    own = llm.generate(PROMPTS, SAMPLINGS, STOP, num_logprobs=0)
    assert [c.token_ids for c in bare] == [c.token_ids for c in own] == [
        c.token_ids for c in reference]
    assert all(c.logprobs == [] and len(c.token_ids) == 8 for c in bare)
    for c, ref in zip(own, reference):
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert all(lp.top_token_ids == () for lp in c.logprobs)
        assert [lp.logprob for lp in c.logprobs] == pytest.approx(
            [lp.logprob for lp in ref.logprobs], abs=1e-5)


@pytest.mark.parametrize("final_only", [True, False])
def test_a_mixed_batch_gives_each_request_what_it_asked(llm, reference, final_only):
    engine = llm.engine
    before = engine.output_processor
    if not final_only:
        engine.output_processor = OutputProcessor(llm.tokenizer)     # per-step outputs
    asked = [None, 0, 2, None]
    try:
        assert llm.reset_prefix_cache()
        for i, (prompt, sp, k) in enumerate(zip(PROMPTS, SAMPLINGS, asked)):
            engine.add_request(Request(f"mix-{final_only}-{i}", prompt, sp, STOP,
                                       llm.model_info.eos_token_ids, num_logprobs=k))
        outs: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
    finally:
        engine.output_processor = before
    for i, (k, ref) in enumerate(zip(asked, reference)):
        got = outs[f"mix-{final_only}-{i}"]
        assert [t for o in got for t in o.new_token_ids] == ref.token_ids, i
        logprobs = [lp for o in got for lp in o.logprobs]
        if k is None:
            assert logprobs == [], i
            continue
        assert [lp.token_id for lp in logprobs] == ref.token_ids, i
        assert [lp.logprob for lp in logprobs] == pytest.approx(
            [lp.logprob for lp in ref.logprobs], abs=1e-5)
        assert all(len(lp.top_token_ids) == k for lp in logprobs), i
