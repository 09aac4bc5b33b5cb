"""bench/peers/roofline.py: the floor's arithmetic on a small model, by hand."""
from __future__ import annotations

from bench.peers.roofline import Floor, ModelShape, workload_cost

SHAPE = ModelShape(hidden=8, intermediate=16, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=4, vocab=10, tied=True)


def test_layer_params_and_weights():
    # qkv (8 + 2*4) x 8, o 8 x 8, gate_up 32 x 8, down 8 x 16
    assert SHAPE.layer_params == 128 + 64 + 256 + 128
    assert SHAPE.weight_params() == 2 * 576 + 10 * 8 + 5 * 8
    assert SHAPE.kv_bytes_per_token(4) == 2 * 2 * 1 * 4 * 4


def test_one_request_by_hand():
    flops, nbytes = workload_cost(SHAPE, [[1, 2, 3]], [2], "float32")
    # positions 0..3 go through the layers (3 prompt tokens + the first output token)
    linear = 4 * 2 * 2 * 576
    attention = 4 * 2 * 2 * 4 * (1 + 2 + 3 + 4)
    head = 2 * 2 * 8 * 10
    assert flops == linear + attention + head
    # one decode step (outputs 2 -> 1 step), reading every weight and the KV of positions 0..3
    assert nbytes == SHAPE.weight_params() * 4 + 4 * SHAPE.kv_bytes_per_token(4)


def test_a_shared_prefix_is_counted_once_with_prefix_caching():
    prompts = [[0] * 10 + [1], [0] * 10 + [2]]
    with_cache, _ = workload_cost(SHAPE, prompts, [1, 1], "float32", 10, True)
    without, _ = workload_cost(SHAPE, prompts, [1, 1], "float32", 10, False)
    assert without - with_cache == 10 * 2 * 2 * 576 + 4 * 2 * 2 * 4 * sum(range(1, 11))


def test_floor_adds_compute_and_memory_time():
    f = Floor(matmul_flops=2e9, decode_bytes=3e9, gemm_flops_per_s=1e9, copy_bytes_per_s=1e9,
              gemm_how="x")
    assert (f.compute_s, f.memory_s, f.seconds) == (2.0, 3.0, 5.0)
