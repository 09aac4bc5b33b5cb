"""Structured output on the real default model (SmolLM2-135M-Instruct, fp32, in process): greedy
and sampled outputs (several seeds) parse as JSON and validate against their schema (nested
objects, enums, arrays, required fields), fully match their regex, are one of their choices or a
sentence of their grammar, and end with STOP_TOKEN at eos; the same prompt without the
constraint violates the schema; a constrained request preempted mid-output (async scheduling, a
cache too small for the batch) resumes its grammar where it was."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import RequestStatus

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
# Nested objects, an enum, an array and required fields; lengths bounded so a small model
# finishes well within max_tokens.
EMPLOYEE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "integer", "minimum": 0,
                                           "maximum": 99999}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "role", "skills", "address"],
}
SAMPLINGS = [SamplingParams()] + [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, dtype="float32", num_kv_blocks=256)


def _run(llm, content, constraint, max_tokens):
    n = len(SAMPLINGS)
    return llm.chat([ask(content)] * n, SAMPLINGS, StoppingParams(max_tokens=max_tokens),
                    constraint=constraint)


def _ends_at_eos(out) -> bool:
    return out.finish_reason == RequestStatus.FINISHED_STOP_TOKEN and out.stop_reason == 2


def test_json_schema_outputs_validate(llm):
    for schema, content in ((PERSON, "Give me a person as JSON"),
                            (EMPLOYEE, "Describe an employee of a software company as JSON")):
        outs = _run(llm, content, Constraint("json_schema", json.dumps(schema)), 160)
        for out in outs:
            assert _ends_at_eos(out), (out.text, out.finish_reason)
            jsonschema.validate(json.loads(out.text), schema)


def test_the_unconstrained_model_violates_the_schema_the_constraint_enforces(llm):
    """Greedy, the same chat: without the constraint the answer is not a valid person."""
    free = llm.chat(ask("Give me a person as JSON"), stopping=StoppingParams(max_tokens=64))[0]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.text), PERSON)
    bound = llm.chat(ask("Give me a person as JSON"), stopping=StoppingParams(max_tokens=64),
                     constraint=Constraint("json_schema", json.dumps(PERSON)))[0]
    jsonschema.validate(json.loads(bound.text), PERSON)


def test_regex_choice_and_grammar_outputs_match(llm):
    phone = _run(llm, "Give me a US phone number.", Constraint("regex", PHONE), 24)
    yes_no = _run(llm, "Is the sky blue? Answer yes or no.", Constraint("choice", ("yes", "no")),
                  8)
    colour = _run(llm, "Name a colour and a number.",
                  Constraint("grammar", 'start: COLOUR " " NUMBER\n'
                                        'COLOUR: "red" | "green" | "blue"\n'
                                        'NUMBER: /[1-9][0-9]?/'), 16)
    for out in phone + yes_no + colour:
        assert _ends_at_eos(out), (out.text, out.finish_reason)
    assert all(re.fullmatch(PHONE, out.text) for out in phone), [o.text for o in phone]
    assert all(out.text in ("yes", "no") for out in yes_no), [o.text for o in yes_no]
    assert all(re.fullmatch("(red|green|blue) [1-9][0-9]?", out.text) for out in colour)


def test_json_object_and_min_tokens_past_the_end_of_the_grammar(llm):
    """Any JSON object; and a choice shorter than min_tokens ends at its eos all the same."""
    obj = llm.chat(ask("Return a JSON object with a key \"ok\""),
                   stopping=StoppingParams(max_tokens=96),
                   constraint=Constraint("json_object", True))[0]
    assert _ends_at_eos(obj) and isinstance(json.loads(obj.text), dict)
    short = llm.chat(ask("Yes or no?"), stopping=StoppingParams(max_tokens=8, min_tokens=6),
                     constraint=Constraint("choice", ("yes", "no")))[0]
    assert _ends_at_eos(short) and short.text in ("yes", "no")


def test_preempted_mid_constraint_resumes_its_grammar(default_model):
    """Async scheduling and a cache of 14 blocks for 6 requests that need about 4 each:
    requests are preempted after some of their tokens and resume by replaying their matcher;
    every output still validates."""
    llm = LLM(default_model, dtype="float32", num_kv_blocks=14, max_num_seqs=6,
              max_num_batched_tokens=128, enable_prefix_caching=False, async_scheduling=True)
    mid = []
    schedule = llm.scheduler.schedule

    def watch():
        running = {r.handle: r for r in llm.scheduler.running}
        out = schedule()
        mid.extend(h for h in out.preempted_handles if running[h].num_output_tokens > 0)
        return out
    llm.scheduler.schedule = watch
    samplings = [SamplingParams(temperature=0.8, seed=s) if s % 2 else SamplingParams()
                 for s in range(6)]
    outs = llm.chat([ask(f"Describe employee number {i} as JSON") for i in range(6)],
                    samplings, StoppingParams(max_tokens=160),
                    constraint=Constraint("json_schema", json.dumps(EMPLOYEE)))
    assert mid, "no request was preempted mid-output"
    for out in outs:
        assert _ends_at_eos(out), (out.text, out.finish_reason)
        jsonschema.validate(json.loads(out.text), EMPLOYEE)
