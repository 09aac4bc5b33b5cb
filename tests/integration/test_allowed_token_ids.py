"""allowed_token_ids (vLLM's SamplingParams field) through the in-process engine: greedy over the
allowed ids is transformers' greedy generate() restricted to them (prefix_allowed_tokens_fn),
sampled rows draw only allowed ids, a row without the knob in the same batch is untouched, and
logprobs stay those of the raw model distribution."""
from __future__ import annotations

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import hf_greedy, hf_greedy_allowed

PROMPT = [5, 17, 99, 42, 7, 300, 12, 8, 77]
STEPS = 8


def test_greedy_over_allowed_ids_is_transformers_restricted_greedy(tiny_models):
    model = tiny_models("qwen3")
    llm = LLM(model, dtype="float32", num_kv_blocks=128)
    free = hf_greedy(model, tuple(PROMPT), STEPS).token_ids
    # Ids the unrestricted model never picks here, so the restriction must change the answer.
    allowed = tuple(t for t in (3, 40, 41, 77, 128, 200, 301, 450) if t not in free)
    st = StoppingParams(max_tokens=STEPS, ignore_eos=True)
    restricted, sampled, plain = llm.generate(
        [PROMPT] * 3, [SamplingParams(allowed_token_ids=allowed),
                       SamplingParams(temperature=1.0, seed=7, allowed_token_ids=allowed),
                       SamplingParams()], [st] * 3, num_logprobs=2)
    assert tuple(restricted.token_ids) == hf_greedy_allowed(model, tuple(PROMPT), STEPS, allowed)
    assert set(sampled.token_ids) <= set(allowed)
    assert tuple(plain.token_ids) == free           # the same batch, no restriction
    # Logprobs are the raw distribution's: the best alternative is not restricted.
    assert restricted.logprobs[0].top_token_ids[0] == free[0]
    assert_no_leaked_blocks(llm)
