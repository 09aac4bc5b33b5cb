"""engine_common/constraints/constraint_depth.py: the nesting of Lark and GBNF grammars (rule chains, cycles
counted whole, brackets, embedded %json), of JSON schemas (text nesting, $ref chains, anchors,
pointers), of regexes; measured without recursion, so far past Python's recursion limit."""
from __future__ import annotations

import json

import llguidance
import pytest

from engine_common.constraints.constraint_depth import (grammar_depth, json_schema_depth, json_text_depth,
                                            regex_depth)
from tests.support.deep_constraints import (gbnf_chain, json_items_chain, json_nested_arrays,
                                            json_ref_chain, lark_chain, regex_nested)

JSON_LARK = r"""
?start: value
?value: object | array | string | SIGNED_NUMBER | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
"""
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\(] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""


@pytest.mark.parametrize("make", [lark_chain, gbnf_chain])
def test_a_rule_chain_is_as_deep_as_it_is_long(make):
    assert grammar_depth(make(10)) == 12          # start/root, r0 .. r10
    assert grammar_depth(make(20_000)) == 20_002  # far past Python's recursion limit


def test_a_cycle_counts_all_its_rules_once():
    cycle = lark_chain(50).replace('r50: "x"', 'r50: "x" r0?')
    assert grammar_depth(cycle) == 52
    assert grammar_depth('start: a\na: "x" b?\nb: "y" a?') == 3


def test_many_rules_side_by_side_are_shallow():
    rules = "\n".join(f'r{i}: "x"' for i in range(5000))
    assert grammar_depth("start: " + " | ".join(f"r{i}" for i in range(5000)) + "\n" + rules) == 2


def test_brackets_weigh_on_their_rule():
    assert grammar_depth('start: ("a" ("b" ["c" r]))\nr: "x"') == 5     # 1 + 3 levels, + r
    assert grammar_depth('start: "a" | "b"') == 1


def test_strings_comments_and_regexes_do_not_nest_or_refer():
    text = ('start: "((((" /[(]{3}r/ "r" x // ((( r\nx: "x"\nr: "r"\n')
    assert grammar_depth(text) == 2


def test_lark_priorities_prefixes_and_templates_are_definitions():
    assert grammar_depth('start: a\n?a.2: "x" b\n!b: _sep{c, ","}\n'
                         '_sep{x, sep}: x (sep x)*\nc: "c"') == 6


def test_embedded_json_schemas_count():
    deep = json_ref_chain(30)
    assert grammar_depth(f'start: "a" r\nr: %json {deep}') >= 31
    assert grammar_depth('start: %json {"type": "string", "x": "}}}}"}') == 2


def test_real_grammars_are_shallow():
    assert grammar_depth(JSON_LARK) <= 12
    assert grammar_depth(JSON_GBNF) <= 16      # character classes are no brackets


