"""Structured-output constraints: what a request's output must match, validated at admission.

A `Constraint` is one of five kinds, named as in vLLM's gRPC protocol (the `constraint` oneof of
its SamplingParams), so a gateway maps them 1:1:

    json_schema  a JSON Schema (text)           -> JSON that validates against it; an object
                 schema without `additionalProperties` allows no other properties (strict, as
                 xgrammar and so vLLM's default backend treat it): give the keyword to allow them
    json_object  True                           -> any JSON object
    regex        a regular expression (Rust regex syntax) -> text that fully matches it
    grammar      a Lark grammar, or GBNF / EBNF as llama.cpp writes it -> a sentence of it
    choice       a tuple of strings             -> exactly one of them

The grammar engine is llguidance (Rust core, no torch): `to_grammar()` turns a constraint into
its grammar definition, `validate()` checks it with the library and raises ParamError carrying the
library's message, so a bad schema, regex or grammar is refused once, at admission, never
mid-stream. Validations are cached (the last 1024 distinct constraints). The worker compiles the
same grammar text against its tokenizer (worker_service/sample/grammar.py).

llguidance compiles recursively and a deep enough constraint overflows the stack (SIGSEGV, the
whole process): `check_depth()` refuses one nested deeper than MAX_CONSTRAINT_DEPTH first
(measured without recursion: constraint_depth.py), and the library runs on a 64 MiB stack
(big_stack.py). docs/security.md has the measurements.

On the wire (the new-request part of the step diff) a constraint is [kind, value], value being
the text, the bool, or the list of choices.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property, lru_cache

import llguidance

from engine_common.runtime.big_stack import call_with_big_stack
from engine_common.constraints.constraint_depth import grammar_depth, json_schema_depth, regex_depth
from engine_common.constraints.empty_language import (self_concatenating_rule, unproductive_ref,
                                                      unproductive_rule)
from engine_common.constraints.grammar_repeats import grammar_repeats
from engine_common.constraints.regex_size import regex_repeated_atoms
from engine_common.constraints.schema_repeats import schema_repeats
from engine_common.request.diff_limits import (MAX_CONSTRAINT_CHOICES, MAX_CONSTRAINT_DEPTH,
                                               MAX_REGEX_REPEAT_SIZE)
from engine_common.request.params import ParamError

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# The grammar of `json_object`: any JSON object, as vLLM builds it.
_ANY_OBJECT = '{"type": "object"}'
_MAX_CACHED_VALIDATIONS = 1024
_WHAT = {"json_schema": "a JSON Schema", "json_object": "true", "regex": "a regular expression",
         "grammar": "a Lark or GBNF grammar", "choice": "a list of choices"}
# What constraint_depth counts, per kind, for the refusal's message.
_DEPTH = {"json_schema": (json_schema_depth, "subschemas within subschemas, following $ref"),
          "regex": (regex_depth, "groups within groups"),
          "grammar": (grammar_depth, "rules referring to rules, with their bracket nesting")}


@dataclass(frozen=True)
class Constraint:
    """One structured-output constraint; `value` is a str (json_schema, regex, grammar), True
    (json_object) or a tuple of strings (choice)."""

    kind: str
    value: str | bool | tuple[str, ...]     # json_schema: also a dict, kept as its JSON text

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ParamError("constraint", self.kind, f"one of {', '.join(KINDS)}")
        if self.kind == "json_schema" and isinstance(self.value, dict):
            # A schema as a dict (pydantic's model_json_schema()), as vLLM takes it.
            object.__setattr__(self, "value", json.dumps(self.value, ensure_ascii=False))
        if self.kind == "choice":
            if isinstance(self.value, str):   # tuple("yes") meant "y", "e" or "s"
                raise ParamError(f"{self.field}.choices", self.value,
                                 "a list of strings (one choice alone: a list of one)")
            object.__setattr__(self, "value", tuple(self.value))
        _check_value(self.kind, self.value)

    @property
    def field(self) -> str:
        """The API field that holds it, for error messages: e.g. `constraint.regex`."""
        return f"constraint.{self.kind}"

    @property
    def key(self) -> str:
        """A stable hash of kind and value (compiled grammars and validations cache by it)."""
        text = json.dumps([self.kind, self.to_wire()[1]], ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def num_chars(self) -> int:
        """Its size as --max-constraint-chars counts it: the text's characters, or the choices'
        together (json_object: 0)."""
        if self.kind == "json_object":
            return 0
        return len(self.value) if self.kind != "choice" else sum(len(c) for c in self.value)

    def to_grammar(self) -> str:
        """The llguidance grammar definition (its JSON text) of this constraint."""
        if self.kind == "json_object":
            return llguidance.grammar_from("json_schema", _ANY_OBJECT)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", list(self.value))
        if self.kind == "json_schema":
            return llguidance.grammar_from("json_schema", _strict_schema(self.value))
        return llguidance.grammar_from(self.kind, self.value)

    @cached_property
    def depth(self) -> int:
        """How deeply it nests, as MAX_CONSTRAINT_DEPTH bounds it (choice, json_object: 1)."""
        if self.kind not in _DEPTH:
            return 1
        return _DEPTH[self.kind][0](self.value)

    def check_depth(self) -> "Constraint":
        """Raise ParamError if it nests deeper than MAX_CONSTRAINT_DEPTH (the grammar engine
        would overflow its stack compiling it)."""
        depth = self.depth
        if depth > MAX_CONSTRAINT_DEPTH:
            raise ParamError(self.field, f"nested {depth} deep",
                             f"nested at most {MAX_CONSTRAINT_DEPTH} deep "
                             f"({_DEPTH[self.kind][1]})")
        return self

    def check_repeats(self) -> "Constraint":
        """Raise ParamError if the counted repetitions of a regex in it (a `regex`, a schema's
        `pattern`, a grammar's terminal or `/regex/`), or the text a grammar's rule forces, add
        more than MAX_REGEX_REPEAT_SIZE atoms once written out: the library validates them
        symbolically and the worker pays for them (regex_size.py, schema_repeats.py,
        grammar_repeats.py). Cached as validations are (a 64 KB grammar scans in 0.35 s)."""
        where, added = _worst_repeat(self)
        if added > MAX_REGEX_REPEAT_SIZE:
            raise ParamError(self.field, _short(self.value),
                             f"a regex whose counted repetitions add at most "
                             f"{MAX_REGEX_REPEAT_SIZE} atoms to it (they add {added} "
                             f"{where + ' ' if where else ''}once written out: nested "
                             f"counts multiply)")
        return self

    def check_productive(self) -> "Constraint":
        """Raise ParamError if a schema in it only refers to itself, or a grammar rule can
        never end: the library admits them and the worker's matcher fails at the first mask,
        or mid-output where the model walked into such a part (empty_language.py)."""
        stuck = _unproductive(self)
        if stuck is None:
            return self
        if self.kind == "json_schema":
            raise ParamError(self.field, _short(self.value),
                             f"a schema whose references reach a schema: {_short(stuck, 100)!r} "
                             f"refers only back to itself (through $ref, allOf, anyOf, oneOf)")
        raise ParamError(self.field, _short(self.value),
                         f"a grammar whose rules can all end: rule {stuck!r} can only expand "
                         f"into itself or other such rules")

    def check_ambiguity(self) -> "Constraint":
        """Raise ParamError if a grammar rule has an alternative that only joins rules of its
        own cycle (`a: "a" | a a`): every split is a parse, and the parser's work per mask grows
        with the output (up to 1.36 s; empty_language.self_concatenating_rule)."""
        rule = _self_concatenating(self)
        if rule is not None:
            raise ParamError(self.field, _short(self.value),
                             f"a grammar whose rules do not only join copies of themselves: "
                             f"rule {rule!r} has an alternative made of its own recursion "
                             f"alone (as `a: a a`), so every split of the output is a parse and "
                             f"the parser's work grows with it; write a repetition (`a: \"a\"+`)")
        return self

    def validate(self) -> "Constraint":
        """Raise ParamError if it nests too deeply, if a regex in it expands too far, with the
        library's message if the grammar is not usable, or if a part of it can never end."""
        self.check_depth()
        self.check_repeats()
        error = _validation_error(self)
        if error:
            raise ParamError(self.field, _short(self.value),
                             f"{_WHAT[self.kind]} the grammar engine accepts; it says: "
                             f"{_short_lines(error.strip())}")
        return self.check_productive().check_ambiguity()

    def to_wire(self) -> list:
        value = list(self.value) if self.kind == "choice" else self.value
        return [self.kind, value]

    @classmethod
    def from_wire(cls, data) -> "Constraint":
        kind, value = data
        return cls(kind, value)


def constraint_from_fields(*, json_schema: str | None = None, json_object: bool = False,
                           regex: str | None = None, grammar: str | None = None,
                           choice=None) -> Constraint | None:
    """The constraint one oneof holds, from its fields as a protobuf adapter reads them (unset:
    None / False); None when none is set. At most one may be set."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex),
                               ("grammar", grammar), ("choice", choice)) if v is not None}
    if json_object:
        given["json_object"] = True
    if len(given) > 1:
        raise ParamError("constraint", " and ".join(given), "at most one kind")
    if not given:
        return None
    (kind, value), = given.items()
    return Constraint(kind, value)


def _check_value(kind: str, value) -> None:
    field = f"constraint.{kind}"
    if kind == "json_object":
        if value is not True:
            raise ParamError(field, value, "true (any JSON object)")
    elif kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise ParamError(f"{field}.choices", list(value), "one or more non-empty strings")
        if len(value) > MAX_CONSTRAINT_CHOICES:
            raise ParamError(f"{field}.choices", f"{len(value)} choices",
                             f"at most {MAX_CONSTRAINT_CHOICES} choices (the grammar engine's "
                             f"work grows with them)")
    elif not isinstance(value, str) or not value:
        raise ParamError(field, value, "a non-empty string")


@lru_cache(maxsize=_MAX_CACHED_VALIDATIONS)
def _validation_error(constraint: Constraint) -> str:
    try:
        return call_with_big_stack(_library_validation, constraint)
    except ValueError as e:          # e.g. a GBNF grammar that does not convert to Lark
        return str(e)


@lru_cache(maxsize=_MAX_CACHED_VALIDATIONS)
def _worst_repeat(constraint: Constraint) -> tuple[str, int]:
    """(where, atoms added) of the first regex or rule of `constraint` over the bound (lexemes
    come before the rules that force them), else of the one adding the most ("" where the
    constraint is the regex; ("", 0) for choices and json_object)."""
    if constraint.kind == "regex":
        found = [("", regex_repeated_atoms(constraint.value))]
    elif constraint.kind == "json_schema":
        found = schema_repeats(constraint.value)
    elif constraint.kind == "grammar":
        found = grammar_repeats(constraint.value)
    else:
        found = []
    over = [f for f in found if f[1] > MAX_REGEX_REPEAT_SIZE]
    return over[0] if over else max(found, key=lambda f: f[1], default=("", 0))


@lru_cache(maxsize=_MAX_CACHED_VALIDATIONS)
def _unproductive(constraint: Constraint) -> str | None:
    if constraint.kind == "json_schema":
        return unproductive_ref(constraint.value)
    if constraint.kind == "grammar":
        return unproductive_rule(constraint.value)
    return None


@lru_cache(maxsize=_MAX_CACHED_VALIDATIONS)
def _self_concatenating(constraint: Constraint) -> str | None:
    return self_concatenating_rule(constraint.value) if constraint.kind == "grammar" else None


def _library_validation(constraint: Constraint) -> str:
    return llguidance.LLMatcher.validate_grammar(constraint.to_grammar())


# Schema keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties",
              "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def _strict_schema(text: str) -> str:
    """The schema with `additionalProperties: false` on every object schema that lists
    properties and does not say otherwise; text that is not JSON is left for the validator."""
    try:
        schema = json.loads(text)
        open_refs: set[str] = set()
        _walk(schema, lambda node: open_refs.update(_open_parts_refs(node)))
        _close_objects(schema, open_refs)
        return json.dumps(schema, ensure_ascii=False)
    except (ValueError, RecursionError):   # too deep for Python: the engine refuses it too
        return text


_COMBINATORS = ("allOf", "anyOf", "oneOf")


def _lists_properties(schema) -> bool:
    return isinstance(schema, dict) and ("properties" in schema or "patternProperties" in schema)


def _open_parts(schema: dict) -> list:
    """The parts of `schema` that must stay open: they combine with the schema's own
    properties or with each other into one object (a `$ref` beside other keywords is such a
    part too)."""
    own = _lists_properties(schema)
    all_of, others = [], []
    for key in _COMBINATORS:
        if isinstance(schema.get(key), list):
            (all_of if key == "allOf" else others).extend(schema[key])
    if own:
        ref = [{"$ref": schema["$ref"]}] if isinstance(schema.get("$ref"), str) else []
        return all_of + others + ref
    # No properties of its own: an allOf part alone (pydantic's wrapper of a $ref) is whole.
    return all_of + others if len(all_of) > 1 or all_of and others else []


def _open_parts_refs(node) -> list[str]:
    """The local references ("#/$defs/Base") of `node`'s open parts: their targets stay open."""
    if not isinstance(node, dict):
        return []
    return [p["$ref"] for p in _open_parts(node)
            if isinstance(p, dict) and isinstance(p.get("$ref"), str)]


def _walk(schema, visit) -> None:
    visit(schema)
    for _, sub in _subschemas(schema):
        _walk(sub, visit)


def _subschemas(schema):
    """(JSON pointer step, subschema) for every subschema `schema` holds."""
    if not isinstance(schema, dict):
        return
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), list):   # draft 4's tuple `items`
            yield from ((f"{key}/{i}", sub) for i, sub in enumerate(schema[key]))
        elif key in schema:
            yield key, schema[key]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            yield from ((f"{key}/{i}", sub) for i, sub in enumerate(schema[key]))
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            yield from ((f"{key}/{str(name).replace('~', '~0').replace('/', '~1')}", sub)
                        for name, sub in schema[key].items())


