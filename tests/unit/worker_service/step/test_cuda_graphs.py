"""Decode CUDA graphs: batch sizes, padding, persistent buffers, and the eager/graph choice.

Everything except capture runs on CPU (the Triton variant on CUDA where there is a GPU:
compiled Triton cannot read CPU tensors): DecodeGraphRunner.run without captured graphs runs the
same forward over the same padded buffers, so padding rows are checked here against the plain
eager model on a tiny real model. The GPU test checks that a replayed graph gives exactly what
the same forward gives eagerly; it skips without CUDA.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchAttentionBackend
from worker_service.step.cuda_graphs import (DecodeGraphRunner, graph_batch_sizes,
                                               graphs_unsupported_reason, padded_batch_size)
from worker_service.step.decode_buffers import DecodeBuffers
from worker_service.models.loader import allocate_kv_caches, load_model
from worker_service.parallel_state import single_rank_group
from worker_service.step.step_buffers import StepBuffers

HAS_CUDA = torch.cuda.is_available()
BLOCK_SIZE = 4
NUM_BLOCKS = 40
MAX_BLOCKS = 8            # per request: max_model_len 32


# -- sizes and padding ---------------------------------------------------------------------------

def test_graph_batch_sizes():
    assert graph_batch_sizes(512) == [1, 2, 4, 8] + list(range(16, 513, 16))
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]          # the maximum itself is always there
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError, match="max_graph_batch=0"):
        graph_batch_sizes(0)


def test_padded_batch_size_is_smallest_size_that_fits():
    sizes = graph_batch_sizes(40)
    for n in range(1, 41):
        padded = padded_batch_size(n, sizes)
        assert padded in sizes and padded >= n
        assert all(s < n for s in sizes if s < padded)
    assert padded_batch_size(41, sizes) is None
    assert padded_batch_size(0, sizes) is None
    assert [padded_batch_size(n, sizes) for n in (3, 9, 17, 33)] == [4, 16, 32, 40]


def test_which_setups_can_use_graphs():
    assert graphs_unsupported_reason("triton", "cuda") is None
    assert graphs_unsupported_reason("flash_attn", torch.device("cuda", 1)) is None
    assert "not capturable" in graphs_unsupported_reason("torch", "cuda")
    assert "not a CUDA device" in graphs_unsupported_reason("triton", "cpu")
    assert "enforce_eager" in graphs_unsupported_reason("triton", "cuda", enforce_eager=True)


def test_a_model_that_syncs_with_the_host_is_never_captured(tiny_models):
    """MoE models whose experts take the grouped torch path (CPU weights) sync with the host
    per layer: capturing them would fail. On the fused path (CUDA weights; forced here) nothing
    syncs and they are captured like any model."""
    from worker_service.layers.moe import MoEExperts
    from worker_service.models.llama import Qwen3ForCausalLM

    for arch in ("qwen3_moe", "qwen2_moe"):
        moe = load_model(tiny_models(arch), single_rank_group(), TorchAttentionBackend(), "cpu")
        assert "host sync" in graphs_unsupported_reason("triton", "cuda", model=moe)
        experts = [m for m in moe.modules() if isinstance(m, MoEExperts)]
        assert len(experts) == 2
        experts[0].fused_moe = True                 # one grouped layer still blocks capture
        assert "host sync" in graphs_unsupported_reason("triton", "cuda", model=moe)
        experts[1].fused_moe = True
        assert graphs_unsupported_reason("triton", "cuda", model=moe) is None
    assert graphs_unsupported_reason("triton", "cuda", model=Qwen3ForCausalLM) is None
    assert DecodeGraphRunner.supported("triton", "cuda")
    assert not DecodeGraphRunner.supported("torch", "cuda")
    assert not DecodeGraphRunner.supported("triton", "cpu")


def test_only_pure_decode_steps_within_the_largest_graph_replay(tiny_setup):
    runner = tiny_setup["runner"]                              # max_graph_batch 16
    assert runner.graph_batch(num_reqs=3, num_tokens=3, max_query_len=1) == 4
    assert runner.graph_batch(num_reqs=16, num_tokens=16, max_query_len=1) == 16
    assert runner.graph_batch(num_reqs=17, num_tokens=17, max_query_len=1) is None
    assert runner.graph_batch(num_reqs=3, num_tokens=9, max_query_len=7) is None   # prefill
    assert runner.graph_batch(num_reqs=3, num_tokens=2, max_query_len=1) is None   # idle row


# -- buffers -------------------------------------------------------------------------------------

def _load(buf, staging, *args):
    """Stage one step, flush it, load it into the decode buffers."""
    staging.begin()
    staged = buf.stage(staging, *args)
    staging.flush()
    buf.load(staged)
    return staged


def test_buffers_stage_real_rows_and_pad_the_rest():
    buf = DecodeBuffers(max_batch=8, max_blocks_per_req=4, device="cpu", max_seq_len=16)
    staging = StepBuffers(8, 8, 4, "cpu")
    table = np.array([[5, 6, 0], [7, 0, 0], [1, 2, 3]], dtype=np.int32)
    staged = _load(buf, staging, 3, 4, np.array([11, 12, 13]), np.array([9, 2, 10]),
                   np.array([25, 28, 14]), np.array([10, 3, 11], dtype=np.int32), table)
    # the staged views live in the shared staging arenas; the buffers are separate tensors
    arena = staging.arenas[torch.int64].dev
    assert arena.data_ptr() <= staged.tokens.data_ptr() < arena.data_ptr() + arena.nbytes
    assert staged.tokens.data_ptr() != buf.tokens.data_ptr()
    input_ids, positions = buf.model_inputs(4)
    assert input_ids.tolist() == [11, 12, 13, 0]
    assert positions.tolist() == [9, 2, 10, 0]
    meta = buf.metadata(4)
    assert meta.slot_mapping.tolist() == [25, 28, 14, -1]
    assert meta.seq_lens.tolist() == [10, 3, 11, 1]
    assert buf.block_table[:4, :3].tolist() == table.tolist() + [[0, 0, 0]]
    assert meta is buf.metadata(4)                  # graphs hold on to these tensors
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len) == (4, 4, 1)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.data_ptr() == buf.seq_lens.data_ptr()
    assert meta.seq_lens_cpu.tolist() == [10, 3, 11, 1]
    # the rows by length, longest first, the padding row (length 1) last
    assert meta.decode_order.tolist() == [2, 0, 1, 3]
    assert meta.decode_order.data_ptr() == buf.tokens[3].data_ptr()
    # a smaller next step: row 1 becomes padding again, row 0 keeps stale (valid) columns
    one = (np.array([4]), np.array([3]), np.array([7]), np.array([4], np.int32),
           np.array([[9]], dtype=np.int32))
    _load(buf, staging, 1, 1, *one)
    _load(buf, staging, 1, 2, *one)
    assert buf.tokens[2, :2].tolist() == [7, -1]
    assert buf.block_table[:2, :3].tolist() == [[9, 6, 0], [0, 0, 0]]
    assert buf.metadata(2).seq_lens_cpu.tolist() == [4, 1]
    assert buf.metadata(2).decode_order.tolist() == [0, 1]


def test_buffers_reject_bad_shapes():
    buf = DecodeBuffers(max_batch=4, max_blocks_per_req=2, device="cpu", max_seq_len=8)
    staging = StepBuffers(4, 4, 2, "cpu")
    ones = np.ones(2, dtype=np.int64)
    with pytest.raises(ValueError, match="padded=5"):
        buf.stage(staging, 2, 5, ones, ones, ones, ones, np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="block_table shape"):
        buf.stage(staging, 2, 2, ones, ones, ones, ones, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="positions has 1 rows"):
        buf.stage(staging, 2, 2, ones, ones[:1], ones, ones, np.zeros((2, 1), np.int32))


# -- padded runs against the eager model (CPU, torch backend) -----------------------------------

def decode_step(seq_lens: list[int], table: torch.Tensor, seed: int) -> dict:
    """One decode token per request: position seq_len - 1, slot through the request's blocks."""
    gen = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    pos = np.array(seq_lens, dtype=np.int64) - 1
    blocks = table[:n].numpy()
    slots = blocks[np.arange(n), pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE \
        + pos % BLOCK_SIZE
    width = -(-max(seq_lens) // BLOCK_SIZE)
    return dict(input_ids=torch.randint(0, 500, (n,), generator=gen).numpy(), positions=pos,
                slot_mapping=slots, seq_lens=np.array(seq_lens, dtype=np.int32),
                block_table=np.ascontiguousarray(blocks[:, :width]))


def eager_logits(model, caches, step: dict, device) -> torch.Tensor:
    """The model runner's eager path on the unpadded inputs."""
    n = len(step["seq_lens"])
    qsl = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.from_numpy(step["seq_lens"])
    meta = AttentionMetadata(
        num_reqs=n, num_actual_tokens=n, max_query_len=1, max_seq_len=int(lens.max()),
        query_start_loc=qsl.to(device), seq_lens=lens.to(device),
        block_table=torch.from_numpy(step["block_table"]).to(device),
        slot_mapping=torch.from_numpy(step["slot_mapping"]).to(device),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    hidden = model(torch.from_numpy(step["input_ids"]).to(device),
                   torch.from_numpy(step["positions"]).to(device), caches, meta)
    return model.compute_logits(hidden)


def random_caches(model, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    return [c.to(device, dtype) for c in caches]


def make_backend(name: str):
    """The torch reference, or Triton (compiled on GPU, interpreted on CPU); "triton-longest"
    starts the decode programs by the staged decode_order (the graph runner stages it, the
    eager path does not)."""
    if name == "torch":
        return TorchAttentionBackend()
    triton = pytest.importorskip("triton")
    if not HAS_CUDA:
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(triton.language.zeros, InterpretedFunction):
            pytest.skip("triton was imported in compiled mode without a GPU")
    from kernels.attention.triton_backend import TritonAttentionBackend
    from kernels.attention.triton_launch import TritonLaunchConfig
    order = "longest_first" if name == "triton-longest" else "request_fastest"
    return TritonAttentionBackend(launch=TritonLaunchConfig(decode_order=order))


@pytest.fixture(scope="module", params=["torch", "triton", "triton-longest"])
def tiny_setup(request, tiny_models):
    """The runner over a tiny model, uncaptured. Triton runs where its kernels can: on CUDA
    when there is a GPU (compiled Triton cannot read CPU tensors), else interpreted on CPU."""
    backend = make_backend(request.param)
    device = "cuda" if HAS_CUDA and request.param != "torch" else "cpu"
    model = load_model(tiny_models("qwen3"), single_rank_group(), backend, device)
    caches = random_caches(model, device, torch.float32, seed=0)
    runner = DecodeGraphRunner(model, caches, max_graph_batch=16, max_blocks_per_req=MAX_BLOCKS,
                               max_model_len=MAX_BLOCKS * BLOCK_SIZE, device=device)
    table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))
    table = table[:5 * MAX_BLOCKS].view(5, MAX_BLOCKS).to(torch.int32)
    return dict(model=model, caches=caches, runner=runner, table=table, device=device)


@torch.inference_mode()
@pytest.mark.parametrize("seq_lens", [[7], [1, 9, 32, 13, 4], [4, 5], [17, 2, 8]])
def test_padded_run_matches_eager_model(tiny_setup, seq_lens):
    """Padding rows (5 -> 8, 1 -> 1, 2 -> 2, 3 -> 4) change neither the real rows' logits nor
    any KV-cache slot other than the real rows' own (torch and Triton decode kernels)."""
    model, runner, table = tiny_setup["model"], tiny_setup["runner"], tiny_setup["table"]
    before = [c.clone() for c in tiny_setup["caches"]]
    step = decode_step(seq_lens, table, seed=len(seq_lens))
    eager_caches = [c.clone() for c in before]
    expected = eager_logits(model, eager_caches, step, tiny_setup["device"])
    got = runner.run(len(seq_lens), **step)
    assert got.shape == expected.shape == (len(seq_lens), model.args.vocab_size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(tiny_setup["caches"], eager_caches):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    changed = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    for ours, old in zip(tiny_setup["caches"], before):
        changed |= (ours != old).reshape(2, NUM_BLOCKS * BLOCK_SIZE, -1).any(-1).any(0).cpu()
    assert sorted(torch.nonzero(changed).flatten().tolist()) == sorted(step["slot_mapping"])


def test_capture_needs_cuda(tiny_setup):
    if HAS_CUDA:
        pytest.skip("CUDA is available; the GPU test captures for real")
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        tiny_setup["runner"].capture()


# -- replay against eager (GPU) ------------------------------------------------------------------

@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device")
@torch.inference_mode()
def test_graph_replay_equals_eager(tiny_models):
    """Same padded inputs through a captured graph and eagerly: identical logits and caches;
    and close to the unpadded eager model."""
    from kernels.attention.triton_backend import TritonAttentionBackend

    model = load_model(tiny_models("qwen3"), single_rank_group(), TritonAttentionBackend(),
                       "cuda", "bfloat16")
    runners = []
    for _ in range(2):
        caches = random_caches(model, "cuda", torch.bfloat16, seed=0)
        runners.append(DecodeGraphRunner(model, caches, 16, MAX_BLOCKS,
                                         MAX_BLOCKS * BLOCK_SIZE, "cuda"))
    graphed, eager = runners
    graphed.capture()
    assert sorted(graphed.graphs) == graphed.sizes
    table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))
    table = table[:16 * 2].view(16, 2).to(torch.int32)
    plain_caches = random_caches(model, "cuda", torch.bfloat16, seed=0)
    for i, seq_lens in enumerate([[5], [1, 8, 3], [6] * 9, list(range(1, 9)) * 2]):
        step = decode_step(seq_lens, table, seed=i)
        got = graphed.run(len(seq_lens), **step)
        want = eager.run(len(seq_lens), **step)
        assert torch.equal(got, want), f"graph replay differs from eager for {seq_lens}"
        for a, b in zip(graphed.kv_caches, eager.kv_caches):
            assert torch.equal(a, b)
        plain = eager_logits(model, plain_caches, step, "cuda")
        torch.testing.assert_close(got, plain, atol=5e-2, rtol=5e-2)
