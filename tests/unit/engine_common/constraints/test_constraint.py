"""Constraints: the five kinds, validation by the grammar engine at admission (ParamError with
its message), the wire form, the cache key, and strict object schemas."""
from __future__ import annotations

import json

import pytest

from engine_common.constraints.constraint import Constraint, _strict_schema, constraint_from_fields
from engine_common.request.diff_limits import MAX_CONSTRAINT_DEPTH
from engine_common.request.params import ParamError
from tests.support.deep_constraints import (gbnf_chain, json_items_chain, json_nested_arrays,
                                            lark_chain, regex_nested)
from tests.support.grammar_text import accepts, tiny_compiler

PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                      "age": {"type": "integer"}},
                     "required": ["name", "age"]})


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return tiny_compiler(tmp_path_factory.mktemp("grammar"))


def test_from_fields_picks_the_one_set_kind():
    assert constraint_from_fields() is None
    assert constraint_from_fields(regex="a+") == Constraint("regex", "a+")
    assert constraint_from_fields(json_object=True) == Constraint("json_object", True)
    assert constraint_from_fields(choice=["a", "b"]).value == ("a", "b")
    with pytest.raises(ParamError, match="at most one kind"):
        constraint_from_fields(regex="a", grammar="start: 'a'")


@pytest.mark.parametrize("kind, value, field", [
    ("regex", "", "constraint.regex"),
    ("json_schema", 5, "constraint.json_schema"),
    ("json_object", False, "constraint.json_object"),
    ("choice", (), "constraint.choice.choices"),
    ("choice", ("a", ""), "constraint.choice.choices"),
    ("sql", "x", "constraint"),
])
def test_bad_shapes_name_the_field(kind, value, field):
    with pytest.raises(ParamError) as e:
        Constraint(kind, value)
    assert e.value.field == field


@pytest.mark.parametrize("kind, value, message", [
    ("regex", "(ab", "unclosed group"),
    ("regex", "a(?=b)", "look-around"),
    ("json_schema", '{"type": "foo"}', "Invalid type: foo"),
    ("json_schema", "not json", "expected ident"),
    ("json_schema", '{"type": "string", "format": "nope"}', "Unknown format: nope"),
    ("grammar", "start: 'a' | ", "lexer error"),
    ("grammar", 'root ::= "a" missing', "Rule 'missing' not found"),
    ("grammar", "start: foo", 'unknown name: "foo"'),
])
def test_invalid_constraints_carry_the_engines_message(kind, value, message):
    with pytest.raises(ParamError) as e:
        Constraint(kind, value).validate()
    assert e.value.field == f"constraint.{kind}"
    assert "the grammar engine accepts; it says:" in str(e.value)
    assert message in str(e.value)


@pytest.mark.parametrize("kind, value", [
    ("json_schema", PERSON), ("json_object", True), ("regex", r"[0-9]{3}-[0-9]{4}"),
    ("grammar", 'start: "yes" | "no"'), ("grammar", 'root ::= "a" "b"*'),
    ("choice", ("yes", "no")),
])
def test_valid_constraints_validate(kind, value):
    assert Constraint(kind, value).validate() == Constraint(kind, value)


def test_a_long_value_is_cut_in_the_message():
    with pytest.raises(ParamError) as e:
        Constraint("regex", "(" + "a" * 1000).validate()
    assert len(repr(e.value.value)) < 220 and e.value.value.endswith("...")


def test_wire_round_trip_and_key():
    for c in (Constraint("json_schema", PERSON), Constraint("json_object", True),
              Constraint("choice", ("a", "b")), Constraint("regex", "x")):
        assert Constraint.from_wire(c.to_wire()) == c
        assert c.key == Constraint.from_wire(c.to_wire()).key
    keys = {Constraint("regex", "a").key, Constraint("grammar", "a").key,
            Constraint("choice", ("a",)).key, Constraint("choice", ("a", "b")).key}
    assert len(keys) == 4


def test_object_schemas_are_closed_unless_they_say_otherwise():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {}}}},
        "any": {"anyOf": [{"properties": {"a": {}}}, {"type": "null"}]},
        "open": {"properties": {"b": {}}, "additionalProperties": True}},
        "$defs": {"d": {"properties": {"c": {}}}}}
    out = json.loads(_strict_schema(json.dumps(schema)))
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props          # a property named "properties" is kept
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["any"]["anyOf"][0]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert _strict_schema("not json") == "not json"


