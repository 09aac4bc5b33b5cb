"""The flash-attn backend: its layout checks and helpers everywhere, its kernels on a GPU.

Without CUDA or without flash_attn the GPU tests skip (the reason says which); the module and its
checks must still import and work, since the backend is optional.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.attention import flash_attn_backend as fab
from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchAttentionBackend

HAS_CUDA = torch.cuda.is_available()
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
_MISSING = [what for what, ok in (("no CUDA device", HAS_CUDA),
                                  ("flash_attn not installed", HAS_FLASH)) if not ok]
needs_flash_gpu = pytest.mark.skipif(
    bool(_MISSING), reason="needs CUDA and flash_attn: " + "; ".join(_MISSING))


# -- checks and helpers (CPU) --------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [16, 64, 128, 320])
def test_block_size_not_multiple_of_256_is_refused(block_size):
    with pytest.raises(ValueError, match=f"block_size={block_size}.*multiple of 256"):
        fab.check_flash_layout(block_size, 128, torch.bfloat16)
    assert not fab.flash_attn_supports(block_size, 128, torch.bfloat16)


def test_dtype_and_head_dim_rules():
    fab.check_flash_layout(512, 128, torch.float16)
    assert fab.flash_attn_supports(256, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        fab.check_flash_layout(256, 128, torch.float32)
    for head_dim in (60, 320):
        with pytest.raises(ValueError, match=f"head_dim={head_dim}"):
            fab.check_flash_layout(256, head_dim, torch.float16)


def test_version_parsing():
    assert fab._version_tuple("2.6.3") == (2, 6, 3)
    assert fab._version_tuple("2.7.0.post2") == (2, 7, 0)
    assert fab._version_tuple("2.5.9+cu12") == (2, 5, 9)
    assert fab._version_tuple("unknown") == ()
    assert fab._version_tuple("2.5.9") < fab.MIN_FLASH_ATTN_VERSION <= fab._version_tuple("2.6")


@pytest.mark.skipif(HAS_FLASH, reason="flash_attn is installed here")
def test_missing_flash_attn_is_a_clear_error():
    with pytest.raises(fab.FlashAttnUnavailable, match="pip install 'deltaserve\\[flash\\]'"):
        fab.FlashAttnBackend()


def test_cu_seqlens_k_is_exclusive_prefix_sum():
    lens = torch.tensor([5, 1, 300, 7], dtype=torch.int32)
    got = fab.cu_seqlens_k(lens)
    assert got.dtype == torch.int32
    assert got.tolist() == [0, 5, 6, 306, 313]
    assert fab.cu_seqlens_k(torch.zeros(0, dtype=torch.int32)).tolist() == [0]


def test_pure_decode_detection():
    def meta(num_reqs, num_tokens, max_q):
        t = torch.zeros(1, dtype=torch.int32)
        return AttentionMetadata(num_reqs, num_tokens, max_q, 1, t, t, t, t, t, t)
    assert fab.is_one_token_per_request(meta(4, 4, 1))
    assert not fab.is_one_token_per_request(meta(4, 7, 4))      # mixed batch
    assert not fab.is_one_token_per_request(meta(4, 3, 1))      # a request with no query row


class FakeFlash:
    """flash_attn's two entry points, recording their keyword arguments."""

    __version__ = "2.6.3"

    def __init__(self):
        self.calls = []

    def flash_attn_varlen_func(self, q, *args, **kwargs):
        self.calls.append(("varlen", kwargs))
        return torch.zeros_like(q)

    def flash_attn_with_kvcache(self, q, *args, **kwargs):
        self.calls.append(("kvcache", kwargs))
        return torch.zeros_like(q)


