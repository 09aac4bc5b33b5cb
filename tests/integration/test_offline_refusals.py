"""LLM.generate handed, beside good prompts, what its model runner cannot take (a token id past
the vocabulary, too many logprobs, min_tokens past what an int32 holds, a constraint bigger
than the step diff's bound allows) or what admission refuses (a prompt too long): an error
naming it, nothing left queued or holding blocks, and the next call answers as if the bad one
never happened; a list of sampling params shorter than the prompts is refused (zip() dropped
the prompts it did not cover, silently).

Before, the runner refused the step diff (the scheduler then held requests the runner never
took), or the good prompts of a call refused half way stayed queued: either way every later
generate() of that LLM failed (the second with a KeyError on the leftovers' outputs)."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from scheduler_service.core.admission import RequestRejected
from tests.support.engine_checks import assert_no_leaked_blocks

GOOD = [[5, 6, 7, 8], [9, 10, 11]]
STOP = StoppingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("qwen3"), num_kv_blocks=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(llm):
    return [c.token_ids for c in llm.generate(GOOD, SamplingParams(), STOP)]


def _bad_calls(vocab: int, max_model_len: int) -> dict:
    """name -> (generate's arguments, the error, what its message must match)."""
    at = r"\[0\]=%d is invalid: must be a token id in \[0, %d\]" % (vocab, vocab - 1)
    return {
        "prompt id": (dict(prompts=GOOD + [[5, vocab]]), ParamError,
                      r"prompts\[2\]\[1\]=%d is invalid" % vocab),
        "stop id": (dict(prompts=GOOD, stopping=StoppingParams(stop_token_ids=[vocab])),
                    ParamError, r"stopping.stop_token_ids \(prompt 0\)" + at),
        "logit_bias id": (dict(prompts=GOOD, sampling=SamplingParams(logit_bias={vocab: 1.0})),
                          ParamError, r"sampling.logit_bias \(prompt 0\)" + at),
        "allowed id": (dict(prompts=GOOD, sampling=SamplingParams(allowed_token_ids=(vocab,))),
                       ParamError, r"sampling.allowed_token_ids \(prompt 0\)" + at),
        "logprobs": (dict(prompts=GOOD, num_logprobs=10**6), ParamError,
                     r"num_logprobs=1000000 is invalid: must be None or an integer in \[0, "),
        "short list": (dict(prompts=GOOD, sampling=[SamplingParams()]), ParamError,
                       r"sampling='a list of 1' is invalid: must be one for every prompt"),
        "too long": (dict(prompts=GOOD + [[5] * max_model_len]), RequestRejected,
                     "max_model_len"),
        "min_tokens": (dict(prompts=GOOD + [[5, 6]], stopping=[STOP, STOP, StoppingParams(
            max_tokens=None, min_tokens=2**31)]), RequestRejected, "min_tokens=2147483648"),
        # 4 of them in one step made a diff past the runner's bound (BadDiff: the LLM failed)
        "big constraint": (dict(prompts=GOOD * 2, constraint=Constraint(
            "choice", [f"{i:05d}" + "x" * 100 for i in range(10_000)])), ParamError,
            r"constraint \(prompt 0\).choice='1050000 characters' is invalid: must be at most "
            r"65536 characters \(its choices together\)"),
    }


@pytest.mark.parametrize("case", list(_bad_calls(1, 1)))
def test_a_refused_call_leaves_nothing_behind(llm, reference, case):
    kwargs, error, match = _bad_calls(llm.model_info.vocab_size,
                                      llm.model_info.max_model_len)[case]
    with pytest.raises(error, match=match):
        llm.generate(**kwargs)
    assert_no_leaked_blocks(llm)
    assert [c.token_ids for c in llm.generate(GOOD, SamplingParams(), STOP)] == reference


def test_a_refused_prompt_fails_the_call_before_anything_runs(tiny_models):
    """Past max_waiting the prompts before the refused one were queued and run first, and the
    error named an internal request id ('offline-4'), not the prompt."""
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=64, max_num_seqs=2, max_waiting=2)
    step, steps = llm.engine.step, []
    llm.engine.step = lambda: steps.append(1) or step()
    with pytest.raises(RequestRejected, match=r"request 'prompts\[4\]' rejected: "
                                              r"prompt_token_ids='\(empty\)'"):
        llm.generate(GOOD * 2 + [[]], SamplingParams(), STOP)
    assert steps == []
    assert_no_leaked_blocks(llm)
    assert len(llm.generate(GOOD * 2, SamplingParams(), STOP)) == 4 and steps
