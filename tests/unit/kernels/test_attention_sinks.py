"""Attention sinks (GPT-OSS: a per-head logit that joins each softmax's denominator) on every
backend the engine can pick on the CPU, and the refusal of the one that cannot (flash-attn).

The per-request torch loop is checked first against transformers' own GPT-OSS
eager_attention_forward, request by request over the gathered keys; then the batched torch
path and every Triton design (under the interpreter on CPU: varlen, by-batch, per-request, the
split decode with and without splits) against the loop, alone and with a sliding window, on
batches of decodes, fresh prefills and chunks after cached prefixes. A batch without sinks is
unchanged. The C++ kernel has its own test per build (cpu/test_paged_attention_sinks.py).
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention.backend import check_sinks
from kernels.attention.torch_ref import TorchAttentionBackend, gather_kv
from kernels.attention.triton_launch import KernelTiles, TritonLaunchConfig
from tests.support.attention_cases import make_case, needs_kernels, triton_backend
from worker_service.layers.attention import Attention

MIXED = ([70, 33, 40, 1, 29, 21], [1, 33, 9, 1, 1, 21])
DECODE = ([1, 9, 17, 64, 130], [1, 1, 1, 1, 1])


def sinks_for(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Sink logits around the scores' size (std ~1), one well above: each changes the result."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 1.5
    sinks[0] = 4.0
    return sinks


def run(backend, case, sinks, window: int = 0) -> torch.Tensor:
    query, key, value, kv_cache, meta = case
    out = backend.forward(query, key, value, kv_cache.clone(), meta, query.shape[2] ** -0.5,
                          sliding_window=window, sinks=sinks)
    return out[:meta.num_actual_tokens].float()


def reference(case, sinks, window: int = 0) -> torch.Tensor:
    return run(TorchAttentionBackend(batched=False), case, sinks, window)


def transformers_eager(case, sinks) -> torch.Tensor:
    """transformers' GptOss eager_attention_forward per request over its cached keys."""
    eager = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    query, key, value, kv_cache, meta = case
    cache = kv_cache.clone()
    TorchAttentionBackend(batched=False).forward(query, key, value, cache, meta, 1.0)
    starts, lens, outs = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist(), []
    for i in range(meta.num_reqs):
        q = query[starts[i]:starts[i + 1]].float().transpose(0, 1)[None]     # [1, Hq, Q, D]
        keys, values = gather_kv(cache, meta.block_table[i], lens[i])
        k, v = (t.float().transpose(0, 1)[None] for t in (keys, values))   # [1, Hkv, S, D]
        module = torch.nn.Module()
        module.num_key_value_groups, module.sinks = q.shape[1] // k.shape[1], sinks
        module.training = False
        q_pos = torch.arange(lens[i] - q.shape[2], lens[i])[:, None]
        mask = torch.zeros(q.shape[2], lens[i]).masked_fill(
            torch.arange(lens[i])[None, :] > q_pos, float("-inf"))
        out, _ = eager.eager_attention_forward(module, q, k, v, mask[None, None],
                                               query.shape[2] ** -0.5)
        outs.append(out[0])                                                  # [Q, Hq, D]
    return torch.cat(outs)


def test_reference_loop_is_transformers_eager_attention():
    case = make_case(1, *MIXED, 4, 2, 16, 4, num_pad=2, device="cpu")
    sinks = sinks_for(4)
    torch.testing.assert_close(reference(case, sinks), transformers_eager(case, sinks),
                               atol=1e-5, rtol=1e-5)
    # the sinks are not a no-op on these scores
    assert not torch.allclose(reference(case, sinks), reference(case, None), atol=1e-3)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("batch", [MIXED, DECODE], ids=["mixed", "decode"])
def test_torch_batched_matches_the_loop(batch, window):
    case = make_case(2, *batch, 4, 2, 16, 4, num_pad=2, device="cpu")
    sinks = sinks_for(4, 2)
    torch.testing.assert_close(run(TorchAttentionBackend(), case, sinks, window),
                               reference(case, sinks, window), atol=1e-5, rtol=1e-5)


def test_the_explicit_math_counts_its_scores_against_the_bound(monkeypatch):
    """With sinks the batched path holds the [R, Hq, Q, L] scores and the repeated keys: its
    bound counts them, so a group that fits SDPA's scratch only takes the loop."""
    from kernels.attention.torch_batched import padded_bytes
    sdpa, explicit = padded_bytes(1, 33, 70, 4, 2, 16), padded_bytes(1, 33, 70, 4, 2, 16, True)
    assert explicit == sdpa + 4 * 2 * 1 * 4 * 70 * (16 + 33)
    from kernels.attention import torch_ref
    case = make_case(2, [70], [33], 4, 2, 16, 4, device="cpu")
    looped, loop = [], torch_ref.attend_requests
    monkeypatch.setattr(torch_ref, "attend_requests",
                        lambda *args: looped.append(args[3]) or loop(*args))
    backend = TorchAttentionBackend(max_padded_bytes=sdpa)      # between the two
    got = run(backend, case, sinks_for(4, 2))
    assert [list(ids) for ids in looped] == [[0]]               # the batched path declined
    torch.testing.assert_close(got, reference(case, sinks_for(4, 2)), atol=1e-5, rtol=1e-5)


