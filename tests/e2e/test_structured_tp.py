"""Structured output under tensor parallelism: every rank computes the grammar masks itself, so a
TP=2 worker (two rank processes over gloo, symmetry checks on: the ranks' digests cover the
matchers' state and masks) gives exactly the TP=1 tokens, greedy and sampled, and the outputs
match their constraints. The same holds for allowed_token_ids, which every rank applies from the
diff. The tiny llama (4 heads, random weights) writes gibberish; the
constraints still hold."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.core.request import Request
from tests.support.tp_harness import BLOCK_SIZE, LIMITS, NUM_BLOCKS, make_core

pytestmark = pytest.mark.slow

WORD_NUMBER = "[a-z]{2,6} [0-9]{1,3}"
CHOICES = ("alpha", "beta", "gamma")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}
CONSTRAINTS = [Constraint("regex", WORD_NUMBER), Constraint("choice", CHOICES),
               Constraint("json_schema", json.dumps(SCHEMA)), None]


def workload():
    prompts = [[5 + i, 17, 300, 42, 9 + i, 77] for i in range(8)]
    samplings = [SamplingParams(seed=100 + i) if i % 2 == 0 else
                 SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i) for i in range(8)]
    stoppings = [StoppingParams(max_tokens=24) for _ in range(8)]
    return prompts, samplings, stoppings


def run_constrained(core, model_dir, prompts, samplings, stoppings) -> list[list[int]]:
    eos = ModelInfo.from_dir(model_dir).eos_token_ids
    tokens = {}
    for i, (prompt, sp, st) in enumerate(zip(prompts, samplings, stoppings)):
        tokens[f"r{i}"] = []
        core.add_request(Request(f"r{i}", prompt, sp, st, eos,
                                 constraint=CONSTRAINTS[i % len(CONSTRAINTS)]))
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not core.has_unfinished_requests()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_tp2_constrained_tokens_equal_tp1(tp2, tiny_models):
    model = tiny_models("llama")
    # The reference: TP=1 in process, the same scheduler settings and constraints.
    llm = LLM(model, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, **LIMITS)
    expected = run_constrained(llm.engine, model, *workload())
    client = tp2.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        result = client.init(tp2.spec(model, verify_symmetry=True))
        assert result.tp_size == 2, tp2.logs()
        tokens = run_constrained(make_core(model, client), model, *workload())
    except Exception:
        print(tp2.logs())
        raise
    finally:
        client.close()
    assert tokens == expected
    tokenizer = Tokenizer.from_dir(model)
    texts = [tokenizer.decode(t[:-1]) for t in tokens]
    print("TP=2 constrained outputs:", texts)
    eos = ModelInfo.from_dir(model).eos_token_ids
    for i, (ids, text) in enumerate(zip(tokens, texts)):
        constraint = CONSTRAINTS[i % len(CONSTRAINTS)]
        if constraint is None or ids[-1] not in eos:
            continue                      # unconstrained, or cut by max_tokens
        if constraint.kind == "regex":
            assert re.fullmatch(WORD_NUMBER, text), text
        elif constraint.kind == "choice":
            assert text in CHOICES, text
        else:
            assert set(json.loads(text)) == {"n", "ok"}, text
    finished = [ids for i, ids in enumerate(tokens) if CONSTRAINTS[i % 4] is not None
                and CONSTRAINTS[i % 4].kind != "json_schema"]
    assert all(ids[-1] in eos for ids in finished), tokens


def test_tp2_allowed_token_ids_tokens_equal_tp1(tp2, tiny_models):
    """Every rank restricts the same rows to the same ids: the TP=2 tokens, greedy and sampled,
    are TP=1's, and only allowed ids come out."""
    model = tiny_models("llama")
    prompts, samplings, stoppings = workload()
    allowed = [(3, 40, 41, 77, 128, 200) if i % 3 else () for i in range(len(prompts))]
    samplings = [dataclasses.replace(sp, allowed_token_ids=ids)
                 for sp, ids in zip(samplings, allowed)]
    llm = LLM(model, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, **LIMITS)
    expected = [c.token_ids for c in llm.generate(prompts, samplings, stoppings)]
    client = tp2.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        assert client.init(tp2.spec(model, verify_symmetry=True)).tp_size == 2, tp2.logs()
        core = make_core(model, client)
        eos = ModelInfo.from_dir(model).eos_token_ids
        tokens = {}
        for i, (prompt, sp, st) in enumerate(zip(prompts, samplings, stoppings)):
            core.add_request(Request(f"r{i}", prompt, sp, st, eos))
            tokens[f"r{i}"] = []
        for _ in range(500):
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                tokens[out.request_id].extend(out.new_token_ids)
    except Exception:
        print(tp2.logs())
        raise
    finally:
        client.close()
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    for ids, only in zip(expected, allowed):
        assert not only or set(ids) <= set(only), (ids, only)


def _run_with_failures(core, model_dir, prompts, samplings, stoppings, constraints):
    eos = ModelInfo.from_dir(model_dir).eos_token_ids
    tokens, errors = {}, {}
    for i, (prompt, sp, st) in enumerate(zip(prompts, samplings, stoppings)):
        tokens[f"r{i}"] = []
        core.add_request(Request(f"r{i}", prompt, sp, st, eos, constraint=constraints[i]))
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.error is not None:
                errors[out.request_id] = str(out.error)
    assert not core.has_unfinished_requests()
    return [tokens[f"r{i}"] for i in range(len(prompts))], errors


def test_tp2_a_grammar_failing_on_the_ranks_fails_that_request_alone(tp2, tiny_models):
    """Every rank decides a grammar failure alike (here: a regex of digits whose request allows
    only a letter): under symmetry checks the ranks agree, the request fails with its error, and
    the others get TP=1's tokens."""
    model = tiny_models("llama")
    prompts, samplings, stoppings = workload()
    (letter,) = Tokenizer.from_dir(model).backend.encode("x", add_special_tokens=False).ids
    samplings[2] = dataclasses.replace(samplings[2], allowed_token_ids=(letter,))
    constraints = [CONSTRAINTS[i % len(CONSTRAINTS)] for i in range(len(prompts))]
    constraints[2] = Constraint("regex", "[0-9]+")
    llm = LLM(model, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, **LIMITS)
    expected, expected_errors = _run_with_failures(llm.engine, model, prompts, samplings,
                                                   stoppings, constraints)
    assert list(expected_errors) == ["r2"] and "allowed_token_ids and its grammar" in \
        expected_errors["r2"]
    client = tp2.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        assert client.init(tp2.spec(model, verify_symmetry=True)).tp_size == 2, tp2.logs()
        tokens, errors = _run_with_failures(make_core(model, client), model, prompts, samplings,
                                            stoppings, constraints)
    except Exception:
        print(tp2.logs())
        raise
    finally:
        client.close()
    assert errors == expected_errors and tokens == expected and tokens[2] == []
