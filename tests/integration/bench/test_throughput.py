"""The offline benchmark end to end on CPU: tiny preset, a handful of short sequences, with the
transformers comparison; plus the pieces whose numbers the report is built from."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from bench import throughput
from bench.presets import PRESETS, SPEC_FILE, UnknownPreset, preset_dir
from bench.workload import make_workload
from engine_common.request.params import ParamError
from tests.support.paths import REPO

ARGS = ["--preset", "tiny", "--device", "cpu", "--num-seqs", "4", "--min-len", "4",
        "--max-len", "12", "--vs-transformers", "--hf-batch-sizes", "1,4", "--warmup"]


def _figure(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text}"
    return float(match.group(1))


def test_bench_main_prints_positive_figures_and_appends_block(tmp_path, capsys, bench_presets):
    results = tmp_path / "results.md"
    argv = ARGS + ["--cache-dir", str(bench_presets), "--results-file", str(results)]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    workload = make_workload(4, 4, 12, _vocab_size(bench_presets / "tiny"), 0)
    assert _figure(r"output tokens: (\d+)", out) == workload.num_output_tokens
    for pattern in (r"wall time: ([\d.e+-]+) s", r"output throughput: ([\d.e+-]+) tok/s",
                    r"([\d.e+-]+) ms per decode step", r"\+ KV\), ([\d.e+-]+) GB/s",
                    r"= ([\d.e+-]+) of measured copy bandwidth",
                    r"copy bandwidth ([\d.e+-]+) GB/s",
                    r"transformers generate\(\): best batch \d+: ([\d.e+-]+) tok/s",
                    r"ours / transformers: ([\d.e+-]+)x"):
        assert _figure(pattern, out) > 0, pattern
    assert _figure(r"decode steps: (\d+) of", out) >= max(workload.output_lens) - 1
    assert _figure(r"other steps: (\d+) steps with prefill", out) >= 1
    assert _figure(r"outside steps: ([\d.e+-]+) s of the wall time", out) >= 0
    assert re.search(r"^triton compiles in the timed run: .+$", out, re.M), out
    text = results.read_text()
    assert text.startswith("# Benchmark results")
    assert re.search(r"^## .* · tiny · cpu \(.+\)$", text, re.M)
    assert "- command: `python -m bench.throughput --preset tiny" in text
    assert re.search(r"- commit: `[0-9a-f]{4,}(\+modified)?`|- commit: `unknown`", text)
    assert "- ours / transformers: " in text
    # A second run appends a second block under the same title.
    assert throughput.main([a for a in argv if a != "--vs-transformers"]) == 0
    text = results.read_text()
    assert text.count("# Benchmark results") == 1 and text.count("\n## ") == 2


def _vocab_size(model_dir) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return config["vocab_size"]


def test_preset_is_cached_and_rebuilt_when_its_spec_changes(tmp_path):
    first = preset_dir("tiny", tmp_path)
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert preset_dir("tiny", tmp_path) == first and weights.stat().st_mtime_ns == mtime
    (first / SPEC_FILE).write_text(json.dumps({"name": "tiny", "stale": True}))
    preset_dir("tiny", tmp_path)
    assert json.loads((first / SPEC_FILE).read_text())["name"] == "tiny"
    assert "stale" not in json.loads((first / SPEC_FILE).read_text())


def test_real_shape_presets_declare_the_checkpoint_shapes():
    qwen, llama = PRESETS["qwen3-0.6b"].config, PRESETS["llama-3.2-1b"].config
    assert (qwen["hidden_size"], qwen["num_hidden_layers"], qwen["num_key_value_heads"],
            qwen["head_dim"], qwen["vocab_size"]) == (1024, 28, 8, 128, 151936)
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["num_attention_heads"],
            llama["head_dim"], llama["vocab_size"]) == (2048, 16, 32, 64, 128256)
    assert llama["rope_parameters"]["rope_type"] == "llama3"


def test_unknown_preset_and_bad_lengths_are_errors(tmp_path):
    with pytest.raises(UnknownPreset, match="qwen3-0.6b"):
        preset_dir("gpt-17", tmp_path)
    with pytest.raises(ParamError, match="max_len"):
        make_workload(4, 10, 5, 100)
    with pytest.raises(ParamError, match="num_seqs"):
        make_workload(0, 1, 5, 100)


def test_workload_is_seeded_and_within_bounds():
    a, b = make_workload(16, 3, 9, 50, seed=1), make_workload(16, 3, 9, 50, seed=1)
    assert a == b and a != make_workload(16, 3, 9, 50, seed=2)
    assert all(3 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in a.prompts)
    assert all(3 <= n <= 9 for n in a.output_lens)


def test_flags_mount_on_a_subcommand_and_import_without_torch():
    parser = argparse.ArgumentParser(prog="deltaserve")
    sub = parser.add_subparsers(dest="command", required=True)
    throughput.build_parser(sub.add_parser("bench"))
    args = parser.parse_args(["bench", "--preset", "tiny", "--num-seqs", "3", "--warmup"])
    assert (args.command, args.preset, args.num_seqs, args.warmup) == ("bench", "tiny", 3, True)
    code = "import sys, bench.throughput; sys.exit('torch' in sys.modules)"
    repo_root = REPO
    assert subprocess.run([sys.executable, "-c", code], cwd=repo_root).returncode == 0


def test_step_timer_counts_decode_steps_and_context_lengths(bench_presets):
    from bench.step_timer import StepTimer
    from deltaserve.llm import LLM
    from engine_common.request.params import StoppingParams

    llm = LLM(str(preset_dir("tiny", bench_presets)), device="cpu", max_model_len=64,
              num_kv_blocks=16)
    stop = StoppingParams(max_tokens=4, ignore_eos=True)
    with StepTimer(llm.engine) as timer:
        llm.generate([[5, 6, 7, 8, 9], [1, 2, 3]], None, stop)
    assert "step" not in vars(llm.engine) and "schedule" not in vars(llm.engine.scheduler)
    prefill, *decodes = timer.records
    assert (prefill.num_tokens, prefill.is_decode) == (8, False)
    # After the prefill samples token 1, three decode steps feed tokens 1..3 back.
    assert [r.kv_tokens for r in decodes] == [6 + 4, 7 + 5, 8 + 6]
    summary = timer.summary()
    assert (summary.num_decode_steps, summary.mean_decode_batch) == (3, 2.0)
    assert summary.decode_kv_tokens == 10 + 12 + 14 and summary.mean_decode_step_s > 0
    assert (summary.other_tokens, summary.other_seconds) == (8, prefill.seconds)
    assert summary.slowest_other == ((prefill.seconds, 8, 2),)
    assert summary.step_seconds == sum(r.seconds for r in timer.records)


def test_bench_with_async_scheduling_says_so_and_generates_every_token(tmp_path, capsys,
                                                                      bench_presets):
    argv = ["--preset", "tiny", "--device", "cpu", "--num-seqs", "4", "--min-len", "4",
            "--max-len", "12", "--async-scheduling", "--cache-dir", str(bench_presets),
            "--results-file", str(tmp_path / "results.md")]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    workload = make_workload(4, 4, 12, _vocab_size(bench_presets / "tiny"), 0)
    assert re.search(r"^engine: .*, async scheduling,", out, re.M), out
    assert _figure(r"output tokens: (\d+)", out) == workload.num_output_tokens
    assert _figure(r"([\d.e+-]+) ms per decode step", out) > 0
