"""Issue 23 item 4: a new constraint is compiled off the worker's step, so it stalls nobody.

The in-process engine on the tiny model (a real ModelRunner and its GrammarBook). The compile
thread is held by a job ahead of a 10,000-choice constraint, so its compile is certainly not
done while steps are counted (steps, not seconds): before the fix the step that brought the
constraint compiled it inline, and every stream waited for it. (The issue's 60,000 choices are
now refused at admission, MAX_CONSTRAINT_CHOICES: past 50,000 llguidance's first mask always
fails, after 17 s of compiling and 35 s of masking on SmolLM2's vocabulary here.)
"""
from __future__ import annotations

import threading

import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from tests.support.grammar_text import tiny_compiler
from tests.support.off_loop import other_thread_turns

pytestmark = pytest.mark.slow

# The most choices allowed (MAX_CONSTRAINT_CHOICES), one character each.
BIG = Constraint("choice", tuple(chr(33 + i % 90) for i in range(10_000)))


def test_a_10000_choice_constraint_compiling_stalls_no_other_stream(tiny_models):
    llm = LLM(tiny_models("qwen3"), dtype="float32", num_kv_blocks=64, max_model_len=512,
              max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    engine, eos = llm.engine, llm.model_info.eos_token_ids
    compiler = llm.runner.grammar.compiler
    gate = threading.Event()
    compiler.pool.submit(gate.wait)               # the compile thread is busy until released
    stream = Request("stream", [3, 14, 15, 92], SamplingParams(seed=1),
                     StoppingParams(max_tokens=60, ignore_eos=True), eos)
    picky = Request("picky", [6, 53, 58], SamplingParams(seed=2), StoppingParams(max_tokens=8),
                    eos, constraint=BIG)
    engine.add_request(stream)
    engine.step()
    engine.add_request(picky)
    for i in range(20):                          # picky's grammar is not compiled meanwhile
        before = stream.num_output_tokens
        engine.step()
        assert stream.num_output_tokens == before + 1, f"step {i}: the stream got no token"
        assert picky.num_output_tokens == 0 and picky.awaiting_grammar
    assert picky.num_computed_tokens == 2         # its prompt but the sampling position
    gate.set()
    compiler.prepare(BIG).result()                # compiled off the step; now it may sample
    while engine.has_unfinished_requests():
        engine.step()
    text = llm.tokenizer.decode([t for t in picky.output_token_ids if t not in eos])
    assert text in set(BIG.value), picky.output_token_ids
    assert picky.status.name == "FINISHED_STOP_TOKEN"
    assert stream.num_output_tokens == 60
    assert llm.scheduler.num_free_blocks == llm.scheduler.num_total_blocks


def test_compiling_releases_the_gil(tmp_path):
    """The compile thread must not hold the step's thread back: llguidance releases the GIL
    while it compiles and computes the first mask (counted as another thread's turns)."""
    compiler = tiny_compiler(tmp_path)
    compiler.tokenizer                            # built first, outside the count
    _, turns = other_thread_turns(lambda: compiler.prepare(BIG).result())
    assert compiler.num_compiled == 1 and turns > 10_000, turns
