"""How deeply a structured-output constraint nests, measured without recursion.

llguidance compiles grammars and JSON schemas recursively: the Lark compiler descends from a rule
into every rule it refers to (skipping those already compiled), the JSON Schema compiler into
every subschema and `$ref` target it has not seen. A chain of 2,700 rules, or of 2,000 to 2,500
schemas, overflows an 8 MiB thread stack and kills the process (SIGSEGV), far under the
--max-constraint-chars limit. `constraint_depth` bounds that recursion from above, so a
constraint nested deeper than MAX_CONSTRAINT_DEPTH (engine_common/request/diff_limits.py) is refused
before llguidance sees it (docs/security.md gives the measurements).

The depth is the longest path through a graph whose cycles are counted whole: a path may run
through a strongly connected component (rules or schemas that reach each other) once, paying
the weight of all its members, which bounds any depth-first walk that never revisits a node.

    grammar      nodes: rules and terminals; edges: the names a definition's body refers to
                 (and its `%json` schemas); weight: 1 + the bracket nesting of the body
    json_schema  nodes: every JSON object and array; edges: to the ones it contains, and from
                 an object with `$ref` (`$dynamicRef`, `$recursiveRef`) to its target, resolved
                 as the compiler resolves it (uri_refs.py: `json-schema:///#/$defs/a` is
                 `#/$defs/a`; issue 23 found a 1,200-deep chain written so accepted)
    regex        the nesting of ( and [ (the library refuses deep regexes itself; this bounds it)
    choice, json_object: 1 (the grammars made of them are flat)
"""
from __future__ import annotations

import json
import re
from urllib.parse import unquote

from llguidance.gbnf_to_lark import is_lark_syntax

from engine_common.runtime.graph_components import strongly_connected
from engine_common.constraints.uri_refs import DEFAULT_BASE, DocumentUri, resolve

# -- grammars (Lark, or GBNF as llama.cpp writes it) ----------------------------------------------

# One lexical item of a grammar; the groups are tried in order. Strings, regexes, GBNF character
# classes and comments are opaque (their brackets do not nest grammar items); as in llguidance's
# Lark lexer, a regex may span lines and `#` is no comment. One left open runs to the end (the
# engine refuses the grammar; scanning on from every quote would take quadratic time).
_LARK_TOKENS = re.compile(r'''
      (?P<skip>//[^\n]*|\s+)
    | (?P<json>%(?:json|llguidance|regex)\b)
    | (?P<opaque>"(?:\\.|[^"\\])*(?:"|\Z)|/(?:\\.|[^/\\])+(?:/[imslux]*|\Z))
    | (?P<define>::=|:)
    | (?P<name>[!?]?[A-Za-z0-9_][A-Za-z0-9_\-]*(?:\.[0-9]+)?)
    | (?P<open>[(\[{])
    | (?P<close>[)\]}])
    | (?P<other>.)
''', re.VERBOSE | re.DOTALL)
_GBNF_TOKENS = re.compile(r'''
      (?P<skip>\#[^\n]*|\s+)
    | (?P<opaque>"(?:\\.|[^"\\])*(?:"|\Z)|\[(?:\\.|[^\]\\])*(?:\]|\Z))
    | (?P<define>::=)
    | (?P<name>[A-Za-z0-9_][A-Za-z0-9_\-]*)
    | (?P<open>[({])
    | (?P<close>[)}])
    | (?P<other>.)
''', re.VERBOSE | re.DOTALL)


class _Grammar:
    """Definitions as they are scanned: per name its weight and the names its body refers to."""

    def __init__(self):
        self.weight: dict[str, int] = {}
        self.refs: dict[str, list[str]] = {}
        self.current = ""               # the definition being read ("" before the first)
        self.level = 0                  # bracket nesting at this point of the body
        self.pending = ""               # the last name read, maybe the next definition's
        self.head = ""                  # Lark: the first name of this line, not yet defined

    def define(self, name: str) -> None:
        self.current = _bare(name)
        self.weight.setdefault(self.current, 1)
        self.refs.setdefault(self.current, [])
        self.level, self.pending = 0, ""

    def refer(self, name: str) -> None:
        if self.pending:
            self.refs.setdefault(self.current, []).append(self.pending)
        self.pending = _bare(name)

    def nest(self, extra: int) -> None:
        self.weight[self.current] = max(self.weight.get(self.current, 1), 1 + self.level + extra)


