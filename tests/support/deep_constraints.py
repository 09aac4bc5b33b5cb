"""Constraints nested `n` deep in the shapes that overflowed llguidance 1.9.1's stack (SIGSEGV)
at n of about 2,000 to 2,700 on an 8 MiB stack, all under --max-constraint-chars' 65,536 at
n = 3,000 (docs/security.md). Built as text, without recursion."""
from __future__ import annotations


def lark_chain(n: int) -> str:
    """start: r0, r0: "x" r1?, ... r{n}: "x" (depth n + 2; 51,803 characters at 3,000)."""
    rules = [f'r{i}: "x" r{i + 1}?' for i in range(n)] + [f'r{n}: "x"']
    return "start: r0\n" + "\n".join(rules)


def gbnf_chain(n: int) -> str:
    """The same chain in GBNF (root ::= r0, r0 ::= "x" r1? ...)."""
    rules = [f'r{i} ::= "x" r{i + 1}?' for i in range(n)] + [f'r{n} ::= "x"']
    return "root ::= r0\n" + "\n".join(rules)


def json_ref_chain(n: int) -> str:
    """Definitions each an alias of the next ({"$ref": "#/$defs/<i+1>"}), the last a string."""
    defs = ",".join(f'"{i}":{{"$ref":"#/$defs/{i + 1}"}}' for i in range(n))
    return '{"$defs":{' + defs + f',"{n}":{{"type":"string"}}}},"$ref":"#/$defs/0"}}'


def json_items_chain(n: int, ref: str = "#/$defs/{}") -> str:
    """Definitions each an array of the next (depth 2n + 2; crashed at n = 1,024: 39,000
    characters); `ref` spells the reference to definition {} (issue 23 wrote
    "json-schema:///#/$defs/{}" and got past the depth check)."""
    defs = ",".join(f'"{i}":{{"items":{{"$ref":"{ref.format(i + 1)}"}}}}' for i in range(n))
    return '{"$defs":{' + defs + f',"{n}":{{"type":"string"}}}},"$ref":"{ref.format(0)}"}}'


def json_nested_arrays(n: int) -> str:
    """An array of arrays ... n deep (text nesting 2n + 1 with the strings' objects)."""
    return '{"type":"array","items":' * n + '{"type":"string"}' + "}" * n


def regex_nested(n: int) -> str:
    return "(" * n + "a" + ")" * n
