"""DeepSeek-V2 / V3 (layers/mla.py) attending on the C++ CPU kernel (`--attention-backend cpu`,
kernels/cpu/csrc/attention_latent.h for the released latent) through the in-process engine:
greedy tokens equal transformers' generate() in float32, with whole and chunked prefills
batched with decodes, for

  - the tiny builders' latent (kv_lora_rank 48 + rope 16 = 64: the kernel attends the whole
    64 and the layer keeps the first 48),
  - the released latent (512 + 64 = 576, values its first 512, read from the same cached row),
    with 16 heads (V2-Lite's) and with 64 (past one tile of 48: the kernel's head tiles);

preempted and recomputed requests on the latent body (49 heads: tiles of 48 and 1); a 576
latent whose value is wider than the kernel's 512 (544 + 32) served on torch by `auto` and
refused by name for `cpu`; and tensor parallelism: two gloo ranks on the kernel give the single
torch rank's logits."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from kernels.attention import cpu_paged
from tests.integration.test_model_coverage_preemption import prompts as preemption_prompts
from tests.support.engine_checks import _check, _prompts
from tests.support.paged_prefill import assert_tp2_matches_tp1
from worker_service.layers.mla import MLAAttention
from worker_service.models.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="deltaserve_cpu not built")

RELEASED = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64}
CASES = [
    ("deepseek_v2", {}),
    ("deepseek_v3", {}),
    ("deepseek_v2", {**RELEASED, "num_attention_heads": 16, "num_key_value_heads": 16}),
    ("deepseek_v3", {**RELEASED, "num_attention_heads": 64, "num_key_value_heads": 64}),
]


@pytest.mark.parametrize("arch,overrides", CASES,
                         ids=["v2-tiny", "v3-tiny", "v2-576x16", "v3-576x64"])
def test_engine_greedy_on_the_cpu_kernel_matches_transformers(tiny_models, arch, overrides):
    path = tiny_models(arch, **overrides)
    llm = LLM(path, dtype="float32", attention_backend="cpu", num_kv_blocks=128,
              max_num_batched_tokens=24, max_num_seqs=8)
    layers = [m for m in llm.runner.model.modules() if isinstance(m, MLAAttention)]
    assert layers and llm.runner.attention_backend_name == "cpu"
    backend = layers[0].attn.backend
    assert isinstance(backend, cpu_paged.CpuPagedAttentionBackend)
    _check(llm, path, _prompts(llm.model_info.vocab_size), f"{arch}/cpu-kernel")
    assert backend.calls > 0 and backend.capped_calls == 0


def test_auto_picks_the_cpu_kernel_for_the_released_latent(tiny_models):
    llm = LLM(tiny_models("deepseek_v3", **RELEASED), dtype="float32", num_kv_blocks=16)
    assert llm.runner.attention_backend_name == "cpu"
    assert llm.runner.model.head_dim == 576


def test_preempted_chunked_requests_on_the_latent_body_match_transformers(tiny_models):
    """The released latent (576, 48 + 1 heads: a head tile of 48 and one of 1) on the kernel
    with a cache too small for the four requests together: they preempt and recompute, chunks
    of 10 end inside blocks of 4, a shared prefix hits; no block leaked (_check)."""
    path = tiny_models("deepseek_v3", seed=4, **RELEASED, num_attention_heads=49,
                       num_key_value_heads=49)
    llm = LLM(path, dtype="float32", attention_backend="cpu", block_size=4, num_kv_blocks=20,
              max_num_seqs=4, max_num_batched_tokens=10)
    sched = llm.scheduler
    preempted = []
    preempt = sched._preempt

    def counted(request, plan):
        preempted.append(request.request_id)
        preempt(request, plan)
    sched._preempt = counted
    outs = _check(llm, path, preemption_prompts(llm.model_info.vocab_size), "576x49",
                  max_new=30)
    assert preempted, "the four requests should not have fit together"
    assert outs[1].num_cached_tokens >= 24, outs[1].num_cached_tokens


def test_a_576_latent_whose_value_is_wider_than_512_is_left_to_torch(tiny_models):
    """kv_lora_rank 544 + rope 32 is 576 too, but its value (544) is past the kernel's 512:
    `auto` picks torch and the engine serves it (it picked the kernel, which failed at the
    first step); `cpu` named for it is refused by name, by preflight and by the model."""
    from kernels.attention.torch_ref import TorchAttentionBackend
    from worker_service.config import RunnerConfig
    from worker_service.models.loader import load_model
    from worker_service.parallel_state import single_rank_group
    from worker_service.runner.preflight import check_runner_config
    path = tiny_models("deepseek_v3", kv_lora_rank=544, qk_rope_head_dim=32, head_dim=32)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24,
              max_num_seqs=8)
    assert llm.runner.attention_backend_name == "torch" and llm.runner.model.head_dim == 576
    layers = [m for m in llm.runner.model.modules() if isinstance(m, MLAAttention)]
    assert layers and all(isinstance(m.attn.backend, TorchAttentionBackend) for m in layers)
    _check(llm, path, _prompts(llm.model_info.vocab_size)[:2], "deepseek_v3/544+32")
    why = r"attention_backend='cpu' is invalid .* head size 576 with a value of 544 dims"
    with pytest.raises(ValueError, match=why):
        check_runner_config(RunnerConfig(model_dir=path, device="cpu", dtype="float32",
                                         num_kv_blocks=16, attention_backend="cpu"))
    with pytest.raises(ValueError, match=why):
        load_model(path, single_rank_group(), cpu_paged.CpuPagedAttentionBackend(), "cpu")


@pytest.mark.slow
def test_tp2_on_the_cpu_kernel_matches_tp1(tmp_path):
    """Two ranks (2 of the 4 heads each, on the released latent) on the kernel."""
    paths = [make_tiny_model(tmp_path / arch, arch=arch, seed=3, **RELEASED)
             for arch in ("deepseek_v2", "deepseek_v3")]
    # the released latent sums 576 products per score in another order than torch's matmul
    # (test_deepseek_vs_transformers' real-latent case allows 3e-4 against transformers)
    assert_tp2_matches_tp1(paths, tmp_path, backend="cpu", atol=3e-4)