def _bare(name: str) -> str:
    """A Lark name without its `!` / `?` prefix and `.priority` suffix."""
    return name.lstrip("!?").split(".", 1)[0]


def grammar_depth(text: str) -> int:
    """The nesting of a Lark or GBNF grammar, as llguidance's grammar_from tells them apart."""
    lark = is_lark_syntax(text)
    pattern = _LARK_TOKENS if lark else _GBNF_TOKENS
    g = _Grammar()
    pos, line_start = 0, True
    while pos < len(text):
        m = pattern.match(text, pos)
        pos = m.end()
        kind = m.lastgroup
        if kind == "name":
            g.refer(m.group())
            if line_start and lark:
                g.head = g.pending
        elif kind == "define":
            # Lark: `?name{params}.priority:` starts a line; GBNF: the name before `::=`.
            head, g.head = g.head or g.pending, ""
            if head:
                g.define(head)
        elif kind == "open":
            g.level += 1
            g.nest(0)
        elif kind == "close":
            g.level = max(0, g.level - 1)
        elif kind == "json":
            pos, depth = _embedded_json_depth(text, pos)
            g.nest(depth)
        if kind != "skip":
            line_start = False
        elif "\n" in m.group() and g.level == 0:
            line_start = True
    g.refer("")
    return _longest_path(g.weight, g.refs)


def _embedded_json_depth(text: str, pos: int) -> tuple[int, int]:
    """(where it ends, its depth) for the JSON value after `%json` at `pos` in a Lark grammar
    (an object; anything else is left to the grammar's scan)."""
    start = len(text) - len(text[pos:].lstrip())
    if not text.startswith("{", start):
        return pos, 0
    end = _json_value_end(text, start)
    return end, json_schema_depth(text[start:end])


def _json_value_end(text: str, start: int) -> int:
    """Where the balanced {...} value at `start` ends (the text's end if it does not)."""
    level, pos = 0, start
    for m in _JSON_SCAN.finditer(text, start):
        token, pos = m.group(), m.end()
        if token in "{[":
            level += 1
        elif token in "}]":
            level -= 1
            if level == 0:
                return pos
    return len(text)


# -- JSON schemas ---------------------------------------------------------------------------------

_JSON_SCAN = re.compile(r'"(?:\\.|[^"\\])*(?:"|\Z)|[{}\[\]]')   # an open string: to the end
_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
_ANCHOR_KEYS = ("$anchor", "$dynamicAnchor", "$id")


def json_text_depth(text: str) -> int:
    """How deeply the JSON text's objects and arrays nest (strings skipped; no parsing)."""
    return _bracket_depth(_JSON_SCAN, text, "{[", "}]")


def _bracket_depth(scan: re.Pattern, text: str, opens: str, closes: str) -> int:
    """The deepest nesting of `opens`/`closes` tokens among what `scan` finds (a surplus
    closer counts as none)."""
    level = deepest = 0
    for m in scan.finditer(text):
        token = m.group()
        if token in opens:
            level += 1
            deepest = max(deepest, level)
        elif token in closes:
            level = max(0, level - 1)
    return deepest


def json_schema_depth(text: str, text_limit: int = 1000) -> int:
    """The nesting of a JSON schema following its $refs; its text nesting alone when that
    exceeds `text_limit` (parsing it would exhaust Python's recursion) or it is not JSON."""
    depth = json_text_depth(text)
    if depth > text_limit:
        return depth
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return depth
    if not isinstance(doc, (dict, list)):   # `true`, `false`, a number: nothing nests
        return depth
    nodes, children, bases = _containers(doc)
    targets = _RefTargets(nodes, bases)
    hub = len(nodes)                # what an unresolved reference may mean: every anchor
    weight = {i: 1 for i in range(len(nodes))}
    weight[hub] = 0
    refs = {i: children[i] + targets(i) for i in range(len(nodes))}
    refs[hub] = sorted(set(targets.anchors.values()))
    return max(depth, _longest_path(weight, refs))


