"""The decode attention microbenchmark at tiny sizes: on CPU the torch backend, the C++ kernel
and the Triton kernels under the interpreter (on a GPU machine, the same run on CUDA); plus the batch it builds
and the bytes it counts."""
from __future__ import annotations

import re

import pytest
import torch

from bench import attention_bandwidth as ab

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = ["--device", DEVICE, "--num-reqs", "3", "--context", "37", "--num-heads", "4",
        "--num-kv-heads", "2", "--head-dim", "16", "--iters", "2", "--warmup", "1"]
FIGURE = r"([\d.]+(?:e[+-]?\d+)?)"


def _backend_line(name: str, out: str) -> str:
    match = re.search(rf"^{name} \(block .*$", out, re.M)
    assert match, f"no {name} line in:\n{out}"
    return match.group(0)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_one_backend_prints_positive_figures_and_appends_block(tmp_path, capsys, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    if backend == "cpu" and "cpu" not in ab._available_backends(DEVICE):
        pytest.skip("the C++ CPU kernel runs on CPU machines with its library built")
    results = tmp_path / "results.md"
    argv = TINY + ["--backend", backend, "--results-file", str(results), "--note", "smoke"]
    assert ab.main(argv) == 0
    out = capsys.readouterr().out
    line = _backend_line(backend, out)
    for pattern in (rf"{FIGURE} ms median of 2 calls", rf"min {FIGURE}", rf"max {FIGURE}",
                    rf"{FIGURE} GB/s = ", rf"= {FIGURE} of copy bandwidth"):
        match = re.search(pattern, line)
        assert match and float(match.group(1)) > 0, (pattern, line)
    assert re.search(r"check vs float32 reference \S+ \(ok\)", line), line
    copy = re.search(rf"measured copy bandwidth: {FIGURE} GB/s", out)
    assert copy and float(copy.group(1)) > 0
    # 3 requests x 37 tokens x 2 KV heads x 16 x K,V x 2 bytes; Q+O 2x3x4x16x2; new K/V 3x2x16x2x2
    assert "bytes per call: 0.01536 MB (KV read 0.01421 MB + Q, O and new K/V 0.001152 MB)" in out
    text = results.read_text()
    assert re.search(rf"^## .* · decode attention · {DEVICE} \(.+\)$", text, re.M)
    assert "- command: `python -m bench.attention_bandwidth --device" in text
    assert f"- {line}" in text and "- note: smoke" in text


def test_all_backends_runs_each_available_one(tmp_path, capsys):
    pytest.importorskip("triton")
    assert ab.main(TINY + ["--all-backends", "--results-file", str(tmp_path / "r.md")]) == 0
    out = capsys.readouterr().out
    for name in ab._available_backends(DEVICE):
        assert "(ok)" in _backend_line(name, out)


def test_decode_batch_uses_each_block_once_and_writes_the_last_position():
    shape = ab.Shape(5, 21, 4, 2, 16, "float32")
    q, k, v, cache, meta = ab.make_decode_batch(shape, 4, "cpu", seed=3)
    assert cache.shape == (2, 5 * 6, 4, 2, 16) and q.shape == (5, 4, 16)
    assert sorted(meta.block_table.flatten().tolist()) == list(range(30))
    assert meta.seq_lens.tolist() == [21] * 5 and meta.max_query_len == 1
    # position 20 lives in block-table column 5, row 0 of that block
    assert meta.slot_mapping.tolist() == (meta.block_table[:, 5].long() * 4).tolist()
    assert bool((cache != 0).all())


@pytest.mark.parametrize("flags,field", [
    (["--num-heads", "6", "--num-kv-heads", "4"], "num_heads"),
    (["--block-size", "24"], "block_size"),
    (["--context", "0"], "context"),
    (["--decode-splits", "0"], "decode_splits"),
])
def test_bad_flags_are_typed_errors(tmp_path, capsys, flags, field):
    assert ab.main(["--device", "cpu", *flags, "--results-file", str(tmp_path / "r.md")]) == 2
    assert f"{field}=" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


def test_flash_attn_refused_where_it_cannot_run(tmp_path, capsys):
    argv = ["--device", "cpu", "--backend", "flash_attn", "--results-file",
            str(tmp_path / "r.md")]
    assert ab.main(argv) == 2
    assert "backend='flash_attn'" in capsys.readouterr().err
