"""VllmEngine's structured-output constraints over a real gRPC channel, on the real engine with a
simulated worker (fixtures: conftest.py): they reach the worker and shape the answer (a choice,
a regex on every streamed choice, a JSON schema), and an eos finish names no matched token, as
vLLM's."""
from __future__ import annotations

import json
import re

import jsonschema

from engine_common.wire.protos import vllm_engine_pb2 as pb
from tests.support.sim_server import EOS
from tests.support.vllm_sim import generate


def answer(server, msgs, index=0) -> tuple[str, pb.GenerateComplete]:
    """The text of choice `index` (streamed or not, eos left out) and its `complete`."""
    complete = next(m.complete for m in msgs if m.HasField("complete")
                    and m.complete.index == index)
    streamed = [t for m in msgs if m.HasField("chunk") and m.chunk.index == index
                for t in m.chunk.token_ids]
    ids = streamed or list(complete.output_ids)
    return server.tokenizer.decode([t for t in ids if t != EOS]), complete


def test_a_choice_constraint_answers_one_choice_and_stops_at_eos(server, stub):
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        msgs = list(stub.Generate(generate(
            request_id=f"c{seed}", max_tokens=30, temperature=1.0, seed=seed,
            choice=pb.ChoiceConstraint(choices=choices)), timeout=60))
        text, complete = answer(server, msgs)
        assert text in choices
        assert complete.finish_reason == "stop" and complete.output_ids[-1] == EOS
    assert server.used_blocks() == 0


def test_an_eos_finish_names_no_matched_token_as_vllm(server, stub):
    """vLLM's stop_reason is None at the tokenizer's eos, so its servicer sets no matched_stop
    (smg then reports none); a stop id the caller listed is named, eos too under ignore_eos."""
    choice = pb.ChoiceConstraint(choices=["yes", "no"])
    for stream in (False, True):
        msgs = list(stub.Generate(generate(request_id=f"e{stream}", max_tokens=30,
                                           stream=stream, choice=choice), timeout=60))
        _, complete = answer(server, msgs)
        assert complete.finish_reason == "stop" and complete.output_ids[-1] == EOS
        assert complete.WhichOneof("matched_stop") is None
    msgs = list(stub.Generate(generate(request_id="i", max_tokens=30, ignore_eos=True,
                                       stop_token_ids=[EOS], choice=choice), timeout=60))
    _, complete = answer(server, msgs)
    assert complete.finish_reason == "stop" and complete.matched_token_id == EOS


def test_a_regex_holds_for_every_streamed_choice(server, stub):
    pattern = "[0-9]{3}-[a-z]{2}"
    msgs = list(stub.Generate(generate(stream=True, n=3, temperature=1.0, seed=3, max_tokens=40,
                                       regex=pattern), timeout=60))
    texts = [answer(server, msgs, i)[0] for i in range(3)]
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_a_json_schema_answer_validates(server, stub):
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
        "tags": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
        "required": ["ok", "size", "tags"]}
    for seed in range(3):
        msgs = list(stub.Generate(generate(request_id=f"j{seed}", max_tokens=120,
                                           temperature=1.0, seed=seed,
                                           json_schema=json.dumps(schema)), timeout=60))
        text, complete = answer(server, msgs)
        assert complete.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