def test_objects_in_draft_4_tuple_items_are_closed_too(compiler):
    """`items` as a list (draft 4, which the engine accepts) was skipped: its objects open."""
    pair = Constraint("json_schema", json.dumps({"type": "array", "items": [
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"type": "integer"}]}))
    assert accepts(compiler, pair, '[{"a": 1}, 2]')
    assert not accepts(compiler, pair, '[{"a": 1, "z": 0}, 2]')


def test_grammars_accept_what_they_should(compiler):
    person = Constraint("json_schema", PERSON)
    assert accepts(compiler, person, '{"name": "Ann", "age": 7}')
    assert not accepts(compiler, person, '{"name": "Ann"}')                  # age required
    assert not accepts(compiler, person, '{"name": "Ann", "age": 7, "x": 1}')  # closed
    assert not accepts(compiler, person, '{"name": "Ann", "age": 7.5}')
    assert accepts(compiler, Constraint("json_object", True), '{"a": [1, {"b": null}]}')
    assert not accepts(compiler, Constraint("json_object", True), '[1]')
    assert accepts(compiler, Constraint("regex", "[0-9]{3}-[0-9]{4}"), "555-1234")
    assert not accepts(compiler, Constraint("regex", "[0-9]{3}-[0-9]{4}"), "555-123")
    assert accepts(compiler, Constraint("choice", ("yes", "no")), "no")
    assert not accepts(compiler, Constraint("choice", ("yes", "no")), "yes no")
    assert accepts(compiler, Constraint("grammar", 'start: "a" "b"*'), "abbb")
    assert accepts(compiler, Constraint("grammar", 'root ::= "a" ("b" | "c")*'), "acb")


def test_the_engines_message_about_a_big_constraint_stays_small():
    """llguidance quotes the whole regex (and a caret line as wide) several times: 224 KB for this
    one, more than gRPC's status metadata allows. Each line is cut; the verdict survives."""
    # (counts of 3 each: 3000 counts of {3,9} would add 24,000 atoms, refused before the
    # engine sees it: test_regex_size.py)
    regex = "|".join(f"word{i}[a-z]{{3}}" for i in range(3000)) + "|(unclosed"
    with pytest.raises(ParamError) as e:
        Constraint("regex", regex).validate()
    assert "unclosed group" in e.value.allowed and len(str(e.value)) < 5000


@pytest.mark.parametrize("kind, text, depth", [
    ("grammar", lark_chain(3000), 3002),            # overflowed an 8 MiB stack: SIGSEGV
    ("grammar", gbnf_chain(3000), 3002),
    ("json_schema", json_items_chain(1200), 2403),  # likewise
    ("json_schema", json_items_chain(1200, "json-schema:///#/$defs/{}"), 2403),  # issue 23
    ("json_schema", json_nested_arrays(2000), 2001),  # Python's json raised RecursionError
    ("regex", regex_nested(20_000), 20_000),
])
def test_a_constraint_nested_too_deep_is_refused_naming_depth_and_bound(kind, text, depth):
    with pytest.raises(ParamError) as e:
        Constraint(kind, text).validate()
    assert e.value.field == f"constraint.{kind}"
    assert e.value.value == f"nested {depth} deep"
    assert f"nested at most {MAX_CONSTRAINT_DEPTH} deep" in e.value.allowed


def test_a_schema_deeper_than_python_parses_gets_the_engines_message():
    """Nested 991 deep: under the bound, too deep for Python's json (RecursionError escaped)
    and for llguidance's parser (128 levels), which refuses it."""
    with pytest.raises(ParamError, match="recursion limit exceeded"):
        Constraint("json_schema", json_nested_arrays(990)).validate()


def test_a_grammar_just_under_the_bound_validates_compiles_and_constrains(compiler):
    chain = Constraint("grammar", lark_chain(MAX_CONSTRAINT_DEPTH - 2))
    assert chain.depth == MAX_CONSTRAINT_DEPTH
    assert chain.validate() is chain
    assert accepts(compiler, chain, "x" * 40)
    assert not accepts(compiler, chain, "x" * (MAX_CONSTRAINT_DEPTH + 1))
    with pytest.raises(ParamError, match="nested 1001 deep"):
        Constraint("grammar", lark_chain(MAX_CONSTRAINT_DEPTH - 1)).validate()


def test_too_many_choices_are_refused_by_name():
    """Issue 23 item 4: 60,000 one-character choices (under --max-constraint-chars) cost 17 s
    of compiling and then fail at the first mask; more than MAX_CONSTRAINT_CHOICES are refused
    before any grammar work."""
    from engine_common.request.diff_limits import MAX_CONSTRAINT_CHOICES

    Constraint("choice", ["x"] * MAX_CONSTRAINT_CHOICES)
    with pytest.raises(ParamError, match=r"constraint\.choice\.choices='60000 choices' is "
                                         r"invalid: must be at most 10000 choices"):
        Constraint("choice", [chr(33 + i % 90) for i in range(60_000)])


