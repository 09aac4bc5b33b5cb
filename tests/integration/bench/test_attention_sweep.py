"""The attention microbenchmark's Triton design modes at tiny sizes: --unified, --mixed and
--sweep print and record what they should; the sweep's order, budget and failure handling; the
mixed batch it builds. On CPU the kernels run under the Triton interpreter."""
from __future__ import annotations

import re

import pytest
import torch

from bench import attention_bandwidth as ab
from bench import attention_sweep as sw
from bench.attention_batch import Session, Shape, make_batch

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = ["--device", DEVICE, "--num-reqs", "2", "--context", "32", "--num-heads", "4",
        "--num-kv-heads", "2", "--head-dim", "16", "--iters", "2", "--warmup", "0"]
FIGURE = r"([\d.]+(?:e[+-]?\d+)?)"
RATIO = rf"^split/unified \(([^)]*)\): {FIGURE} = {FIGURE} ms / {FIGURE} ms: (.*)$"
DECODE_BLOCK_N = sw.default_point(sw.SPLIT).block_n     # the decode kernel's default (128)
NUM_SPLIT_POINTS = 3 * 4 * 3 * 4      # warps x BLOCK_N x stages x (auto, 2, 4, 8): auto is 1
NUM_UNIFIED_POINTS = 3 * 4 * 3 * 3    # warps x BLOCK_N x stages x tile rows


def _main(tmp_path, capsys, *flags: str) -> tuple[str, str]:
    results = tmp_path / "r.md"
    assert ab.main(TINY + list(flags) + ["--results-file", str(results)]) == 0
    return capsys.readouterr().out, results.read_text()


def _check_ratio(out: str, what: str) -> None:
    m = re.search(RATIO, out, re.M)
    assert m and m.group(1) == what, out
    ratio, split_ms, unified_ms = (float(m.group(i)) for i in (2, 3, 4))
    assert ratio == pytest.approx(split_ms / unified_ms, rel=1e-2)   # 3 significant digits
    assert m.group(5) == ("two kernels faster" if ratio < 1 else "one kernel faster"
                          if ratio > 1 else "equal")


def test_unified_times_both_designs_on_the_decode_batch(tmp_path, capsys):
    out, text = _main(tmp_path, capsys, "--unified")
    assert re.search(r"^triton \(block 16, split-KV decode kernel, auto: 1 split\): .*\(ok\)$",
                     out, re.M), out
    assert re.search(r"^triton \(block 16, unified: varlen kernel, 16-row tiles\): .*\(ok\)$",
                     out, re.M), out
    _check_ratio(out, "decode")
    assert "· decode attention · " in text and "\n- split/unified (decode): " in text


def test_mixed_times_two_kernel_dispatch_against_unified(tmp_path, capsys):
    out, text = _main(tmp_path, capsys, "--mixed", "--num-prefills", "1", "--chunk", "8",
                      "--decode-splits", "2")
    assert ("shape: 1 decodes x 32 context + 1 prefill chunks of 8 tokens after 32 cached, "
            "4 query heads, 2 KV heads, head_dim 16, bfloat16") in out
    # KV (32 + 40) positions x 2 heads x 16 x K,V x 2 bytes; Q+O 2 x 9 x 4 x 16 x 2; new K/V 9 x 128
    assert "bytes per call: 0.01267 MB (KV read 0.009216 MB + Q, O and new K/V 0.003456 MB)" in out
    assert re.search(r"^triton \(block 16, two kernels: per-request dispatch, fixed: 2 splits\)"
                     r": .*\(ok\)$", out, re.M), out
    assert re.search(r"^triton \(block 16, unified: varlen kernel, 64-row tiles\): .*\(ok\)$",
                     out, re.M), out
    _check_ratio(out, "mixed")
    assert "· mixed-batch attention · " in text


