"""fused_ops=True (Triton RMSNorm, rope with the q/k norm, SiLU-and-mul: kernels/fused_*.py)
gives the torch path's logits on the tiny qwen3 (q/k norm) and llama (llama3 rope) models,
through load_model and the offline LLM. Float32; on CPU the kernels run in Triton's interpreter,
so inputs stay short. With the Triton attention backend the fused rope also writes the KV cache
(kv_in_rope) and the backend skips its write: same logits and tokens as its own write."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kernels.attention.backend import AttentionMetadata  # noqa: E402
from kernels.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from worker_service.config import RunnerConfig  # noqa: E402
from worker_service.layers.norm import RMSNorm  # noqa: E402
from worker_service.models.loader import allocate_kv_caches, load_model  # noqa: E402
from worker_service.parallel_state import single_rank_group  # noqa: E402
from tests.support.paths import REPO

DEVICE = "cuda" if ON_GPU else "cpu"
REPO_ROOT = REPO
BLOCK_SIZE = 4
NUM_BLOCKS = 16
# float32: the fused norm sums squares in another order and divides by sqrt instead of rsqrt,
# a few float32 ulps per norm; the logits spread over several units.
ATOL = RTOL = 2e-5


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


pytestmark = pytest.mark.skipif(
    not ON_GPU and not _interpreted(),
    reason="triton was imported in compiled mode without a GPU (TRITON_INTERPRET unset)")


def _meta(query_lens: list[int], seq_lens: list[int], num_pad: int):
    """(positions, AttentionMetadata) for requests i = 0.. owning blocks 4i .. 4i+3, each
    scheduling its last query_lens[i] tokens of seq_lens[i]; num_pad padded rows at the end."""
    positions, slots, starts = [], [], [0]
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        p = torch.arange(s - q, s)
        positions.append(p)
        slots.append((4 * i + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE)
        starts.append(starts[-1] + q)
    positions.append(torch.zeros(num_pad, dtype=torch.long))
    slots.append(torch.full((num_pad,), -1, dtype=torch.long))
    table = torch.arange(4 * len(seq_lens), dtype=torch.int32).view(len(seq_lens), 4)
    qsl = torch.tensor(starts, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=starts[-1], max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl.to(DEVICE), seq_lens=lens.to(DEVICE),
        block_table=table.to(DEVICE), slot_mapping=torch.cat(slots).to(DEVICE),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    return torch.cat(positions).to(DEVICE), meta


def _run_steps(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prefill both sequences but their last token (with padded rows), then decode the last
    token of each; returns each step's logits."""
    caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE, DEVICE)
    lens = [len(s) for s in seqs]
    out = []
    for query_lens, seq_lens, num_pad in (([n - 1 for n in lens], [n - 1 for n in lens], 2),
                                          ([1] * len(seqs), lens, 0)):
        positions, meta = _meta(query_lens, seq_lens, num_pad)
        ids = torch.cat([s[e - q:e] for s, q, e in zip(seqs, query_lens, seq_lens)]
                        + [torch.zeros(num_pad, dtype=torch.long)]).to(DEVICE)
        with torch.no_grad():
            hidden = model(ids, positions, caches, meta)
            out.append(model.compute_logits(hidden[:meta.num_actual_tokens]))
    return out


def _load(model_dir: str, fused_ops: bool, backend: str = "torch"):
    from kernels.attention.triton_backend import TritonAttentionBackend
    attn = TritonAttentionBackend() if backend == "triton" else TorchAttentionBackend()
    return load_model(model_dir, single_rank_group(), attn, DEVICE, "float32",
                      fused_ops=fused_ops)


@pytest.mark.parametrize("arch,backend", [("qwen3", "torch"), ("llama", "torch"),
                                          ("qwen3", "triton"), ("llama", "triton")])
def test_fused_ops_give_the_same_logits(tiny_models, arch, backend):
    model_dir = tiny_models(arch)
    plain, fused = _load(model_dir, False, backend), _load(model_dir, True, backend)
    # the rope writes the cache only when fused and the backend allows it
    assert [m.self_attn.kv_in_rope for m in fused.model.layers] == [backend == "triton"] * 2
    assert not any(m.self_attn.kv_in_rope for m in plain.model.layers)
    norms = [m for m in fused.modules() if isinstance(m, RMSNorm)]
    # qwen3: 2 layers x (input, post-attention, q, k) + final; llama: 2 x 2 + final
    assert len(norms) == (9 if arch == "qwen3" else 5) and all(n.fused for n in norms)
    assert fused.fused_ops and fused.model.layers[0].self_attn.rotary_emb.fused
    assert not any(m.fused for m in plain.modules() if isinstance(m, RMSNorm))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (n,), generator=gen) for n in (9, 5)]
    for step, (want, got) in enumerate(zip(_run_steps(plain, seqs), _run_steps(fused, seqs))):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=f"step {step}")


@pytest.mark.parametrize("arch", ["olmo2", "granite"])
def test_olmo2_and_granite_through_the_rope_that_writes_the_cache(tiny_models, arch):
    """Their own attention forwards (OLMo 2's whole-projection q/k norm, Granite's scaled
    output) on the Triton backend: the fused rope writes the KV cache, same logits as torch."""
    model_dir = tiny_models(arch)
    plain, fused = _load(model_dir, False, "triton"), _load(model_dir, True, "triton")
    assert all(m.self_attn.kv_in_rope for m in fused.model.layers)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (n,), generator=gen) for n in (9, 5)]
    for step, (want, got) in enumerate(zip(_run_steps(plain, seqs), _run_steps(fused, seqs))):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=f"step {step}")


