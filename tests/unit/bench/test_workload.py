"""bench/workload.py: the named workloads, their draws and the length flags."""
from __future__ import annotations

import argparse

import pytest

from bench.workload import (NAMED_WORKLOADS, WorkloadShape, add_model_and_workload_flags,
                            draw_workload, make_workload, model_dir_for, warmup_workload,
                            workload_shape)
from engine_common.request.params import ParamError


def parse(argv, num_seqs=32, min_len=64, max_len=512):
    p = argparse.ArgumentParser()
    add_model_and_workload_flags(p, None, num_seqs, min_len, max_len)
    return p.parse_args(argv)


def test_the_named_workloads_have_the_issues_shapes():
    w = {name: n.shape for name, n in NAMED_WORKLOADS.items()}
    assert w["prefill-heavy"] == WorkloadShape(32, (64, 512), (64, 128))
    assert w["decode-heavy"] == WorkloadShape(256, (16, 64), (256, 512))
    assert w["shared-prefix"].shared_prefix_len == 400
    assert w["shared-prefix"].input_lens == (32, 64)
    assert w["step-overhead"] == WorkloadShape(256, (16, 32), (256, 256))
    assert NAMED_WORKLOADS["step-overhead"].model == "step-overhead"
    assert w["smoke"].num_seqs <= 8


def test_draws_are_seeded_and_within_their_ranges():
    shape = WorkloadShape(20, (5, 9), (3, 4), shared_prefix_len=7)
    a, b = draw_workload(shape, 100, seed=1), draw_workload(shape, 100, seed=1)
    assert a == b and a != draw_workload(shape, 100, seed=2)
    prefix = a.prompts[0][:7]
    assert all(p[:7] == prefix and 12 <= len(p) <= 16 for p in a.prompts)
    assert all(3 <= n <= 4 for n in a.output_lens)
    assert a.max_total_len <= shape.max_total_len == 7 + 9 + 4


def test_make_workload_keeps_its_draws_for_old_results():
    w = make_workload(3, 2, 4, 50, seed=0)
    assert w == draw_workload(WorkloadShape(3, (2, 4), (2, 4)), 50, seed=0)


def test_length_flags_override_the_named_shape_per_side():
    args = parse(["--workload", "decode-heavy", "--num-seqs", "64", "--max-output-len", "300"])
    assert workload_shape(args) == WorkloadShape(64, (16, 64), (256, 300))
    args = parse(["--min-len", "10", "--max-len", "20", "--min-input-len", "12"])
    assert workload_shape(args) == WorkloadShape(32, (12, 20), (10, 20))
    assert workload_shape(parse([])) == WorkloadShape(32, (64, 512), (64, 512))


def test_bad_lengths_name_the_flag():
    with pytest.raises(ParamError, match="max_output_len"):
        workload_shape(parse(["--min-output-len", "9", "--max-output-len", "3"]))
    with pytest.raises(ParamError, match="min_input_len"):
        WorkloadShape(1, (0, 3), (1, 1))


def test_real_model_workloads_take_model_else_the_default_one(monkeypatch):
    from deltaserve import default_model
    monkeypatch.setattr(default_model, "ensure_default_model", lambda: "/cache/SmolLM2")
    assert model_dir_for(parse(["--workload", "prefill-heavy"]), "tiny", "cpu") == \
        "/cache/SmolLM2"
    assert model_dir_for(parse(["--workload", "prefill-heavy", "--model", "M"]), "tiny",
                         "cpu") == "M"


def test_warmup_has_other_ids_and_short_outputs():
    w = draw_workload(WorkloadShape(10, (20, 30), (40, 50)), 1000, seed=3)
    warm = warmup_workload(w, 1000, num_seqs=4, max_output_len=16)
    assert warm.num_seqs == 4 and all(n == 16 for n in warm.output_lens)
    assert [len(p) for p in warm.prompts] == [len(p) for p in w.prompts[:4]]
    assert warm.prompts != w.prompts[:4]
