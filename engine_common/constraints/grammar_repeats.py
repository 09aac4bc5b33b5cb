"""How far the counted repetitions of a grammar's lexemes expand them (regex_size.py's measure).

In a Lark grammar every terminal becomes one lexer regex on the worker, as does every `/regex/`
or string in a rule. llguidance (1.9.1) writes them out there, not at validation, as it does a
`regex` constraint's: `start: /a{1000000}/` passed admission and cost the compile thread 0.52 s
and 96 MB; a terminal made of terminals multiplies their counts (`A: B{1000}`, `B: "x"{1000}`:
1.25 s, then the request's first mask failed, "lexer error: too many expressions constructed").
`grammar_repeats` sizes, per terminal, its body written out (a name stands for its terminal's
whole size, `{n,m}` and `~ n..m` multiply what they follow) less its text's (a name one atom,
counts taken once), every `/regex/` alone, and the schemas of `%json { ... }` as a json_schema
constraint's (schema_repeats.py). A GBNF grammar is sized as the Lark that llguidance converts
it to. Counts in rules repeat lexemes in the parser, not within one lexeme: a rule is sized by
the text it forces instead (grammar_forced.py).
"""
from __future__ import annotations

import re

from llguidance.gbnf_to_lark import any_to_lark

from engine_common.constraints.constraint_depth import _json_value_end
from engine_common.constraints.grammar_forced import forced_runs
from engine_common.constraints.regex_size import RepeatSizer, regex_sizes
from engine_common.constraints.schema_repeats import schema_repeats
from engine_common.runtime.graph_components import strongly_connected

# One lexical item of a Lark grammar, as llguidance's Lark lexer reads it (a regex may span
# lines, `#` is no comment); one left open runs to the end (the engine refuses the grammar).
_TOKENS = re.compile(r'''
      (?P<newline>\n)
    | (?P<skip>//[^\n]*|[ \t\r\f\v]+)
    | (?P<json>%json\b)
    | (?P<ext>%(?:regex|llguidance)\b)
    | (?P<directive>%[A-Za-z_]+)
    | (?P<string>"(?:\\.|[^"\\])*(?:"|\Z)i?)
    | (?P<regex>/(?:\\.|[^/\\])+(?:/[imslux]*|\Z))
    | (?P<tilde_count>~\s*[0-9]+(?:\s*\.\.\s*[0-9]+)?)
    | (?P<brace_count>\{\s*[0-9]*\s*(?:,\s*[0-9]*\s*)?\})
    | (?P<name>[!?]?[A-Za-z_][A-Za-z0-9_]*(?:\.[0-9]+)?)
    | (?P<define>:)
    | (?P<open>[(\[])
    | (?P<close>[)\]])
    | (?P<alt>\|)
    | (?P<other>.)
''', re.VERBOSE | re.DOTALL)
_REGEX_BODY = re.compile(r"/(.*)/[imslux]*\Z|/(.*)\Z", re.DOTALL)
_DIGITS = re.compile(r"[0-9]+")


def grammar_repeats(text: str) -> list[tuple[str, int]]:
    """(where, atoms added) for every lexeme, then every rule, of a Lark or GBNF grammar that
    adds some: `in terminal NAME`, `in regex '/.../'` (written out), `in rule name (the text it
    forces)` (grammar_forced.py), or a `%json` schema's finding."""
    try:
        text = any_to_lark(text)
    except Exception:            # the library's own conversion fails the same way: refused
        return []
    bodies, found = _scan(text)
    terminals = {name: body for name, body in bodies.items() if _is_terminal(name)}
    sizes = _definition_sizes(terminals)
    for name, (full, plain) in sizes.items():
        if full > plain:
            found.append((f"in terminal {name}", full - plain))
    runs = forced_runs(bodies, lambda token: regex_sizes(_regex_body(token)))
    for name, body in bodies.items():
        if name not in terminals:
            added = runs[name] - _body_size(body, sizes)[1]
            if added > 0:
                found.append((f"in rule {name} (the text it forces)", added))
    return found


def grammar_definitions(text: str) -> dict[str, list] | None:
    """Definition name -> its body's tokens, for a Lark or GBNF grammar (None when it does not
    convert to Lark: the library refuses it the same way)."""
    try:
        return _scan(any_to_lark(text))[0]
    except Exception:
        return None


