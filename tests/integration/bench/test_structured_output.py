"""The structured-output benchmarks' own code on tiny settings: the tiny model (random weights)
for the throughput comparison, its tokenizer for the mask timing and the feature matrix."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import grammar_masks, structured_output

pytestmark = pytest.mark.slow


def test_structured_output_bench_runs_every_mode(tiny_models, tmp_path, capsys):
    results = tmp_path / "results.md"
    structured_output.main(["--model", tiny_models("llama"), "--num-requests", "3",
                            "--max-tokens", "6", "--rounds", "2",
                            "--results-file", str(results)])
    text = capsys.readouterr().out
    for mode in structured_output.MODES:
        assert re.search(rf"- {mode}: [0-9.]+ / [0-9.]+ / [0-9.]+ tok/s", text), text
        sizes = re.search(rf"steady-state diff, {mode}: median ([0-9.]+) / max (\d+)", text)
        assert sizes and int(sizes.group(2)) < 100, text
    assert text.strip() in results.read_text()


def test_grammar_masks_bench_times_every_trace(tiny_models):
    lines = grammar_masks.run(Path(tiny_models("llama")), rounds=1)
    assert any(re.search(r"llguidance [0-9.]+: mask per token \(median\) [0-9.]+", x)
               for x in lines), lines
    verdicts = {x.split(": llguidance")[0]: x for x in lines if x.startswith("accepts")}
    assert len(verdicts) == len(grammar_masks.FEATURES)
    assert "llguidance: yes" in verdicts["accepts schema: pattern"]
    assert "llguidance: yes" not in verdicts["accepts regex: look-ahead"]
