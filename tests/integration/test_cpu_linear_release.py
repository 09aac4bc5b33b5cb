"""A loaded CPU model's dense linears let their parameters go once packed
(layers/cpu_kernels.release_dense_weights): the greedy tokens are those of the same model
with every parameter kept, float32 and bfloat16, tied head or not, prefill (oneDNN / MKL rows)
and decode (panels) steps; and the float32 engine still equals transformers."""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from kernels.cpu import extension
from kernels.cpu import linear as cpu_linear
from tests.support.engine_checks import _check, _prompts
from worker_service.layers import cpu_kernels
from worker_service.layers.linear import ColumnParallelLinear
from worker_service.parallel_state import single_rank_group

pytestmark = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


def _greedy(model_dir: str, dtype: str) -> tuple[list[list[int]], object]:
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=64)
    outs = llm.generate(_prompts(500)[:6], SamplingParams(),
                        StoppingParams(max_tokens=6, ignore_eos=True))
    return [o.token_ids for o in outs], llm.runner.model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [True, False])
def test_released_parameters_leave_the_greedy_tokens_unchanged(tiny_models, monkeypatch,
                                                                dtype, tied):
    path = tiny_models("llama", tie_word_embeddings=tied)
    released, model = _greedy(path, dtype)
    proj, head = model.model.layers[0].mlp.down_proj, model.lm_head
    # A CpuLinear that reads the dense weight keeps it as its one copy beside the panels:
    # bfloat16 where oneDNN has no bf16 kernel (an AVX2 CPU: MKL's cblas_gemm_bf16bf16f32
    # reads W); every other is released.
    if proj.cpu_linear.weight is None:
        assert proj.weight.isnan().all() and proj.weight.untyped_storage().nbytes() <= 4
    else:
        assert dtype == "bfloat16" and not proj.weight.isnan().any()
    assert head.weight.isnan().all() == (not tied and head.cpu_linear.weight is None)
    assert head.cpu_linear.calls > 0
    monkeypatch.setattr(cpu_kernels, "release_dense_weights", lambda m, holders=None: 0)
    kept, kept_model = _greedy(path, dtype)
    assert not torch.isnan(kept_model.model.layers[0].mlp.down_proj.weight).any()
    assert released == kept


def test_a_tied_head_still_equals_transformers(tiny_models):
    path = tiny_models("llama", tie_word_embeddings=True)
    llm = LLM(path, dtype="float32", num_kv_blocks=128)
    assert llm.runner.model.lm_head_is_tied
    _check(llm, path, _prompts(500), "llama-tied/cpu-kernels")


def test_each_linear_lets_go_before_the_next_one_packs(monkeypatch):
    """The load's peak: one linear's parameter beside its panels and pack, never every
    linear's (RSS one dense copy over the memory check's budget until the last layer was
    packed)."""
    layers = torch.nn.ModuleList(ColumnParallelLinear(64, 64, False, single_rank_group(),
                                                      torch.float32) for _ in range(3))
    for layer in layers:
        torch.nn.init.normal_(layer.weight)
    seen = []
    prepare = cpu_linear.prepare

    def watched(*args, **kwargs):
        seen.append([m.dense_released for m in layers if m.cpu_linear is not None])
        return prepare(*args, **kwargs)

    monkeypatch.setattr(cpu_linear, "prepare", watched)
    assert cpu_kernels.use_cpu_kernels(layers) == 3
    assert seen == [[], [True], [True, True]]
    assert all(m.dense_released for m in layers)