@pytest.mark.parametrize("window", [0, 9])
def test_sliding_window_is_flash_window_size(monkeypatch, window):
    """W > 0 reaches both entry points as window_size=(W - 1, 0) (keys p - W < k <= p); no
    window passes no window_size at all (the calls stay as they were)."""
    fake = FakeFlash()
    monkeypatch.setattr(fab, "import_flash_attn", lambda: fake)
    monkeypatch.setattr(fab, "_kv_writer", lambda: lambda *args: None)
    monkeypatch.setattr(fab, "check_flash_layout", lambda *args: None)
    backend = fab.FlashAttnBackend()
    assert backend.supports_sliding_window
    cache = torch.zeros(2, 2, 4, 1, 8)
    t = torch.zeros(3, dtype=torch.int32)
    for num_tokens, max_q in ((2, 1), (3, 2)):               # pure decode, then mixed
        meta = AttentionMetadata(2, num_tokens, max_q, 4, t, t[:2], t[:2, None], t, t, t[:2])
        q = torch.zeros(num_tokens, 1, 8)
        backend.forward(q, q, q, cache, meta, 1.0, sliding_window=window)
    assert [name for name, _ in fake.calls] == ["kvcache", "varlen"]
    for _, kwargs in fake.calls:
        assert kwargs.get("window_size") == ((window - 1, 0) if window else None)
        assert kwargs["causal"] is True


def test_pad_rows():
    out = torch.ones(3, 2, 8)
    assert fab._pad_rows(out, 3) is out
    padded = fab._pad_rows(out, 5)
    assert padded.shape == (5, 2, 8) and padded[:3].eq(1).all() and padded[3:].eq(0).all()


# -- kernels against the torch reference (GPU + flash_attn) ------------------------------------

BLOCK = 256


def make_case(seed, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype, num_pad=0):
    """A batch over a random cache with shuffled physical blocks and num_pad padded rows
    (slot -1, huge keys: a stray write would show in the cache comparison)."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(per_req) + 2
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(per_req) + 1, dtype=torch.int32)
    slots, used = [], 0
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        table[i, :per_req[i]] = perm[used:used + per_req[i]]
        used += per_req[i]
        pos = torch.arange(s - q, s)
        slots.append(table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    slots.append(torch.full((num_pad,), -1, dtype=torch.long))
    rows = sum(query_lens) + num_pad
    q = torch.randn(rows, num_heads, head_dim, generator=gen)
    k = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    k[sum(query_lens):] = 1e4
    cache = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=gen)
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    dev = "cuda"
    meta = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=starts.to(dev), seq_lens=lens.to(dev), block_table=table.to(dev),
        slot_mapping=torch.cat(slots).to(dev), query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return [t.to(dev, dtype) for t in (q, k, v, cache)] + [meta]


def check(case, atol, window=0):
    q, k, v, cache, meta = case
    scale = q.shape[2] ** -0.5
    ref_cache, our_cache = cache.clone(), cache.clone()
    win = {"sliding_window": window} if window else {}
    expected = TorchAttentionBackend(batched=False).forward(q, k, v, ref_cache, meta, scale,
                                                            **win)
    got = fab.FlashAttnBackend().forward(q, k, v, our_cache, meta, scale, **win)
    n = meta.num_actual_tokens
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got[:n].float(), expected[:n].float(), atol=atol, rtol=atol)
    assert torch.equal(our_cache, ref_cache), "KV cache differs from the reference writes"


SHAPES = [(8, 8, 128), (16, 4, 128), (8, 1, 64), (16, 2, 64)]    # GQA 1, 4, 8, 8


@needs_flash_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """Fresh prefill, chunk after an aligned and an unaligned cached prefix, decodes, a
    one-token prompt, padded rows: the varlen path."""
    seq_lens = [300, 2 * BLOCK + 40, 700, 1, 90, 513]
    query_lens = [300, 40, 129, 1, 1, 1]
    case = make_case(0, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype, 3)
    check(case, atol=2e-2)


@needs_flash_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_decode_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """One query per request: the kvcache path, contexts across several blocks."""
    seq_lens = [1, 255, 256, 257, 1000, 2048]
    case = make_case(1, seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim,
                     dtype)
    check(case, atol=2e-2)


@needs_flash_gpu
@pytest.mark.parametrize("window", [1, 100, 256, 300])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES[1:3])
def test_sliding_window_matches_reference(window, num_heads, num_kv_heads, head_dim):
    """Both paths with a window under, at and over a block: a mixed batch, then decodes."""
    mixed = make_case(2, [300, 2 * BLOCK + 40, 700, 1, 90, 513], [300, 40, 129, 1, 1, 1],
                      num_heads, num_kv_heads, head_dim, torch.bfloat16, 3)
    check(mixed, atol=2e-2, window=window)
    seq_lens = [1, 255, 257, 1000, 2048]
    decode = make_case(3, seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim,
                       torch.bfloat16)
    check(decode, atol=2e-2, window=window)
