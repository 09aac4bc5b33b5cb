"""LLM.generate takes the prompt forms vLLM's LLM.generate takes, and refuses anything else by
name before a request is queued.

Before: generate("Hello") iterated the string and answered five one-character prompts; a flat
list of ids, a {"prompt_token_ids": ...} dict or a SamplingParams in the stopping slot died
inside (TypeError, AttributeError); num_logprobs=True reached the runner, failed the step, and
every later call of that LLM failed with "step N arrived after step M"."""
from __future__ import annotations

import numpy as np
import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from tests.support.engine_checks import assert_no_leaked_blocks

STOP = StoppingParams(max_tokens=3, ignore_eos=True)
IDS = [5, 6, 7]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("qwen3"), num_kv_blocks=32, max_num_seqs=4)


def _ids(outs) -> list[tuple[list[int], list[int]]]:
    return [(c.prompt_token_ids, c.token_ids) for c in outs]


def test_one_prompt_alone_is_a_batch_of_one(llm):
    text_ids = llm.tokenizer.encode("Hello")
    assert _ids(llm.generate("Hello", stopping=STOP)) == _ids(llm.generate(["Hello"], None, STOP))
    assert llm.generate("Hello", stopping=STOP)[0].prompt_token_ids == text_ids
    batch = _ids(llm.generate([IDS], None, STOP))
    for one in (IDS, {"prompt_token_ids": IDS}, [{"prompt_token_ids": IDS}], np.array(IDS),
                [np.array(IDS)], (5, 6, 7)):
        assert _ids(llm.generate(one, None, STOP)) == batch, one
    assert _ids(llm.generate({"prompt": "Hello"}, None, STOP)) == _ids(
        llm.generate("Hello", None, STOP))
    assert_no_leaked_blocks(llm)


BAD = {
    "an int": (dict(prompts=5), r"prompts=5 is invalid: must be a string, a list of token ids"),
    "None in a list": (dict(prompts=[IDS, None]), r"prompts\[1\]=None is invalid"),
    "a float id": (dict(prompts=[[5, 6.0]]), r"prompts\[0\]\[1\]=6.0 is invalid: must be a "
                                             r"token id"),
    "a bool id": (dict(prompts=[[True, 6]]), r"prompts\[0\]\[0\]=True is invalid"),
    "a negative id": (dict(prompts=[[5, -1]]), r"prompts\[0\]\[1\]=-1 is invalid: must be a "
                                               r"token id in \[0, 511\]"),
    "a dict key": (dict(prompts={"multi_modal_data": 1, "prompt": "x"}),
                   r"prompts\[0\]=.* is invalid: must be \{'prompt': str\} or"),
    "ids as text": (dict(prompts={"prompt": IDS}), r"prompts\[0\]\['prompt'\]=\[5, 6, 7\] is "
                                                   r"invalid: must be a string"),
    "params swapped": (dict(prompts=[IDS], sampling=STOP),
                       r"sampling=StoppingParams.* is invalid: must be a SamplingParams"),
    "params as a dict": (dict(prompts=[IDS], stopping={"max_tokens": 2}),
                         r"stopping=\{'max_tokens': 2\} is invalid: must be a StoppingParams"),
    "a list item": (dict(prompts=[IDS, IDS], sampling=[SamplingParams(), None]),
                    r"sampling\[1\]=None is invalid"),
    "constraint text": (dict(prompts=[IDS], constraint="[0-9]+"),
                        r"constraint='\[0-9\]\+' is invalid: must be a Constraint"),
    "logprobs True": (dict(prompts=[IDS], num_logprobs=True),
                      r"num_logprobs=True is invalid: must be None or an integer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_input_is_refused_by_name_and_the_llm_goes_on(llm, case):
    kwargs, match = BAD[case]
    with pytest.raises(ParamError, match=match):
        llm.generate(**kwargs)
    assert_no_leaked_blocks(llm)
    assert len(llm.generate([IDS], None, STOP)[0].token_ids) == 3


def test_per_prompt_lists_may_hold_none_constraints(llm):
    outs = llm.generate([IDS, IDS], None, [StoppingParams(max_tokens=3), STOP],
                        constraint=[Constraint("choice", ["ab"]), None])
    assert (outs[0].text, outs[0].finish_reason.name) == ("ab", "FINISHED_STOP_TOKEN")
    assert outs[1].token_ids == llm.generate([IDS], None, STOP)[0].token_ids


def test_params_per_prompt_may_come_as_a_tuple(llm):
    """A tuple of params was refused as no SamplingParams (vLLM takes any sequence)."""
    outs = llm.generate([IDS, IDS], (SamplingParams(), SamplingParams(temperature=1.0, seed=3)),
                        (STOP, StoppingParams(max_tokens=2, ignore_eos=True)))
    assert [len(c.token_ids) for c in outs] == [3, 2]
    assert outs[0].token_ids == llm.generate([IDS], None, STOP)[0].token_ids


def test_a_failed_step_says_so_on_every_later_call(tiny_models):
    """The scheduler counted the failed step and the runner did not: every later call failed
    with a step-number mismatch that named neither the cause nor the way out."""
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=8, max_num_seqs=2)
    executor = llm.engine.core.executor

    def broken(payload):
        raise RuntimeError("the device fell over")

    executor.execute = broken
    with pytest.raises(RuntimeError, match="the device fell over"):
        llm.generate([IDS], None, STOP)
    del executor.execute
    with pytest.raises(RuntimeError, match=r"failed a step earlier .*the device fell over.*"
                                           r"build a new LLM"):
        llm.generate([IDS], None, STOP)


def test_ctrl_c_before_the_runner_took_a_step_leaves_the_llm_usable(tiny_models):
    """The scheduler had counted the interrupted step and the runner had not: every later call
    failed with "step 3 arrived after step 1"."""
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=8, max_num_seqs=2)
    reference = llm.generate([IDS], None, STOP)[0].token_ids
    runner_execute, calls = llm.runner.execute, []

    def interrupted_once(payload):
        calls.append(payload)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return runner_execute(payload)

    llm.runner.execute = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        llm.generate([IDS], None, STOP)
    assert_no_leaked_blocks(llm)
    assert llm.generate([IDS], None, STOP)[0].token_ids == reference
    assert_no_leaked_blocks(llm)


def test_more_prompts_than_the_waiting_queue_holds_all_run(tiny_models):
    """Every prompt was queued at once: past max_waiting the call failed with QueueFull (vLLM's
    LLM.generate takes any number)."""
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=16, max_num_seqs=2, max_waiting=3)
    prompts = [[5, 6, 3 + i] for i in range(9)]
    outs = llm.generate(prompts, None, StoppingParams(max_tokens=2, ignore_eos=True))
    assert [c.prompt_token_ids for c in outs] == prompts
    assert all(len(c.token_ids) == 2 for c in outs)
    assert [c.token_ids for c in outs[4:6]] == [c.token_ids for c in llm.generate(
        prompts[4:6], None, StoppingParams(max_tokens=2, ignore_eos=True))]
    assert_no_leaked_blocks(llm)
