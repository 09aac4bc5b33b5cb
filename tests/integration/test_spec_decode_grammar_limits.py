"""n-gram drafts of constrained requests whose grammar hits an llguidance resource limit
(too many Earley items for one mask) part way: computing the mask at a draft position may fail
while the run never reaches it, and the request must go on exactly as without drafts, failing
only where one-token decoding fails (the same tokens before it, the same error). Tiny qwen3
(fp32) through the in-process engine; the limited grammar is put in each worker's compiled
cache as a compiled constraint would be."""
from __future__ import annotations

import llguidance
import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams
from tests.integration.test_spec_decode import SPEC
from tests.support.engine_checks import assert_no_leaked_blocks

# The request's constraint; each worker serves it with AMBIGUOUS under a tight item limit.
A_RUN = Constraint("grammar", 'start: s\ns: "a"+')
# Every split of "aaa.." parses, so the Earley items of a mask grow with the output
# (admission refuses such a grammar: Constraint.check_ambiguity; here it stands in for a
# large grammar near its limit).
AMBIGUOUS = 'start: s\ns: s s | "a"'
MAX_NEW = 16
A, EOS = 67, 0          # "a" and eos of the tiny qwen3's tokenizer


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models("qwen3")


def _llm(model: str, spec: bool, step_max_items: int, asynchronous: bool = False) -> LLM:
    llm = LLM(model, dtype="float32", num_kv_blocks=128, async_scheduling=asynchronous,
              speculative_config=SPEC if spec else None)
    compiler = llm.runner.grammar.compiler
    grammar = llguidance.LLMatcher.grammar_from_lark(AMBIGUOUS)
    limits = llguidance.LLParserLimits(step_max_items=step_max_items)
    compiler._compiled[A_RUN.key] = llguidance.LLMatcher(
        compiler.tokenizer, grammar, log_level=0, limits=limits)
    return llm


def _outcome(llm: LLM, min_tokens: int):
    """A run of "a"s (token 67 of the tiny qwen3) as the prompt, so n-gram drafts are found;
    greedy, eos masked until `min_tokens` (then it is the model's choice)."""
    outs = llm.generate([[A] * 24], SamplingParams(),
                        StoppingParams(max_tokens=MAX_NEW, min_tokens=min_tokens),
                        constraint=[A_RUN])
    return [(o.token_ids, o.finish_reason, o.error) for o in outs]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_mask_failing_at_a_draft_position_fails_only_where_decoding_does(model,
                                                                           asynchronous):
    """Under an item limit of 30 the mask after 13 "a"s fails. 12 "a"s then eos: one-token
    decoding never computes that mask, but a draft after the 12th "a" did, and failed the
    request at once (before the fix); now the run ends before that position and the tokens
    are those without drafts. 13 "a"s: decoding itself hits the error, and so does the
    drafted run, with the same message."""
    on, off = _llm(model, True, 30, asynchronous), _llm(model, False, 30)
    fine, failing = _outcome(on, 12), _outcome(on, 13)
    assert fine == _outcome(off, 12)
    assert fine[0][0] == [A] * 12 + [EOS] and fine[0][2] is None
    assert failing == _outcome(off, 13)
    assert "Too many items (limit 30; mask)" in failing[0][2]
    assert on.scheduler.spec.stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(on)
