"""The throughput bench's helpers that need no model: Triton's JIT hooks as JitCompiles reads
them, and --triton-launch's parser."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.jit_compiles import JitCompiles
from bench.launch_override import parse_launch


def test_jit_compiles_records_each_compile_and_restores_the_hooks():
    knobs = pytest.importorskip("triton").knobs
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    with JitCompiles() as compiles:
        runtime = knobs.runtime
        # The keyword arguments Triton passes its hooks (runtime/jit.py, _call_hook).
        for name in ("_prefill_kernel", "_decode_kernel"):
            sig = f"{name}[num_warps=4](q_ptr: *bf16)"
            fn = SimpleNamespace(name=name)
            assert runtime.jit_cache_hook(key=("k", name), repr=sig, fn=fn) is False
            runtime.jit_post_compile_hook(key=("k", name), repr=sig, fn=fn)
    assert compiles.supported
    assert [e[0] for e in compiles.events] == ["_prefill_kernel", "_decode_kernel"]
    assert all(seconds >= 0 and "key ('k'," in sig for _, seconds, sig in compiles.events)
    assert compiles.describe().startswith("2 (")
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before


def test_no_compile_reads_none():
    pytest.importorskip("triton")
    with JitCompiles() as compiles:
        pass
    assert compiles.describe() == "none"


def test_launch_flag_sets_fields_of_both_levels():
    launch = parse_launch("decode.block_n=32, decode_splits=2,dispatch=unified")
    assert (launch.decode.block_n, launch.decode_splits, launch.dispatch) == (32, 2, "unified")
    assert launch.prefill.block_n == 64 and launch.decode.num_warps == 4     # the defaults
    assert parse_launch("decode_splits=none").decode_splits is None
    assert parse_launch("decode_order=head_fastest").decode_order == "head_fastest"
    wide = parse_launch("wide_tile_rows=32,wide_block_n=32,wide_num_warps=8")
    assert (wide.wide_tile_rows, wide.wide_block_n, wide.wide_num_warps) == (32, 32, 8)


@pytest.mark.parametrize("text,named", [("x=1", "'x'"), ("decode.foo=2", "'decode.foo'"),
                                        ("decode_splits", "name=value"),
                                        ("decode.block_n=24", "block_n=24"),
                                        ("decode_order=by_head", "decode_order='by_head'"),
                                        ("wide_tile_rows=24", "wide_tile_rows=24"),
                                        ("wide_num_warps=32", "wide_num_warps=32"),
                                        ("wide_block_n=sixteen", "wide_block_n='sixteen'"),
                                        ("decode.num_warps=4.0", "decode.num_warps='4.0'"),
                                        ("wide_block_n=none", "wide_block_n=None")])
def test_launch_flag_names_what_is_wrong(text, named):
    with pytest.raises(ValueError, match=named):
        parse_launch(text)