def _close_objects(schema, open_refs: set[str], close: bool = True,
                   pointer: str = "#") -> None:
    """Close `schema` (unless `close` is False) and every object schema within it. Where an
    object's properties are spread over combined schemas, closing a part would forbid the
    others' properties (llguidance then refuses the schema as unsatisfiable, or leaves only
    the properties every part lists): an `allOf` part, an `anyOf` / `oneOf` part beside
    properties of the schema's own, a `$ref` beside them, and the definitions such parts refer
    to (`open_refs`) stay open, and so does a schema whose parts list properties or refer;
    their property schemas are still closed."""
    if not isinstance(schema, dict):
        return
    open_parts = _open_parts(schema)
    parts = open_parts + [p for key in _COMBINATORS
                          if isinstance(schema.get(key), list) for p in schema[key]]
    spread = any(_lists_properties(p) or isinstance(p, dict) and "$ref" in p for p in parts)
    if (close and pointer not in open_refs and _lists_properties(schema) and not spread
            and "additionalProperties" not in schema):
        schema["additionalProperties"] = False
    open_ids = {id(p) for p in open_parts}
    for step, sub in _subschemas(schema):
        _close_objects(sub, open_refs, id(sub) not in open_ids, f"{pointer}/{step}")


def _short_lines(message: str, line_limit: int = 200, limit: int = 4000) -> str:
    """The engine's message with every line cut at `line_limit` characters and the whole at
    `limit`: it quotes the constraint (and a caret line as wide), which would otherwise make a
    status message larger than gRPC's metadata limit (the client then sees RESOURCE_EXHAUSTED)."""
    return _short("\n".join(_short(line, line_limit) for line in message.split("\n")), limit)


def _short(value, limit: int = 200):
    """The value as an error message quotes it: long texts cut at `limit` characters."""
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return list(value) if isinstance(value, tuple) else value
