"""Constraints that can never produce anything are refused at admission, naming the reference
or rule: llguidance admits a schema that only refers to itself (`{"$ref": "#"}`) or a rule that
only expands into itself (`a: a`, `a: "(" a ")"`), and the worker's matcher then failed at the
first mask ("NoExtensionBias": the request ABORTED with an internal message) or in the middle
of the output where the model walked into such a part (after `{"a":`, after `(((`). Recursion
with a way out, and unproductive rules nothing reaches, pass."""
from __future__ import annotations

import json

import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.constraints.empty_language import unproductive_ref, unproductive_rule
from engine_common.request.params import ParamError
from tests.support.grammar_text import accepts, tiny_compiler


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return tiny_compiler(tmp_path_factory.mktemp("grammar"))


@pytest.mark.parametrize("schema, stuck", [
    ({"$ref": "#"}, "#"),
    ({"$defs": {"a": {"$ref": "#/$defs/a", "title": "t"}}, "$ref": "#/$defs/a"}, "#/$defs/a"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"}, "#/$defs/a"),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}, "#/properties/a"),
])
def test_a_schema_referring_only_to_itself_is_refused(schema, stuck):
    assert unproductive_ref(json.dumps(schema)) == stuck
    with pytest.raises(ParamError) as e:
        Constraint("json_schema", json.dumps(schema)).validate()
    assert e.value.field == "constraint.json_schema"
    assert (f"{stuck!r} refers only back to itself (through $ref, allOf, anyOf, oneOf)"
            in str(e.value))


@pytest.mark.parametrize("grammar, stuck", [
    ("start: a\na: a", "a"),
    ('start: (a | "y")\na: "(" a ")"', "a"),
    ('start: "x" b?\nb: c "," \nc: "[" b "]"', "b"),
    ('root ::= "<" item ">"\nitem ::= "(" item ")"', "item"),
])
def test_a_rule_that_can_never_end_is_refused(grammar, stuck):
    assert unproductive_rule(grammar) == stuck
    with pytest.raises(ParamError, match=f"rule {stuck!r} can only expand into itself"):
        Constraint("grammar", grammar).validate()


@pytest.mark.parametrize("kind, value, text", [
    ("json_schema", {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "null"),
    ("json_schema", {"type": "object", "properties": {"next": {"$ref": "#"}}},
     '{"next": {"next": {}}}'),
    ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}},
                     "$ref": "#/$defs/a"}, "5"),
    ("grammar", 'start: "x" | "(" start ")"', "((x))"),
    ("grammar", 'start: "x"\nunused: unused', "x"),
    ("grammar", 'start: item{0,3} "."\nitem: "a" item?', "aaa."),
])
def test_recursion_with_a_way_out_passes(compiler, kind, value, text):
    constraint = Constraint(kind, json.dumps(value) if kind == "json_schema" else value)
    assert accepts(compiler, constraint.validate(), text)


@pytest.mark.parametrize("grammar, rule", [
    ('start: a\na: "a" | a a', "a"),                 # 1.36 s a mask at worst on SmolLM2
    ('start: s\ns: "b" | s s | s s s', "s"),
    ('start: a\na: b b\nb: a | "x"', "a"),
    ('start: a\na: "x" | (a a)', "a"),
    ('start: a\na: "x" | a{2}', "a"),
    ('root ::= x\nx ::= "a" | x x', "x"),
])
def test_a_rule_joining_copies_of_itself_is_refused(grammar, rule):
    """Every split of the output is a parse: llguidance's Earley rows grow with the output, 98 ms
    a mask at the median over 250 masks, then the request failed at the 2,000-item limit."""
    with pytest.raises(ParamError) as e:
        Constraint("grammar", grammar).validate()
    assert e.value.field == "constraint.grammar"
    assert f"rule {rule!r} has an alternative made of its own recursion alone" in str(e.value)


@pytest.mark.parametrize("grammar, text", [
    ('start: expr\nexpr: expr "+" expr | /[0-9]/', "1+2+3"),
    ('start: items\nitems: item | items item\nitem: "x"', "xxx"),
    ('start: a a\na: "x"', "xx"),
    ('start: a\na: "(" a a ")" | "x"', "(x(xx))"),
])
def test_separated_or_unit_recursion_passes(compiler, grammar, text):
    assert accepts(compiler, Constraint("grammar", grammar).validate(), text)
