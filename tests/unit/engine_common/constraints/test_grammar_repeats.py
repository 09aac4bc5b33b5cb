"""A grammar's lexemes are bounded as a `regex` is (Constraint.validate: INVALID_ARGUMENT naming
the terminal or regex and the bound): llguidance writes a terminal out on the worker, so
`start: /a{1000000}/`, a terminal of counted terminals (`A: B{1000}`, `B: "x"{1000}`) or one of
terminals used twice, 20 deep (a{2**20}), used to pass admission and cost the compile thread
0.5 to 2 s before the request's first mask failed. GBNF is sized as its Lark conversion, and a
`%json` schema as a json_schema constraint. A rule is sized by the text it can force (the parser
computes it on every mask: `/a{1000}/ ~ 1000` cost 0.65 s a mask), counts over choices adding
little; ordinary grammars pass."""
from __future__ import annotations

import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.constraints.grammar_repeats import grammar_repeats
from engine_common.request.diff_limits import MAX_REGEX_REPEAT_SIZE
from engine_common.request.params import ParamError


def _worst(grammar: str) -> tuple[str, int]:
    return max(grammar_repeats(grammar), key=lambda found: found[1], default=("", 0))


@pytest.mark.parametrize("grammar, where, added", [
    ("start: /a{1000000}/", "in regex '/a{1000000}/'", 999_999),
    ("start: A\nA: /(a{1000}){1000}/i", "in regex '/(a{1000}){1000}/i'", 999_999),
    ('start: A\nA: B{1000}\nB: C{1000}\nC: "x"', "in terminal A", 999_999),
    ('start: A\nA: B~1000\nB: "x" ~ 1000', "in terminal A", 999_999),
    ('start: A\nA: B ~ 10..1000\nB: ("x" | "yz") ~ 1000', "in terminal A", 3_000_000 - 1),
    ('start: A\nA: B{5,}\nB: "xy"{2,3}', "in terminal A", 6 * 6 - 1),   # {5,}: 6 times
    ('start: x\n%ignore /[ ]{100000}/\nx: "a"', "in regex '/[ ]{100000}/'", 99_999),
    ('start: %json {"type": "string", "pattern": "^a{1000000}$"}',
     "in pattern '^a{1000000}$'", 999_999),
    ('root ::= x\nx ::= "ab"{3,7} y{1000}\ny ::= "ab"{1000}', "in terminal X",
     14 + 2000 * 1000 - 3),                       # GBNF: `x`, `y` become terminals X, Y
])
def test_lexemes_are_sized_written_out(grammar, where, added):
    assert _worst(grammar) == (where, added)


def test_a_terminal_used_twice_doubles_as_a_count_would():
    chain = "start: T0\n" + "\n".join(f"T{i}: T{i + 1} T{i + 1}" for i in range(20))
    assert ("in terminal T0", 2 ** 20 - 2) in grammar_repeats(chain + '\nT20: "a"')


@pytest.mark.parametrize("grammar, added", [
    ("start: /a{1000}/ ~ 1000", 1000 * 1000 - 1),          # 0.65 s a mask
    ("start: item ~ 1000\nitem: /a{1000}/", 1000 * 1000 - 1),
    ('start: (/[a]{1000}/ "b") ~ 1000', 1001 * 1000 - 2),
    ("start: " + " ".join(["A"] * 1000) + "\nA: /a{1000}/", 1000 * 1000 - 1000),
    ("start: /(a|a){100}/{3000} /b?/", 600_000 - 2),     # one text; its two branches count
    ('start: /(?i)1{1000}/ ~ 500 "22"i ~ 500', 1000 * 500 + 2 * 500 - 3),   # no case to fold
])
def test_a_rule_is_sized_by_the_text_it_forces(grammar, added):
    """The parser computes forced text on every mask: a rule repeating one fixed text."""
    assert _worst(grammar) == ("in rule start (the text it forces)", added)


@pytest.mark.parametrize("grammar", [
    'start: a\na: b{1000}\nb: c{1000}\nc: "x" | "y"',
    "start: /[a-z]{1000}/ ~ 1000",                      # under a millisecond a mask
    "start: /a{1000}/+",
    'start: item{1,1000}\nitem: WORD ","\nWORD: /[a-z]+/',
    "start: /a{100}/ ~ 99",
])
def test_repeats_over_choices_force_little(grammar):
    assert _worst(grammar)[1] < MAX_REGEX_REPEAT_SIZE
    Constraint("grammar", grammar).validate()


@pytest.mark.parametrize("grammar, where", [
    ("start: /a{1000000}/", "in regex '/a{1000000}/'"),
    ('start: A\nA: B{1000}\nB: C{1000}\nC: "x"', "in terminal A"),
    ('start: "<" N ">"\nN: D{200}\nD: /[0-9]{2}/ ~ 100', "in terminal N"),
    ('start: %json {"type": "string", "pattern": "^a{1000000}$"}',
     "in pattern '^a{1000000}$'"),
    ('start: item ~ 1000\nitem: A "," A\nA: /a{100}/', "in rule start (the text it forces)"),
    ("root ::= [a-z]+ x\nx ::= y{500}\ny ::= \"ab\"{500}", "in terminal X"),
])
def test_admission_refuses_a_grammar_whose_lexeme_expands_too_far(grammar, where):
    with pytest.raises(ParamError) as e:
        Constraint("grammar", grammar).validate()
    assert e.value.field == "constraint.grammar"
    assert f"add at most {MAX_REGEX_REPEAT_SIZE} atoms to it (they add " in str(e.value)
    assert f" {where} once written out" in str(e.value)


def test_ordinary_grammars_pass():
    for grammar in (
        'start: UUID\nUUID: HEX{8} "-" HEX{4} "-" HEX{4} "-" HEX{4} "-" HEX{12}\nHEX: /[0-9a-f]/',
        "start: DATE\nDATE: /[0-9]{4}-[0-9]{2}-[0-9]{2}/",
        'start: "(" NUM ("," NUM){0,99} ")"\nNUM: /[0-9]{1,6}/',
        'root ::= "[" item ("," item){0,9} "]"\nitem ::= [0-9]{1,3}',
        'start: %json {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"}',
        "start: T0\n" + "\n".join(f"T{i}: T{i + 1} T{i + 1}" for i in range(12)) + '\nT12: "a"',
    ):
        Constraint("grammar", grammar).validate()
