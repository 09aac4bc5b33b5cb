"""Attention logit soft-capping (Gemma 2: scores -> cap * tanh(scores / cap) before the mask and
softmax) on every backend the engine can pick on the CPU.

The per-request torch loop is checked first against a plain dense torch computation written
here (transformers' eager_attention_forward, request by request); then the batched torch path,
every Triton design (under the interpreter on CPU) and the CPU backend (which hands a capped
call to the torch backend) against the loop, alone and with a sliding window, on batches of
decodes, fresh prefills and chunks after cached prefixes; flash-attn gets its own softcap
argument (a recording stand-in: no CUDA here). A layer refuses a backend without softcap.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_paged
from kernels.attention.backend import check_softcap
from kernels.attention.torch_ref import TorchAttentionBackend, gather_kv
from kernels.attention.triton_launch import KernelTiles, TritonLaunchConfig
from tests.support.attention_cases import make_case, needs_kernels, triton_backend
from worker_service.layers.attention import Attention

CAP = 1.5       # the random scores have std ~1: the cap bends most of them
MIXED = ([70, 33, 40, 1, 29, 21], [1, 33, 9, 1, 1, 21])
DECODE = ([1, 9, 17, 64, 130], [1, 1, 1, 1, 1])


def run(backend, case, softcap: float, window: int = 0) -> torch.Tensor:
    query, key, value, kv_cache, meta = case
    out = backend.forward(query, key, value, kv_cache.clone(), meta, query.shape[2] ** -0.5,
                          sliding_window=window, softcap=softcap)
    return out[:meta.num_actual_tokens].float()


def reference(case, softcap: float, window: int = 0) -> torch.Tensor:
    return run(TorchAttentionBackend(batched=False), case, softcap, window)


def plain_torch(case, softcap: float) -> torch.Tensor:
    """Dense eager attention per request over its keys (the cache after this step's write)."""
    query, key, value, kv_cache, meta = case
    cache = kv_cache.clone()
    TorchAttentionBackend(batched=False).forward(query, key, value, cache, meta, 1.0)
    scale, outs = query.shape[2] ** -0.5, []
    starts, lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    for i in range(meta.num_reqs):
        q = query[starts[i]:starts[i + 1]].float()                          # [Q, Hq, D]
        keys, values = gather_kv(cache, meta.block_table[i], lens[i])
        group = q.shape[1] // keys.shape[1]
        k = keys.float().repeat_interleave(group, 1)
        v = values.float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(lens[i] - len(q), lens[i])[:, None]
        scores = scores.masked_fill(torch.arange(lens[i])[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def test_reference_loop_is_plain_softcapped_attention():
    case = make_case(1, *MIXED, 4, 2, 16, 4, num_pad=2, device="cpu")
    torch.testing.assert_close(reference(case, CAP), plain_torch(case, CAP), atol=1e-5, rtol=1e-5)
    # and the cap is not a no-op on these scores
    assert not torch.allclose(reference(case, CAP), reference(case, 0.0), atol=1e-3)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("batch", [MIXED, DECODE], ids=["mixed", "decode"])
def test_torch_batched_matches_the_loop(batch, window):
    case = make_case(2, *batch, 4, 2, 16, 4, num_pad=2, device="cpu")
    torch.testing.assert_close(run(TorchAttentionBackend(), case, CAP, window),
                               reference(case, CAP, window), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_paged.available(), reason="deltaserve_cpu not built")
def test_cpu_backend_hands_capped_calls_to_torch():
    case = make_case(3, *MIXED, 4, 2, 16, 4, device="cpu")
    backend = cpu_paged.CpuPagedAttentionBackend()
    torch.testing.assert_close(run(backend, case, CAP, 5), reference(case, CAP, 5),
                               atol=1e-5, rtol=1e-5)
    assert backend.capped_calls == 1
    run(backend, case, 0.0)                    # an uncapped call stays on the kernel
    assert backend.capped_calls == 1 and backend.calls == 1


def triton(**launch):
    return triton_backend.TritonAttentionBackend(launch=TritonLaunchConfig(**launch))


@needs_kernels
@pytest.mark.parametrize("dispatch", ["by_batch", "unified", "per_request"])
@pytest.mark.parametrize("window", [0, 8])
def test_triton_designs_match_the_reference(dispatch, window):
    tiles = KernelTiles(block_n=16, num_warps=2, num_stages=1)
    backend = triton(prefill=tiles, decode=tiles, block_q_rows=16, dispatch=dispatch)
    case = make_case(4, *MIXED, 4, 2, 16, 4, num_pad=2)
    torch.testing.assert_close(run(backend, case, CAP, window), reference(case, CAP, window),
                               atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_split_decode_is_capped(splits):
    tiles = KernelTiles(block_n=16, num_warps=2, num_stages=1)
    case = make_case(5, *DECODE, 8, 2, 32, 16, num_pad=1)
    got = run(triton(decode=tiles, decode_splits=splits), case, CAP)
    torch.testing.assert_close(got, reference(case, CAP), atol=2e-5, rtol=2e-5)


class NoCapBackend(TorchAttentionBackend):
    name = "nocap"
    supports_softcap = False


def test_a_capped_layer_refuses_a_backend_without_softcap():
    with pytest.raises(ValueError, match="'nocap' attention backend cannot apply it"):
        Attention(4, 2, 16, 0.25, NoCapBackend(), softcap=50.0)
    assert Attention(4, 2, 16, 0.25, NoCapBackend()).softcap == 0.0     # no cap: accepted


def test_invalid_softcaps_are_refused():
    for bad in (-1.0, True, None, "30"):
        with pytest.raises(ValueError, match="softcap"):
            check_softcap(bad)


@pytest.mark.parametrize("cap", [0.0, 50.0])
def test_flash_attn_gets_its_own_softcap_argument(monkeypatch, cap):
    """flash-attn (>= 2.6) caps in its kernels: both entry points get softcap=cap; no cap
    passes none (the calls stay as they were). (CUDA only: the real kernels run in the GPU
    tests; here a stand-in records the arguments.)"""
    from kernels.attention import flash_attn_backend as fab
    from kernels.attention.backend import AttentionMetadata
    from tests.unit.kernels.test_flash_attn_backend import FakeFlash
    fake = FakeFlash()
    monkeypatch.setattr(fab, "import_flash_attn", lambda: fake)
    monkeypatch.setattr(fab, "_kv_writer", lambda: lambda *args: None)
    monkeypatch.setattr(fab, "check_flash_layout", lambda *args: None)
    backend = fab.FlashAttnBackend()
    assert backend.supports_softcap
    cache, t = torch.zeros(2, 2, 4, 1, 8), torch.zeros(3, dtype=torch.int32)
    for num_tokens, max_q in ((2, 1), (3, 2)):               # pure decode, then mixed
        meta = AttentionMetadata(2, num_tokens, max_q, 4, t, t[:2], t[:2, None], t, t, t[:2])
        q = torch.zeros(num_tokens, 1, 8)
        backend.forward(q, q, q, cache, meta, 1.0, softcap=cap)
    assert [name for name, _ in fake.calls] == ["kvcache", "varlen"]
    for _, kwargs in fake.calls:
        assert kwargs.get("softcap") == (cap or None)