def triton(**launch):
    return triton_backend.TritonAttentionBackend(launch=TritonLaunchConfig(**launch))


TILES = KernelTiles(block_n=16, num_warps=2, num_stages=1)


@needs_kernels
@pytest.mark.parametrize("dispatch", ["by_batch", "unified", "per_request"])
@pytest.mark.parametrize("window", [0, 8])
def test_triton_designs_match_the_reference(dispatch, window):
    backend = triton(prefill=TILES, decode=TILES, block_q_rows=16, dispatch=dispatch)
    case = make_case(4, *MIXED, 4, 2, 16, 4, num_pad=2)
    sinks = sinks_for(4, 4)
    torch.testing.assert_close(run(backend, case, sinks, window), reference(case, sinks, window),
                               atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [0, 20])
def test_triton_split_decode_adds_the_sink_once(splits, window):
    """Split decode: the sink joins the merged denominator once (_reduce_kernel), not per split."""
    case = make_case(5, *DECODE, 8, 2, 32, 16, num_pad=1)
    sinks = sinks_for(8, 5)
    got = run(triton(decode=TILES, decode_splits=splits), case, sinks, window)
    torch.testing.assert_close(got, reference(case, sinks, window), atol=2e-5, rtol=2e-5)


@needs_kernels
def test_triton_without_sinks_is_unchanged():
    case = make_case(6, *MIXED, 4, 2, 16, 4, num_pad=2)
    backend = triton(prefill=TILES, decode=TILES, block_q_rows=16)
    torch.testing.assert_close(run(backend, case, None), reference(case, None),
                               atol=2e-5, rtol=2e-5)


class NoSinksBackend(TorchAttentionBackend):
    name = "nosinks"
    supports_sinks = False


def test_a_layer_with_sinks_refuses_a_backend_without_them():
    with pytest.raises(ValueError, match="attention sinks: the 'nosinks' attention backend "
                                         "cannot apply them"):
        Attention(4, 2, 16, 0.25, NoSinksBackend(), sinks=True)
    Attention(4, 2, 16, 0.25, NoSinksBackend())                # no sinks: accepted


def test_flash_attn_does_not_claim_sinks():
    """flash-attn 2 has no sink argument: a GPT-OSS layer refuses it at load."""
    from kernels.attention.flash_attn_backend import FlashAttnBackend
    assert not FlashAttnBackend.supports_sinks


def test_invalid_sinks_are_refused():
    assert check_sinks(None, 4) is None
    assert check_sinks(torch.zeros(4, dtype=torch.bfloat16), 4).dtype == torch.float32
    for bad in (torch.zeros(3), torch.zeros(4, 1), [0.0] * 4):
        with pytest.raises(ValueError, match=r"sinks=.* is invalid: must be a tensor of shape "
                                             r"\[num_heads=4\]"):
            check_sinks(bad, 4)


def test_auto_skips_flash_attn_for_a_model_with_sinks(monkeypatch):
    """On CUDA `auto` would pick flash-attn; a layout with sinks goes to Triton instead, and
    naming flash-attn for it is refused naming the ones that apply sinks."""
    import importlib.util

    from kernels.attention import flash_attn_backend, selector
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(selector.importlib.util, "find_spec",
                        lambda name: object() if name in ("flash_attn", "triton")
                        else real_find_spec(name))
    monkeypatch.setattr(flash_attn_backend, "flash_attn_supports", lambda *args: True)
    plain = selector.CacheLayout(256, 64, torch.bfloat16)
    with_sinks = selector.CacheLayout(256, 64, torch.bfloat16, sinks=True)
    assert selector.resolve_backend_name("auto", "cuda", plain) == "flash_attn"
    assert selector.resolve_backend_name("auto", "cuda", with_sinks) == "triton"
    with pytest.raises(ValueError, match="flash-attn cannot apply its attention sinks; pick "
                                         "one that does: triton, cpu or torch"):
        selector.get_attention_backend("flash_attn", "cuda", with_sinks)


def test_the_runner_layout_of_gpt_oss_asks_for_sinks():
    from worker_service.config import RunnerConfig
    from worker_service.runner.model_runner import cache_layout
    cfg = {"num_attention_heads": 4, "hidden_size": 64, "head_dim": 16}
    config = RunnerConfig(model_dir="unused", dtype="float32")
    assert cache_layout({**cfg, "architectures": ["GptOssForCausalLM"]}, config).sinks
    assert not cache_layout({**cfg, "architectures": ["LlamaForCausalLM"]}, config).sinks