def test_json_text_depth_skips_strings():
    assert json_text_depth('{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_text_depth('"plain"') == 0


def test_json_schema_depth_follows_refs():
    assert json_schema_depth(json_ref_chain(10)) == 13       # root, $defs, 11 definitions
    assert json_schema_depth(json_ref_chain(5000)) == 5003   # and no recursion of our own
    assert json_schema_depth(json_items_chain(100)) == 203


def test_json_schema_depth_of_text_too_deep_to_parse_is_its_text_depth():
    assert json_schema_depth(json_nested_arrays(50_000)) == 50_001
    assert json_schema_depth("{" * 20 + "not json") == 20


def test_a_recursive_schema_is_shallow():
    tree = {"type": "object", "properties": {"children": {"type": "array",
                                                          "items": {"$ref": "#"}}}}
    assert json_schema_depth(json.dumps(tree)) == 4


def test_refs_by_escaped_pointer_and_by_anchor_resolve():
    by_pointer = {"$defs": {"a/b": {"$ref": "#/$defs/c~0d"},
                            "c~d": {"items": {"$ref": "#/$defs/e%20f"}},
                            "e f": {"type": "string"}}, "$ref": "#/$defs/a~1b"}
    # root, $defs, a/b, c~d, its items, e f
    assert json_schema_depth(json.dumps(by_pointer)) == 6
    by_anchor = {"$defs": {"a": {"$anchor": "A", "$ref": "#B"},
                           "b": {"$anchor": "B", "$ref": "#C"},
                           "c": {"$anchor": "C", "type": "string"}}, "$ref": "#A"}
    assert json_schema_depth(json.dumps(by_anchor)) == 5      # root, $defs, a, b, c


def test_pointers_resolve_within_the_nearest_id():
    inner = json.loads(json_items_chain(300))
    inner["$id"] = "urn:inner"
    schema = {"$defs": {"inner": inner}, "$ref": "urn:inner"}
    assert json_schema_depth(json.dumps(schema)) > 600


# Spellings of a reference to a definition of the root schema, and whether llguidance 1.9.1
# resolves each (checked below against the library itself).
REF_SPELLINGS = {
    "#/$defs/{}": True, "json-schema:///#/$defs/{}": True, "JSON-SCHEMA:///#/$defs/{}": True,
    "json-schema:///./#/$defs/{}": True, "/#/$defs/{}": True, "./#/$defs/{}": True,
    ".#/$defs/{}": True, "a/..#/$defs/{}": True, "json-schema:///x/../#/$defs/{}": True,
    "JSON-schema:///%2e/#/$defs/{}": True, "json-schema:///#/%24defs/{}": True,
    "json-schema:/#/$defs/{}": False, "json-schema://#/$defs/{}": False, "?#/$defs/{}": False,
    "//#/$defs/{}": False, "json-schema:////#/$defs/{}": False,
    "json-schema://localhost/#/$defs/{}": False,
}


@pytest.mark.parametrize("ref", sorted(REF_SPELLINGS))
def test_refs_resolve_as_the_compiler_resolves_them(ref):
    """Issue 23: a 1,200-deep chain written with "json-schema:///#/$defs/N" was measured 3
    deep (an unknown document) and accepted; llguidance follows it and overflows its stack."""
    small = json_items_chain(3, ref)
    assert (llguidance.LLMatcher.validate_grammar(
        llguidance.grammar_from("json_schema", small)) == "") == REF_SPELLINGS[ref]
    if REF_SPELLINGS[ref]:
        assert json_schema_depth(json_items_chain(1200, ref)) == 2403


def test_a_ref_resolves_against_the_nearest_id():
    schema = json.loads(json_items_chain(300, "http://example.com/s#/$defs/{}"))
    schema["$id"] = "http://example.com/s"
    assert json_schema_depth(json.dumps(schema)) == 603
    relative = json.loads(json_items_chain(300, "s#/$defs/{}"))
    relative["$id"] = "http://Example.com/dir/s"
    assert json_schema_depth(json.dumps(relative)) == 603


def test_an_unresolved_ref_points_at_every_anchor():
    schema = {"$defs": {"a": {"$id": "urn:a", "items": {"$ref": "urn:elsewhere"}}},
              "$ref": "urn:a"}
    assert json_schema_depth(json.dumps(schema)) > 3       # a -> items -> a ...: a cycle


def test_regex_depth_counts_groups_and_classes_not_escapes():
    assert regex_depth("a(b(c|[d]))") == 3
    assert regex_depth("[(]") == 2                       # brackets in a class count too
    assert regex_depth(r"\(\(\(a\)\)\)") == 0
    assert regex_depth(regex_nested(20_000)) == 20_000


def test_a_lark_definition_is_named_by_the_first_name_of_its_line():
    chain = lark_chain(30).replace('r7: "x" r8?', 'r7.-5: "x" r8?').replace(
        'r9: "x"', 'r9[max_tokens=3]: "x"')
    assert grammar_depth(chain) == 33      # r9's `[` weighs on r8: over, never under
