from engine_common.runtime.graph_components import strongly_connected


def test_cycles_are_one_component_and_come_after_what_they_reach():
    edges = {"a": ["b"], "b": ["c", "a"], "c": ["d"], "d": [], "e": ["a"]}
    comps = strongly_connected("abcde", edges)
    assert sorted(map(sorted, comps)) == [["a", "b"], ["c"], ["d"], ["e"]]
    where = {n: i for i, c in enumerate(comps) for n in c}
    assert where["d"] < where["c"] < where["a"] < where["e"]   # reachable ones first


def test_targets_outside_the_nodes_are_ignored():
    assert strongly_connected(["x"], {"x": ["x-missing", "x"]}) == [["x"]]


def test_a_chain_far_deeper_than_pythons_recursion_limit():
    n = 100_000
    edges = {i: [i + 1] for i in range(n - 1)}
    edges[n - 1] = [0]                                   # one cycle through every node
    comps = strongly_connected(range(n), edges)
    assert len(comps) == 1 and len(comps[0]) == n