@pytest.mark.parametrize("schema", ["5", "null", '"x"', "false"])
def test_a_schema_that_is_no_object_is_refused_with_the_engines_message(schema):
    """Before, the depth measure indexed an empty list of containers: IndexError (INTERNAL
    through gRPC) instead of the field and the engine's reason."""
    with pytest.raises(ParamError, match=r"constraint\.json_schema=.* is invalid: must be a "
                                         r"JSON Schema the grammar engine accepts"):
        Constraint("json_schema", schema).validate()


def test_the_schema_true_allows_any_json():
    assert Constraint("json_schema", "true").validate().depth == 0


def test_one_choice_as_a_string_is_refused_not_split_into_characters():
    with pytest.raises(ParamError, match=r"constraint\.choice\.choices='yes' is invalid: must "
                                         r"be a list of strings"):
        Constraint("choice", "yes")
    assert Constraint("choice", ["yes"]).value == ("yes",)


ALL_OF = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]},
                    {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
BESIDE = {"type": "object", "properties": {"a": {"type": "integer"}},
          "anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]},
                    {"properties": {"c": {"type": "string"}}, "required": ["c"]}]}


def test_objects_spread_over_combined_schemas_are_not_closed_part_by_part(compiler):
    """Closing each part forbade the other parts' properties: llguidance refused both schemas
    as unsatisfiable ("required property 'a' is unsatisfiable")."""
    all_of = Constraint("json_schema", json.dumps(ALL_OF)).validate()
    assert accepts(compiler, all_of, '{"a": 1, "b": 2}')
    assert not accepts(compiler, all_of, '{"a": 1}')
    beside = Constraint("json_schema", json.dumps(BESIDE)).validate()
    assert accepts(compiler, beside, '{"a": 1, "b": 2}')
    assert accepts(compiler, beside, '{"c": "x"}')
    assert not accepts(compiler, beside, '{"a": 1}')


def test_whole_objects_within_combined_schemas_stay_closed(compiler):
    union = Constraint("json_schema", json.dumps({"anyOf": [
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}))
    assert accepts(compiler, union, '{"a": 1}')
    assert not accepts(compiler, union, '{"a": 1, "z": 2}')
    either = Constraint("json_schema", json.dumps({
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}))
    assert accepts(compiler, either, '{"b": 1}')
    assert not accepts(compiler, either, '{"b": 1, "z": 2}')
    nested = Constraint("json_schema", json.dumps({"allOf": [
        {"properties": {"inner": {"properties": {"x": {"type": "integer"}}}}},
        {"properties": {"more": {}}}]}))
    assert accepts(compiler, nested, '{"inner": {"x": 1}, "more": 2}')
    assert not accepts(compiler, nested, '{"inner": {"x": 1, "y": 2}}')   # its property: closed
    # pydantic's wrapper of a $ref (a field with a default): one part, nothing to combine with
    wrapped = Constraint("json_schema", json.dumps({
        "$defs": {"X": {"properties": {"a": {"type": "integer"}}, "required": ["a"]}},
        "properties": {"x": {"allOf": [{"$ref": "#/$defs/X"}], "default": {"a": 1}}},
        "required": ["x"]}))
    assert accepts(compiler, wrapped, '{"x": {"a": 1}}')
    assert not accepts(compiler, wrapped, '{"x": {"a": 1, "z": 1}}')


@pytest.mark.parametrize("combine", ["$ref", "allOf"])
def test_a_definition_extended_beside_its_reference_stays_open(compiler, combine):
    """{"$ref": Base, "properties": {b}} (or allOf [Base]): Base closed forbade b, the object
    closed forbade Base's a: refused as unsatisfiable."""
    ref = {"$ref": "#/$defs/Base"}
    schema = {"$defs": {"Base": {"properties": {"a": {"type": "integer"}}, "required": ["a"]}},
              **(ref if combine == "$ref" else {"allOf": [ref]}),
              "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    extended = Constraint("json_schema", json.dumps(schema)).validate()
    assert accepts(compiler, extended, '{"a": 1, "b": 2}')
    assert not accepts(compiler, extended, '{"b": 2}')


def test_a_schema_may_be_given_as_a_dict():
    """As vLLM's json=dict (pydantic's model_json_schema()): refused as no string before."""
    schema = json.loads(PERSON)
    assert Constraint("json_schema", schema).validate() == Constraint("json_schema", PERSON)
    assert Constraint("json_schema", {"x": "\u00e9"}).value == '{"x": "\u00e9"}'
