"""A JSON schema's regexes are bounded wherever they hide (Constraint.validate: INVALID_ARGUMENT
naming the pattern and the bound): llguidance's `x-guidance.whitespace_pattern` (admitted, it
failed the mask after `{"a":`), a `pattern` under any key (a `$ref` may point anywhere: one
under `x-stash` was admitted and cost the worker 0.39 s and a failed first mask), and a pattern
with a `minLength`, merged from the same schema, combinator parts or `$ref` targets (the worker
builds their intersection out: `^a+$` with minLength 4,000 failed the first mask; 3,000 worked)."""
from __future__ import annotations

import json

import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.constraints.schema_repeats import schema_repeats
from engine_common.request.diff_limits import MAX_REGEX_REPEAT_SIZE
from engine_common.request.params import ParamError

STASHED = {"$ref": "#/x-stash/s", "x-stash": {"s": {"type": "string", "pattern": "^a{1000000}$"}}}
IN_A_LIST = {"type": "object", "properties": {"a": {"$ref": "#/properties/b/x/0"},
                                              "b": {"x": [{"pattern": "^(ab){200000}$"}]}}}


def _worst(schema) -> tuple[str, int]:
    return max(schema_repeats(json.dumps(schema)), key=lambda found: found[1], default=("", 0))


@pytest.mark.parametrize("schema, where, added", [
    (STASHED, "in pattern '^a{1000000}$'", 999_999),
    (IN_A_LIST, "in pattern '^(ab){200000}$'", 399_998),
    ({"type": "object", "x-guidance": {"whitespace_pattern": "[ ]{0,3}(ab){20000}"}},
     "in pattern '[ ]{0,3}(ab){20000}'", 40_000),
    ({"type": "string", "pattern": "^a+$", "minLength": 4000},
     "in pattern '^a+$' with minLength 4000", 12_000),
    ({"allOf": [{"$ref": "#/$defs/p"}, {"minLength": 100000}],
      "$defs": {"p": {"type": "string", "pattern": "^a+$"}}},
     "in pattern '^a+$' with minLength 100000", 300_000),
    ({"type": "string", "pattern": "^a+$", "anyOf": [{"allOf": [{"minLength": 1e5}]}]},
     "in pattern '^a+$' with minLength 100000", 300_000),
])
def test_patterns_are_sized_wherever_they_are(schema, where, added):
    assert _worst(schema) == (where, added)
    with pytest.raises(ParamError) as e:
        Constraint("json_schema", json.dumps(schema)).validate()
    assert e.value.field == "constraint.json_schema"
    assert (f"add at most {MAX_REGEX_REPEAT_SIZE} atoms to it (they add {added} {where} "
            "once written out") in str(e.value)


def test_a_minlength_meets_only_patterns_it_merges_with():
    """An essay's minLength does not multiply another property's pattern; maxLength (cheap in
    every case measured) counts nothing."""
    essay = {"type": "object", "properties": {
        "essay": {"type": "string", "minLength": 5000},
        "id": {"type": "string", "pattern": "^[0-9a-f]{8}-[0-9a-f]{4}$"}}}
    assert _worst(essay) == ("in pattern '^[0-9a-f]{8}-[0-9a-f]{4}$'", 10)
    assert _worst({"type": "string", "pattern": "^a+$", "maxLength": 1_000_000}) == ("", 0)
    for schema in (essay, {"type": "string", "pattern": "^a+$", "minLength": 3000}):
        Constraint("json_schema", json.dumps(schema)).validate()


def test_what_is_not_a_schema_document_finds_nothing():
    assert schema_repeats("{not json") == [] and schema_repeats("true") == []
    assert _worst({"properties": {"pattern": {"type": "string"}}}) == ("", 0)


def _reused(n: int, rigid: bool) -> dict:
    schema = {"type": "object", "properties": {f"k{i}": {"$ref": "#/$defs/a"} for i in range(n)},
              "required": [f"k{i}" for i in range(n)], "$defs": {"a": {"const": "a" * 1000}}}
    if rigid:
        schema["x-guidance"] = {"whitespace_flexible": False}
    return schema


def test_with_rigid_whitespace_refs_count_written_out():
    """Rigid whitespace fixes the layout, and a reused definition is forced text the library
    computes on every mask (1,000 references to a 1,000-character const: 0.41 s a mask);
    with flexible whitespace (the default) the same schema costs 0.3 ms and is admitted."""
    where, added = _worst(_reused(1000, rigid=True))
    assert where == "in $refs written out (rigid whitespace forces them)"
    assert 1000 * 1000 <= added <= 1000 * 1020      # the const and its key, per reference
    with pytest.raises(ParamError, match=r"they add \d+ in \$refs written out"):
        Constraint("json_schema", json.dumps(_reused(1000, rigid=True))).validate()
    Constraint("json_schema", json.dumps(_reused(1000, rigid=False))).validate()
    Constraint("json_schema", json.dumps(_reused(5, rigid=True))).validate()
    cyclic = {"$ref": "#/$defs/n", "x-guidance": {"whitespace_flexible": False}, "$defs": {
        "n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}}
    assert _worst(cyclic)[1] < 100                 # a cycle counts once
