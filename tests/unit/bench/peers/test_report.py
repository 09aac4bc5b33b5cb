"""bench/peers/report.py: ratios per round, token agreement, the table."""
from __future__ import annotations

from bench.peers.report import (Comparison, EngineRuns, agreement, format_block, format_lines,
                                spread, table_rows)


def runs(name, walls, ids):
    return EngineRuns(name, f"{name} engine", 1.0, list(walls), [ids] * len(walls))


def test_spread_and_agreement():
    assert spread([3.0, 1.0, 2.0]) == (1.0, 2.0, 3.0)
    assert agreement([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == (2, None)
    same, first = agreement([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]])
    assert same == 1 and first == "request 1 at output position 1 of 3"


def test_ratios_pair_the_rounds_and_lines_say_so():
    ids = [[1, 2, 3], [4, 5, 6]]       # 6 tokens per run
    peer, ours = runs("vLLM", [2.0, 3.0, 1.0], ids), runs("DeltaServe", [1.0, 1.0, 1.0], ids)
    c = Comparison("w, float32, 1 thread", "w: words", peer, [ours], None)
    assert c.ratios(ours) == [2.0, 3.0, 1.0]
    text = "\n".join(format_lines(c))
    assert "DeltaServe / vLLM: 2.00x median (min 1.00x, max 3.00x)" in text
    assert "greedy tokens, DeltaServe vs vLLM: 2/2 requests identical" in text
    assert table_rows(c) == ["| w, float32, 1 thread | 3.0 | 6.0 | 1.00 / 2.00 / 3.00 | 2/2 | - |"]
    block = format_block([c], "cmd", "abc123", "cpu")
    assert "- commit: `abc123`" in block and "| w, float32, 1 thread |" in block


def test_rounds_that_disagree_are_flagged():
    r = EngineRuns("DeltaServe", "", 0.0, [1.0, 1.0], [[[1]], [[2]]])
    assert not r.self_consistent()
    c = Comparison("t", "w", None, [r], None)
    assert any("WARNING" in line for line in format_lines(c))
