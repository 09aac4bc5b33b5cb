"""Regexes whose counted repetitions expand too far are refused at admission (Constraint.validate:
INVALID_ARGUMENT naming the field and the bound): llguidance validates `x{n}` symbolically, so
they used to pass and cost the worker's compile thread and lexer (a{1000000}: 0.47 s, ~120 MB,
then a failed first mask). The size is the regex written out: counts multiply what they repeat,
nested ones each other; alternatives add; classes, escapes and group headers weigh 1 or 0."""
from __future__ import annotations

import json

import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.constraints.regex_size import regex_repeat_size, regex_repeated_atoms
from engine_common.request.diff_limits import MAX_REGEX_REPEAT_SIZE
from engine_common.request.params import ParamError


@pytest.mark.parametrize("regex, size", [
    ("[0-9]{3}-[0-9]{4}", 8),
    (r"\d{4}-\d{2}-\d{2}", 10),
    ("a{1000000}", 1_000_000),
    ("(a{1000}){1000}", 1_000_000),
    ("a{1000}{1000}{1000}", 1_000_000_000),
    ("(a|b){5000}{5000}", 50_000_000),
    ("((a){10}){10}{10}", 1000),
    ("[a-z]{1,4000}", 4000),
    ("x{2,}", 3),
    ("(?:ab){5000}", 10_000),            # the group's "?:" is not an atom
    ("(?P<name>ab){3}", 6),
    ("(?i)abc", 3),                      # a flag group repeats nothing
    ("[]a{]{10}", 10),                   # a class is one atom, its braces literal
    ("[[:alpha:][0-9]]{7}", 7),
    (r"\p{Greek}{20}", 20),
    (r"\{5\}", 3),
    ("a{", 2),                           # not a count (the engine refuses it)
    ("(" * 50 + "a{9}" + ")" * 50, 9),
])
def test_the_size_is_the_regex_written_out(regex, size):
    assert regex_repeat_size(regex) == size


def test_sizes_are_clamped_not_computed_without_end():
    assert regex_repeat_size("a" + "{1000000000}" * 500) == 1 << 62


def test_only_what_the_counts_add_is_bounded():
    """A long regex without counts (its length is bounded by --max-constraint-chars) adds
    nothing; counts add their copies."""
    words = "|".join(f"word{i}" for i in range(5000))
    assert regex_repeat_size(words) > 30_000 and regex_repeated_atoms(words) == 0
    assert regex_repeated_atoms("ab{3}") == 2 and regex_repeated_atoms("(ab){3}x") == 4


@pytest.mark.parametrize("regex, added", [
    ("a{1000000}", 999_999), ("(a{1000}){1000}", 999_999),
    ("(a|b){5000}{5000}", 49_999_998), ("[0-9]{10002}", 10_001),
])
def test_admission_refuses_a_regex_that_expands_too_far(regex, added):
    with pytest.raises(ParamError) as e:
        Constraint("regex", regex).validate()
    assert e.value.field == "constraint.regex"
    assert str(e.value) == (
        f"constraint.regex={regex!r} is invalid: must be a regex whose counted repetitions "
        f"add at most {MAX_REGEX_REPEAT_SIZE} atoms to it (they add {added} once written out: "
        "nested counts multiply)")


def test_a_schema_pattern_that_expands_too_far_is_refused_by_name():
    schema = {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "(x{200}){200}"}}}}
    with pytest.raises(ParamError, match=r"add 39999 in pattern '\(x\{200\}\)\{200\}' "):
        Constraint("json_schema", json.dumps(schema)).validate()
    keyed = {"type": "object", "patternProperties": {"^k{20000}$": {"type": "string"}}}
    with pytest.raises(ParamError, match="they add 19999 in pattern"):
        Constraint("json_schema", json.dumps(keyed)).validate()


def test_ordinary_regexes_and_schemas_pass():
    for regex in (r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{12}",
                  ".{0,500}", "(?:ab){5000}", "[0-9]{10001}"):
        Constraint("regex", regex).validate()
    Constraint("json_schema", json.dumps({"type": "string", "pattern": "[A-Z]{2}[0-9]{6}"}
                                         )).validate()
