"""How far the regexes of a JSON schema expand on the worker (regex_size.py's measure).

Three sources, all written out by llguidance (1.9.1) on the worker, not at validation:

- every `pattern`, `patternProperties` key and llguidance's `x-guidance.whitespace_pattern`
  (the regex between JSON tokens: `a{1000000}` failed the mask of the first token after `{"a":`)
  **anywhere in the document**, not only under the keywords that hold subschemas: a `$ref` may
  point anywhere (`{"$ref": "#/x-stash/s", "x-stash": {"s": {"pattern": "^a{1000000}$"}}}` was
  admitted, then cost the compile thread 0.39 s and failed the request's first mask);
- a `pattern` with a `minLength`: the string's lexer is the intersection of the pattern with
  `.{minLength,}`, which the library builds out whole when the pattern is "positive" (it skips
  its own emptiness check): `^a+$` with minLength 4,000 failed the first mask ("too many
  expressions constructed"), 3,000 cost 6.5 ms a mask. It is sized as the pattern written out
  times minLength. A pattern and a minLength meet when their schemas merge: the same schema,
  the parts of its `allOf` / `anyOf` / `oneOf`, and `$ref` targets (the merge is over-estimated
  as a union of those links, never under-estimated);
- with rigid whitespace (`x-guidance`), `$ref`s written out: the text they force
  (schema_written_out.py).

`format`s are the library's fixed regexes; with a large minLength its own emptiness check
refuses them ("email" at 3,000), and maxLength was cheap in every case measured (`^a+$` with
maxLength 1,000,000: 2 ms).
"""
from __future__ import annotations

import json
import math

from engine_common.constraints.constraint_depth import _containers, _RefTargets
from engine_common.constraints.regex_size import regex_sizes
from engine_common.constraints.schema_written_out import rigid_whitespace, written_out_growth

_CAP = 1 << 62
_COMBINED = ("allOf", "anyOf", "oneOf")


def schema_repeats(text: str) -> list[tuple[str, int]]:
    """(where, atoms added) for every regex of the schema text whose counts (or minLength)
    add atoms; [] for text that is not a JSON schema document (the library says why)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if not isinstance(doc, (dict, list)):
        return []
    nodes, children, bases = _containers(doc)
    found = []
    if rigid_whitespace(nodes):
        growth = written_out_growth(nodes, children, bases)
        if growth:
            found.append(("in $refs written out (rigid whitespace forces them)", growth))
    merged = _merged_groups(nodes, bases)
    longest: dict[int, int] = {}
    for i, node in enumerate(nodes):
        length = _min_length(node)
        if length:
            group = merged(i)
            longest[group] = max(longest.get(group, 0), length)
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            continue
        keys = node.get("patternProperties")
        patterns = [k for k in keys if isinstance(k, str)] if isinstance(keys, dict) else []
        options = node.get("x-guidance")
        if isinstance(options, dict) and isinstance(options.get("whitespace_pattern"), str):
            patterns.append(options["whitespace_pattern"])
        for pattern in patterns:
            full, plain = regex_sizes(pattern)
            if full > plain:
                found.append((f"in pattern {_short(pattern)!r}", full - plain))
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            full, plain = regex_sizes(pattern)
            length = longest.get(merged(i), 0)
            if full * length > full - plain:
                found.append((f"in pattern {_short(pattern)!r} with minLength {length}",
                              min(full * length, _CAP)))
            elif full > plain:
                found.append((f"in pattern {_short(pattern)!r}", full - plain))
    return found


def _merged_groups(nodes: list, bases: list):
    """node index -> its group's representative: schemas linked by a combinator part or a
    `$ref` (union-find, iterative)."""
    parent = list(range(len(nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    targets = _RefTargets(nodes, bases)
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            continue
        linked = [targets.index_of.get(id(part)) for key in _COMBINED
                  if isinstance(node.get(key), list) for part in node[key]]
        linked += [t for t in targets(i) if t < len(nodes)]     # not the unresolved hub
        for j in linked:
            if j is not None:
                parent[find(j)] = find(i)
    return find


def _min_length(node) -> int:
    value = node.get("minLength") if isinstance(node, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return _CAP if value > 0 else 0
    return max(0, min(int(value), _CAP))


def _short(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