def _containers(doc) -> tuple[list, list[list[int]], list[DocumentUri]]:
    """Every object and array of `doc` (root first); per one, the indices of its children and
    its base URI: that of the nearest object, itself included, that declares an `$id` (resolved
    against its parent's base), else the compiler's default (uri_refs.DEFAULT_BASE)."""
    nodes, children, bases = [], [], []
    stack = [(doc, -1)]
    while stack:
        node, parent = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        index = len(nodes)
        nodes.append(node)
        children.append([])
        base = bases[parent] if parent >= 0 else DEFAULT_BASE
        if parent >= 0:
            children[parent].append(index)
        if isinstance(node, dict) and isinstance(node.get("$id"), str):
            base = resolve(base, node["$id"])[0]
        bases.append(base)
        stack.extend((v, index) for v in (node.values() if isinstance(node, dict) else node))
    return nodes, children, bases


class _RefTargets:
    """node index -> the indices of the containers its $ref keywords may point at, resolved as
    the compiler resolves them (uri_refs.py): the document a reference names is the root or an
    object with that `$id`; its fragment a JSON pointer from there, or an `$anchor` name.
    Anything else goes to the hub (every anchor): an over-estimate where the document does not
    say, never an under-estimate."""

    def __init__(self, nodes: list, bases: list[DocumentUri]):
        self.nodes, self.bases = nodes, bases
        self.index_of = {id(node): i for i, node in enumerate(nodes)}
        self.documents = {bases[0]: 0}
        self.anchors: dict[str, int] = {}
        for i, node in enumerate(nodes):
            if not isinstance(node, dict):
                continue
            if isinstance(node.get("$id"), str):
                self.documents.setdefault(bases[i], i)
            for key in _ANCHOR_KEYS:
                if isinstance(node.get(key), str):
                    self.anchors[node[key]] = i
                    self.anchors[node[key].rsplit("#", 1)[-1]] = i

    def __call__(self, index: int) -> list[int]:
        node = self.nodes[index]
        if not isinstance(node, dict):
            return []
        return [self._resolve(node[key], self.bases[index]) for key in _REF_KEYS
                if isinstance(node.get(key), str)]

    def _resolve(self, ref: str, base: DocumentUri) -> int:
        document, fragment = resolve(base, ref)
        hub = len(self.nodes)
        start = self.documents.get(document)
        if start is None:
            return hub
        if fragment and not fragment.startswith("/"):
            return self.anchors.get(fragment, hub)
        found = _pointer(self.nodes[start], fragment or "")
        return self.index_of.get(id(found), hub)


def _pointer(doc, fragment: str):
    """The value at a JSON pointer (RFC 6901, percent-encoded as in a URI fragment); None when
    nothing is there."""
    node = doc
    for part in unquote(fragment).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# -- regular expressions --------------------------------------------------------------------------

_REGEX_SCAN = re.compile(r"\\.|[(\[]|[)\]]", re.DOTALL)


def regex_depth(text: str) -> int:
    """How deeply groups and character classes nest (escaped characters skipped)."""
    return _bracket_depth(_REGEX_SCAN, text, "([", ")]")


# -- the longest weighted path --------------------------------------------------------------------

def _longest_path(weight: dict, refs: dict) -> int:
    """The heaviest path through the graph (edges to unknown nodes ignored), each strongly
    connected component counted once with the weight of all its members."""
    components = strongly_connected(weight, refs)
    component_of = {node: c for c, members in enumerate(components) for node in members}
    best = [0] * len(components)
    # Tarjan's algorithm emits a component after every component it reaches.
    for c, members in enumerate(components):
        below = 0
        for node in members:
            for target in refs.get(node, ()):
                d = component_of.get(target)
                if d is not None and d != c:
                    below = max(below, best[d])
        best[c] = sum(weight[n] for n in members) + below
    return max(best, default=0)