@pytest.mark.parametrize("arch,overrides", [
    ("phi3", {"partial_rotary_factor": 0.75, "sliding_window": None}),    # Phi-4-mini's
    ("qwen3", {"partial_rotary_factor": 0.5}),          # with the q/k norm over whole heads
], ids=["phi4mini", "qwen3-qk-norm"])
def test_partial_rotary_through_the_triton_rope_that_writes_the_cache(tiny_models, arch,
                                                                       overrides):
    """Partial rotary on the fused rope: only the first rotary_dim dims of each head rotate,
    the tail is normalised with the head and stored with the keys; same logits as torch."""
    model_dir = tiny_models(arch, **overrides)
    plain, fused = _load(model_dir, False, "triton"), _load(model_dir, True, "triton")
    rope = fused.model.layers[0].self_attn.rotary_emb
    assert rope.kernel == "triton" and rope.rotary_dim < rope.head_dim
    assert all(m.self_attn.kv_in_rope for m in fused.model.layers)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (n,), generator=gen) for n in (9, 5)]
    for step, (want, got) in enumerate(zip(_run_steps(plain, seqs), _run_steps(fused, seqs))):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=f"step {step}")


@pytest.mark.parametrize("arch,overrides", [
    ("smollm3", {"num_hidden_layers": 2}),   # layer 1 NoPE: the backend writes its cache
    ("gemma", {}), ("starcoder2", {}),
    ("qwen3", {"max_position_embeddings": 256,           # YaRN: cos/sin x attention factor
               "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 64}}),
    ("glm4", {}), ("cohere", {}),            # interleaved pairs served by reordered q/k rows
    ("cohere2", {}),                         # its full layer has no rope: the backend writes it
], ids=["smollm3", "gemma", "starcoder2", "qwen3-yarn", "glm4", "cohere", "cohere2"])
def test_newer_models_through_the_triton_rope_that_writes_the_cache(tiny_models, arch,
                                                                     overrides):
    """Each rope layer's fused rope writes its KV cache; SmolLM3's NoPE layers have no rope
    to fuse, so the Triton backend writes theirs: same logits as torch."""
    model_dir = tiny_models(arch, **overrides)
    plain, fused = _load(model_dir, False, "triton"), _load(model_dir, True, "triton")
    has_rope = [m.self_attn.rotary_emb.kernel != "none" for m in fused.model.layers]
    assert [m.self_attn.kv_in_rope for m in fused.model.layers] == has_rope
    assert any(has_rope) and (all(has_rope) or arch in ("smollm3", "cohere2"))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (n,), generator=gen) for n in (9, 5)]
    for step, (want, got) in enumerate(zip(_run_steps(plain, seqs), _run_steps(fused, seqs))):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=f"step {step}")


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_llm_with_fused_ops_generates_the_same_tokens(tiny_models, backend):
    from deltaserve.llm import LLM
    from engine_common.request.params import SamplingParams, StoppingParams

    model_dir = tiny_models("qwen3")
    prompts = [[5, 9, 31, 7, 2, 11], [40, 3, 3]]
    stopping = StoppingParams(max_tokens=4, ignore_eos=True)
    runs = {}
    for fused_ops in (False, True):
        llm = LLM(model_dir, dtype="float32", device=DEVICE, num_kv_blocks=16,
                  fused_ops=fused_ops, attention_backend=backend)
        assert llm.runner.config.fused_ops is fused_ops
        layers = llm.runner.model.model.layers
        runs[fused_ops] = ([o.token_ids for o in llm.generate(prompts, SamplingParams(),
                                                               stopping)],
                           getattr(llm.runner.model, "fused_ops", False),
                           layers[0].self_attn.kv_in_rope, layers[0].self_attn.attn.backend.name)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] and not runs[False][1]
    # auto resolves to "cpu" or "torch" on the CPU, maybe "triton" on a GPU
    assert runs[True][2] == (runs[True][3] == "triton") and not runs[False][2]
    assert backend == "auto" or runs[True][3] == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_norm_reads_strided_q_views(dtype):
    """The per-head q norm of qwen3 gets q as a strided [T, H, D] view of the qkv projection;
    the fused norm reads it through its strides (residual form too) and matches torch."""
    from kernels.fused_norm import rms_norm

    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(16, 1e-6, dtype).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(16, generator=gen))
    qkv = (2 * torch.randn(5, 8 * 16, generator=gen)).to(dtype).to(DEVICE)
    q = qkv[:, 16:5 * 16].view(5, 4, 16)                     # strides (128, 16, 1)
    res = qkv[:, :4 * 16].view(5, 4, 16)
    with torch.no_grad():
        want, (want_out, want_res) = norm(q), norm(q, res)
        got, (got_out, got_res) = rms_norm(q, norm.weight, 1e-6), rms_norm(q, norm.weight,
                                                                              1e-6, res)
    tol = 1e-6 if dtype == torch.float32 else 3 * 2.0 ** -7  # bf16: interpreter truncation
    for g, w in ((got, want), (got_out, want_out), (got_res, want_res)):
        assert g.shape == (5, 4, 16) and g.is_contiguous()
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


def test_runner_config_defaults_to_torch_ops():
    assert RunnerConfig(model_dir="m").fused_ops is False


def test_fused_ops_refused_where_triton_cannot_run(tiny_models):
    with pytest.raises(ValueError, match="fused_ops=True on device='meta'"):
        load_model(tiny_models("qwen3"), single_rank_group(), TorchAttentionBackend(), "meta",
                   fused_ops=True)
    # a fresh process without TRITON_INTERPRET: Triton kernels cannot run on the CPU there
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    script = ("from worker_service.models.loader import check_fused_ops_device\n"
              "try:\n    check_fused_ops_device('cpu')\nexcept ValueError as e:\n"
              "    print('refused:', e)\n")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert "refused: fused_ops=True on device='cpu'" in result.stdout, result.stderr[-2000:]
