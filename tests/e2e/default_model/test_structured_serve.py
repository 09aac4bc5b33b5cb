"""The structured-output bar through real processes: `deltaserve serve` on the default model,
grpcurl Generate with a JSON Schema streams JSON with a string name and an integer age; a choice
returns exactly one of the choices; an invalid regex is INVALID_ARGUMENT with the grammar
engine's message, before anything is generated. The server is the one this package's tests
share (conftest.py)."""
from __future__ import annotations

import json

import pytest

from tests.support.grpc_harness import grpcurl, json_stream

pytestmark = pytest.mark.slow

PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                      "age": {"type": "integer"}},
                     "required": ["name", "age"]})
GENERATE = "deltaserve.v1.Generation/Generate"


def _generate(served, body: dict):
    return grpcurl("-d", json.dumps(body), served.target, GENERATE, timeout=300)


def test_grpcurl_json_schema_streams_a_person(served):
    proc = _generate(served, {"messages": [{"role": "user", "content": "Give me a person as JSON"}],
                              "constraint": {"json_schema": PERSON},
                              "stopping": {"max_tokens": 64}})
    assert proc.returncode == 0, proc.stderr
    msgs = json_stream(proc.stdout)
    person = json.loads("".join(m.get("text", "") for m in msgs))
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert msgs[-1]["finishReason"] == "STOP_TOKEN" and len(msgs) > 2     # streamed


def test_grpcurl_choice_returns_one_of_them(served):
    proc = _generate(served, {"messages": [{"role": "user", "content": "Is water wet?"}],
                              "constraint": {"choice": {"choices": ["yes", "no"]}},
                              "stopping": {"max_tokens": 8}})
    assert proc.returncode == 0, proc.stderr
    assert "".join(m.get("text", "") for m in json_stream(proc.stdout)) in ("yes", "no")


def test_grpcurl_invalid_regex_is_invalid_argument(served):
    proc = _generate(served, {"text": "Hi", "constraint": {"regex": "([0-9]+"}})
    assert proc.returncode != 0 and proc.stdout.strip() == ""
    assert "Code: InvalidArgument" in proc.stderr, proc.stderr
    assert "constraint.regex" in proc.stderr and "unclosed group" in proc.stderr
