"""How long a JSON schema is with its `$ref`s written out, for schemas with rigid whitespace.

With whitespace between JSON tokens flexible (the default) every token boundary is a choice,
so the text llguidance forces at once is one lexeme at most. With llguidance's
`"x-guidance": {"whitespace_flexible": false}` (or a `whitespace_pattern`) the output's layout
is fixed, and a schema that reuses a large definition forces all of it: 1,000 required
properties each `{"$ref": "#/$defs/a"}` with `a` a 1,000-character `const` (33,000 characters
of schema) cost 0.41 s of every mask, 1,000 such `prefixItems` 0.63 s (Intel Xeon, Sapphire
Rapids; the library computes the forced text on each mask, about 0.7 us a byte); with flexible
whitespace the same schema took 0.3 ms. `written_out_growth` bounds that text from above: the
document's characters with every `$ref` replaced by its target, a cycle of references counted
once, less the document's own.
"""
from __future__ import annotations

import json

from engine_common.constraints.constraint_depth import _RefTargets
from engine_common.runtime.graph_components import strongly_connected

_CAP = 1 << 62


def rigid_whitespace(nodes: list) -> bool:
    """Whether any `x-guidance` in the document fixes the whitespace between tokens."""
    for node in nodes:
        options = node.get("x-guidance") if isinstance(node, dict) else None
        if isinstance(options, dict) and (options.get("whitespace_flexible") is False
                                          or "whitespace_pattern" in options):
            return True
    return False


def written_out_growth(nodes: list, children: list[list[int]], bases: list) -> int:
    """The characters the document's `$ref`s add once each is written out in place (its
    containers' own keys and scalars counted; nested references multiply)."""
    targets = _RefTargets(nodes, bases)
    edges = {i: children[i] + [t for t in targets(i) if t < len(nodes)]
             for i in range(len(nodes))}
    own = [_own_size(node) for node in nodes]
    whole: dict[int, int] = {}
    member_of: dict[int, int] = {}
    for c, members in enumerate(strongly_connected(range(len(nodes)), edges)):
        member_of.update((m, c) for m in members)
        size = sum(own[m] for m in members)
        for m in members:
            for t in edges[m]:
                if member_of.get(t, c) != c:          # an edge leaving the cycle
                    size = min(size + whole[member_of[t]], _CAP)
        whole[c] = size
    plain = sum(own)
    return max(0, max(whole.values(), default=0) - plain)


def _own_size(node) -> int:
    """The characters of a container's own keys and scalar values (not its containers)."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    size = 2
    for key, value in items:
        size += len(key) + 3 if isinstance(key, str) else 1
        if not isinstance(value, (dict, list)):
            size += len(json.dumps(value, ensure_ascii=False))
    return size
