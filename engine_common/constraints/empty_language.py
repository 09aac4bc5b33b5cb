"""Constraints that can never produce anything (reference cycles that reach no text), and
grammar rules that only join copies of themselves (self_concatenating_rule).

llguidance (1.9.1) validates `{"$ref": "#"}`, `{"$defs": {"a": {"$ref": "#/$defs/a"}}, ...}`,
`{"anyOf": [{"$ref": "#"}]}` or the Lark grammar `start: a`, `a: a` without complaint, and the
worker's matcher then fails at the first mask ("NoExtensionBias"); where such a schema sits
under a property (`{"properties": {"a": {"$ref": "#/properties/a"}}}`) the request fails in the
middle of its output, after `{"a":`. Admission refuses them instead, naming the reference or
rule, by the classic test for productive symbols: a schema or rule is productive when it has
text of its own or refers to productive ones (a choice needs one productive branch, a sequence
or an `allOf` all its parts), found by a least fixpoint without recursion.
"""
from __future__ import annotations

import json

from engine_common.constraints.constraint_depth import _containers, _RefTargets
from engine_common.constraints.grammar_repeats import _bare, grammar_definitions
from engine_common.runtime.graph_components import strongly_connected

# Keywords that constrain no text themselves: a schema holding only these (and `$ref` or
# combinators) is what it refers to.
_ANNOTATIONS = frozenset((
    "$anchor", "$defs", "definitions", "$schema", "$id", "id", "$comment", "title",
    "description", "default", "readOnly", "writeOnly", "examples", "contentMediaType",
    "contentEncoding", "$dynamicAnchor", "deprecated", "x-guidance"))
_LINKS = ("$ref", "allOf", "anyOf", "oneOf")