def test_sweep_limited_to_two_points_prints_table_and_best(tmp_path, capsys):
    out, text = _main(tmp_path, capsys, "--sweep", "--sweep-points", "2")
    assert f"sweep: 2 of {NUM_SPLIT_POINTS} points run in " in out
    assert f"0 failed, {NUM_SPLIT_POINTS - 2} not reached" in out
    rows = re.findall(r"^\| (\d) \| split-KV \| (\d) \| (\d+) \| (\d) \| (\S+(?: \S+)?) \| "
                      rf"{FIGURE} \|", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"], out
    n = str(DECODE_BLOCK_N)
    assert {r[1:5] for r in rows} == {("4", n, "2", "auto (=1)"), ("2", n, "2", "auto (=1)")}
    best = re.search(rf"^sweep best split-KV: num_warps \d, BLOCK_N \d+, num_stages \d, splits "
                     rf"auto \(=1\): {FIGURE} ms, .* default {FIGURE} ms \(best is", out, re.M)
    assert best and float(best.group(1)) <= float(best.group(2)), out
    assert float(best.group(1)) == pytest.approx(min(float(r[5]) for r in rows), rel=1e-3)
    # the results file keeps the table as a table: raw rows after a blank line
    assert "\n\n| rank | design |" in text and "\n| 2 | split-KV |" in text
    assert not re.search(r"^- \|", text, re.M) and "\n- sweep best split-KV: " in text


def test_sweep_with_unified_alternates_designs_and_compares_the_best(tmp_path, capsys):
    out, _ = _main(tmp_path, capsys, "--sweep", "--unified", "--sweep-points", "2")
    total = NUM_SPLIT_POINTS + NUM_UNIFIED_POINTS
    assert f"sweep: 2 of {total} points run in " in out
    assert re.search(rf"^\| \d \| split-KV \| 4 \| {DECODE_BLOCK_N} \| 2 \| auto \(=1\) \|", out,
                     re.M), out
    assert re.search(r"^\| \d \| unified \| 4 \| 64 \| 2 \| 16 rows \|", out, re.M), out
    assert "sweep best unified: num_warps 4, BLOCK_N 64, num_stages 2, tile rows 16: " in out
    _check_ratio(out, "sweep, best of each")


def test_sweep_order_puts_defaults_then_single_changes_first():
    points = sw.sweep_points(True, auto_splits=2)
    assert len(points) == len(set(points)) == NUM_SPLIT_POINTS + NUM_UNIFIED_POINTS
    assert points[:2] == [sw.default_point(sw.SPLIT), sw.default_point(sw.UNIFIED)]
    assert not [p for p in points if p.design == sw.SPLIT and p.variant == 2]   # auto is 2
    changes = [p.changes(sw.default_point(p.design)) for p in points]
    singles = sum(c <= 1 for c in changes)
    assert max(changes[:singles]) == 1 and min(changes[singles:]) == 2
    stages_moved = [p.num_stages != 2 for p in points[singles:]]
    first_moved = stages_moved.index(True)        # then default stages before other stages
    assert all(stages_moved[first_moved:]) and not any(stages_moved[:first_moved])
    assert {p.design for p in points[:4]} == {sw.SPLIT, sw.UNIFIED}


def _session_and_batch():
    shape = Shape(2, 20, 4, 2, 16, "float32")
    session = Session(shape, DEVICE, iters=1, warmup=0, seed=1, copy_bps=1e10)
    return session, session.batch(16)


def test_failed_point_is_reported_and_skipped_and_budget_stops_the_sweep():
    session, batch = _session_and_batch()
    bad = sw.SweepPoint(sw.SPLIT, 3, 64, 2, None)          # num_warps must be a power of two
    points = [sw.default_point(sw.SPLIT), bad, sw.default_point(sw.UNIFIED)]
    result = sw.run_points(points, session, batch, auto_splits=1)
    assert [p for p, _ in result.runs] == [points[0], points[2]]
    assert result.failures == [(bad, "ValueError: num_warps=3 is invalid: must be a power of "
                                     "two >= 1 and <= 16")]
    lines = sw.sweep_lines(result, session, 1, len(points), None)
    assert lines[0].startswith("sweep: 3 of 3 points run in ") and "1 failed" in lines[0]
    assert sum(line.startswith("| ") and line[2].isdigit() for line in lines) == 2
    assert lines[-1].startswith("sweep failed: split-KV num_warps 3, BLOCK_N 64, num_stages 2, "
                                "splits auto (=1): ValueError: num_warps=3")
    cut = sw.run_points(points, session, batch, auto_splits=1, budget_s=0.0)
    assert len(cut.runs) == 1 and cut.not_reached == 2      # the first point always runs


def test_mixed_batch_slots_cover_each_chunk_after_its_prefix():
    shape = Shape(3, 10, 4, 2, 16, "float32", num_prefills=1, chunk=6)
    q, k, v, cache, meta = make_batch(shape, 4, "cpu", seed=2)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 8] and q.shape == (8, 4, 16)
    assert meta.seq_lens.tolist() == [10, 10, 16] and meta.max_query_len == 6
    assert sorted(meta.block_table[:2, :3].flatten().tolist()
                  + meta.block_table[2].tolist()) == list(range(10))
    bt = meta.block_table.long()
    expected = [bt[0, 2] * 4 + 1, bt[1, 2] * 4 + 1] + [bt[2, p // 4] * 4 + p % 4
                                                       for p in range(10, 16)]
    assert meta.slot_mapping.tolist() == [int(s) for s in expected]


def test_markdown_keeps_tables_raw():
    assert ab.to_markdown(["a", "| x |", "| y |", "b"]) == ["- a", "", "| x |", "| y |", "",
                                                             "- b"]


@pytest.mark.parametrize("flags,field", [
    (["--unified", "--backend", "torch"], "backend"),
    (["--sweep", "--all-backends"], "backend"),
    (["--mixed", "--sweep"], "sweep"),
    (["--mixed", "--num-prefills", "3"], "num_prefills"),
    (["--mixed", "--chunk", "1"], "chunk"),
    (["--num-prefills", "1"], "num_prefills"),
    (["--sweep", "--sweep-points", "0"], "sweep_points"),
    (["--sweep-budget", "5"], "sweep_budget"),
    (["--sweep", "--decode-splits", "2"], "decode_splits"),
])
def test_bad_mode_flags_are_typed_errors(tmp_path, capsys, flags, field):
    argv = ["--device", "cpu", "--num-reqs", "2", *flags, "--results-file", str(tmp_path / "r")]
    assert ab.main(argv) == 2
    assert f"{field}=" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