def _scan(text: str) -> tuple[dict[str, list], list[tuple[str, int]]]:
    """(definition name -> its body's tokens, findings of regexes and %json schemas)."""
    tokens = _tokens(text)
    bodies: dict[str, list] = {}
    found: list[tuple[str, int]] = []
    current: list | None = None      # the body of the definition being read, if any
    level, line_start, skip = 0, True, 0
    for i, (kind, value) in enumerate(tokens):
        if skip:
            skip -= 1
            continue
        if kind == "newline":
            line_start = level == 0
            continue
        if line_start and kind == "name" and i + 1 < len(tokens) and tokens[i + 1][0] == "define":
            current = bodies.setdefault(_bare(value), [])
            line_start, skip = False, 1
            continue
        if line_start and kind == "directive":
            current = None           # %ignore, %import: their items are sized alone below
        line_start = False
        level = max(level + {"open": 1, "close": -1}.get(kind, 0), 0)
        if kind == "regex":
            full, plain = regex_sizes(_regex_body(value))
            if full > plain:
                found.append((f"in regex {value[:100]!r}", full - plain))
        elif kind == "json":
            found.extend(schema_repeats(value))
        if current is not None:
            current.append((kind, value))
    return bodies, found


def _tokens(text: str) -> list[tuple[str, str]]:
    """The grammar's tokens but spaces and comments; a `%json` token carries its schema's
    text, a `%regex` / `%llguidance` token its JSON (skipped)."""
    out, pos = [], 0
    while pos < len(text):
        m = _TOKENS.match(text, pos)
        kind, pos = m.lastgroup, m.end()
        if kind == "skip":
            continue
        if kind in ("json", "ext"):
            start = len(text) - len(text[pos:].lstrip())
            if text.startswith("{", start):
                end = _json_value_end(text, start)
                out.append((kind, text[start:end]))
                pos = end
                continue
        out.append((kind, m.group()))
    return out


def _definition_sizes(bodies: dict[str, list]) -> dict[str, tuple[int, int]]:
    """(size written out, size as written: counts taken once, a name one atom) per terminal.
    Written out, a name stands for its terminal's whole size: a terminal used twice in another
    doubles it as `{2}` would (`T0: T1 T1`, ... 20 deep: a{2**20}, 2.1 s of the compile
    thread, then a failed first mask). Sized in dependency order without recursion (a chain
    may be 1,000 deep); within a cycle (the engine refuses one) a name weighs 1."""
    refs = {name: [_bare(v) for k, v in body if k == "name"] for name, body in bodies.items()}
    sizes: dict[str, tuple[int, int]] = {}
    for component in strongly_connected(bodies, refs):     # each after those it reaches
        sizes.update((name, (1, 1)) for name in component)
        sizes.update([(name, _body_size(bodies[name], sizes)) for name in component])
    return sizes


def _body_size(body: list, sizes: dict[str, tuple[int, int]]) -> tuple[int, int]:
    sizer = RepeatSizer()
    for kind, value in body:
        if kind == "string":
            n = max(len(value.rstrip("i")) - 2, 1)    # its characters, escapes over-counted
            sizer.atom(n, n)
        elif kind == "regex":
            sizer.atom(*regex_sizes(_regex_body(value)))
        elif kind == "name":          # written out: inlined whole; in the text: one name
            sizer.atom(sizes.get(_bare(value), (1, 1))[0], 1)
        elif kind in ("ext", "json"):
            sizer.atom()
        elif kind == "open":
            sizer.open()
        elif kind == "close":
            sizer.close()
        elif kind == "alt":
            sizer.alt()
        elif kind in ("tilde_count", "brace_count"):
            sizer.count(_times(value))
    return sizer.total()


def _times(count: str) -> int:
    """How many times a count repeats at most: `~ n`, `~ n..m`, `{n}`, `{n,m}`, `{n,}`
    (n + 1, as regex_size counts it), `{,m}`."""
    numbers = [int(d) for d in _DIGITS.findall(count)]
    if not numbers:
        return 1
    if count.startswith("{") and "," in count and count.rstrip("} \t").endswith(","):
        return numbers[0] + 1
    return numbers[-1]


def _regex_body(token: str) -> str:
    m = _REGEX_BODY.match(token)
    return (m.group(1) if m.group(1) is not None else m.group(2)) if m else token


def _bare(name: str) -> str:
    """A Lark name without its `!` / `?` prefix and `.priority` suffix."""
    return name.lstrip("!?").split(".", 1)[0]


def _is_terminal(name: str) -> bool:
    """Lark's convention: terminals are upper-case (`_` prefixes allowed), rules lower-case."""
    stripped = name.lstrip("_")
    return bool(stripped) and stripped[0].isupper()