def unproductive_ref(text: str) -> str | None:
    """The `$ref` of a schema that only refers, through references and combinators, back to
    itself (None when every one reaches a schema with text; text that is not JSON: None)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, (dict, list)):
        return None
    nodes, _, bases = _containers(doc)
    targets = _RefTargets(nodes, bases)
    index_of = targets.index_of
    pending: dict[int, tuple] = {}     # node -> (ref target or None, allOf parts, anyOf parts)
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or not isinstance(node.get("$ref"), str) and not any(
                isinstance(node.get(k), list) for k in _LINKS[1:]):
            continue
        if any(k not in _ANNOTATIONS and k not in _LINKS and not k.startswith("x-")
               for k in node):
            continue                    # it has text of its own (a type, properties, ...)
        ref = targets(i)[0] if isinstance(node.get("$ref"), str) else None
        parts = {k: [index_of.get(id(p)) for p in node[k] if isinstance(p, (dict, list))]
                 for k in _LINKS[1:] if isinstance(node.get(k), list)}
        pending[i] = (ref if ref is not None and ref < len(nodes) else None,   # unresolved:
                                                                              # the library says
                      parts.get("allOf", []),
                      parts.get("anyOf", []) + parts.get("oneOf", []),
                      any(isinstance(node.get(k), list) and not node[k] for k in _LINKS[1:]))
    users: dict[int, list[int]] = {}
    for i, (ref, all_of, any_of, _) in pending.items():
        for target in [ref, *all_of, *any_of]:
            if target in pending:
                users.setdefault(target, []).append(i)
    work = list(pending)
    while work:                         # a worklist: each node is re-checked when a part grounds
        i = work.pop()
        if i not in pending:
            continue
        ref, all_of, any_of, _ = pending[i]
        if (ref not in pending and all(p not in pending for p in all_of)
                and (not any_of or any(p not in pending for p in any_of))):
            del pending[i]
            work.extend(users.get(i, ()))
    for i, (_, _, _, empty_list) in pending.items():
        if not empty_list:              # `anyOf: []`: the library's own message says it
            return nodes[i].get("$ref") or json.dumps(nodes[i])[:100]
    return None


def unproductive_rule(text: str) -> str | None:
    """A rule of a Lark or GBNF grammar, reachable from `start`, that can never end (every
    alternative needs itself or another such rule); None when there is none."""
    bodies = grammar_definitions(text)
    if not bodies:
        return None
    refs = {name: {_bare(v) for k, v in body if k == "name"} & bodies.keys()
            for name, body in bodies.items()}
    users: dict[str, list[str]] = {}
    for name, targets in refs.items():
        for target in targets:
            users.setdefault(target, []).append(name)
    productive: set[str] = set()
    work = list(bodies)
    while work:
        name = work.pop()
        if name not in productive and _produces(bodies[name], bodies, productive):
            productive.add(name)
            work.extend(users.get(name, ()))
    reachable, todo = set(), ["start"] if "start" in bodies else list(bodies)
    while todo:
        name = todo.pop()
        if name not in reachable:
            reachable.add(name)
            todo.extend(refs[name])
    stuck = sorted(reachable - productive)
    return stuck[0] if stuck else None


def _produces(body: list, bodies: dict, productive: set[str]) -> bool:
    """Whether the body can end given the rules known productive: a sequence needs all its
    items, a choice one branch; `?`, `*`, `[...]` and counts from 0 need nothing."""
    frames = [[[], True, None]]          # per group: [finished branches, this branch, last item]
    for kind, value in body:
        frame = frames[-1]
        if kind == "name":
            name = _bare(value)
            item = name in productive or name not in bodies
        elif kind in ("string", "regex", "ext", "json"):
            item = True
        elif kind == "open":
            frames.append([[], True, None, value == "["])
            continue
        elif kind == "close" and len(frames) > 1:
            done = frames.pop()
            item = any(done[0] + [done[1]]) or done[3]
            frame = frames[-1]
        elif kind == "alt":
            frame[0].append(frame[1])
            frame[1], frame[2] = True, None
            continue
        elif (kind == "other" and value in "*?" or kind in ("tilde_count", "brace_count")
              and _from_zero(value)):
            if frame[2] is not None:             # the last item may be left out
                frame[1], frame[2] = frame[2][0], None
            continue
        else:
            continue
        frame[2] = (frame[1], item)              # the branch before it, and the item
        frame[1] = frame[1] and item
    while len(frames) > 1:
        done = frames.pop()
        frames[-1][1] = frames[-1][1] and (any(done[0] + [done[1]]) or done[3])
    return any(frames[0][0] + [frames[0][1]])


def _from_zero(count: str) -> bool:
    digits = count.strip("~{} \t").replace("..", ",").split(",")[0].strip()
    return digits in ("", "0")


def self_concatenating_rule(text: str) -> str | None:
    """A rule with an alternative that only joins rules of its own cycle (`a: "a" | a a`,
    `s: s s s`, `a: b b` with `b: a | "x"`): every split of a run is a parse, and llguidance's
    Earley rows grow with the output until its 2,000-item limit. `start: a`, `a: "a" | a a` cost
    98 ms a mask at the median and 1.36 s at the worst over 250 masks on SmolLM2's vocabulary
    (Intel Xeon, Sapphire Rapids) before the request failed ("Current row has 2003 items"); the
    same language written `a: "a"+` costs nothing. Separated recursion (`expr: expr "+" expr`,
    0.02 ms a mask) passes."""
    bodies = grammar_definitions(text)
    if not bodies:
        return None
    refs = {name: [_bare(v) for k, v in body if k == "name"] for name, body in bodies.items()}
    component_of = {name: c for c, members in enumerate(strongly_connected(bodies, refs))
                    for name in members}
    for name, body in bodies.items():
        for alternative in _alternatives(body):
            names = [_bare(v) for k, v in alternative if k == "name"]
            copies = len(names) + sum(_low(v) - 1 for k, v in alternative
                                      if k in ("tilde_count", "brace_count") and _low(v) > 1)
            if (copies >= 2 and all(k in _JOINING and (k != "other" or v in "*+?")
                                    for k, v in alternative)
                    and all(component_of.get(n) == component_of[name] for n in names)):
                return name
    return None


# What an alternative made only of rule references may hold besides them.
_JOINING = ("name", "tilde_count", "brace_count", "other", "open", "close", "alt")


def _alternatives(body: list) -> list[list]:
    """The body's top-level alternatives (a group's `|` does not split)."""
    out, current, level = [], [], 0
    for kind, value in body:
        if kind == "alt" and level == 0:
            out.append(current)
            current = []
            continue
        level += {"open": 1, "close": -1}.get(kind, 0)
        current.append((kind, value))
    return out + [current]


def _low(count: str) -> int:
    digits = count.strip("~{} \t").replace("..", ",").split(",")[0].strip()
    return int(digits) if digits.isdigit() else 0
