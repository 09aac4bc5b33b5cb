"""Strongly connected components of a directed graph, without recursion: a graph as deep as a
hostile grammar's rule chain must not exhaust Python's stack. The constraint depth scanner folds
rule cycles with it (engine_common/constraints/constraint_depth.py); the layer test finds import cycles."""
from __future__ import annotations

from collections.abc import Iterable, Mapping


def strongly_connected(nodes: Iterable, edges: Mapping) -> list[list]:
    """Tarjan's algorithm with an explicit stack. `edges[node]` are a node's targets; targets
    that are not among `nodes` are ignored. Each component comes after every component
    reachable from it."""
    order = list(nodes)
    known = set(order)
    index: dict = {}
    low: dict = {}
    on_stack: set = set()
    stack: list = []
    components: list[list] = []
    for root in order:
        if root in index:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next((t for t in targets if t in known), None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(edges.get(target, ()))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                components.append(members)
    return components
