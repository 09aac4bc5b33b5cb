"""The engine path of tests/gpu/test_hybrid_rope_cuda.py and test_mla_cuda.py (the Triton
backend, fused ops and async scheduling: the CUDA defaults) on the CPU under Triton's
interpreter, float32 against transformers' greedy tokens, so each kernel those CUDA tests
compile has run here first. Skipped where CUDA is present (Triton compiles for the GPU there:
the CUDA tests run instead) or where triton was imported in compiled mode.

Short: three prompts (3, 17 and 40 tokens, the third twice so its first 32 tokens come from
the prefix cache), 6 greedy tokens each, blocks of 16, 16 tokens a step (the 40-token prompt
prefills in chunks beside the others' decodes). The 576-wide latent is slow in the
interpreter: marked slow.
"""
from __future__ import annotations

import pytest
import torch

from engine_common.request.params import SamplingParams, StoppingParams
from tests.gpu.test_hybrid_rope_cuda import FAMILIES as HYBRID_ROPE
from tests.gpu.test_mla_cuda import FAMILIES as MLA
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy

FAMILIES = {**HYBRID_ROPE, **MLA}
MAX_NEW = 6


def _interpreted() -> bool:
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(triton.language.zeros, InterpretedFunction)


pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(),
                       reason="CUDA present: Triton compiles for the GPU (the CUDA tests run)"),
    pytest.mark.skipif(not torch.cuda.is_available() and not _interpreted(),
                       reason="triton was imported in compiled mode (TRITON_INTERPRET unset)")]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in MLA else n
                                  for n in FAMILIES])
def test_cuda_engine_path_under_the_interpreter(tiny_models, name):
    from deltaserve.llm import LLM
    from tests.gpu.test_engine_bf16 import _prompts

    fam = FAMILIES[name]
    path = tiny_models(fam.arch, **fam.overrides)
    llm = LLM(path, dtype="float32", device="cpu", attention_backend="triton", fused_ops=True,
              async_scheduling=True, block_size=16, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=16)
    runner = llm.runner
    assert runner.attention_backend_name == "triton"
    assert {c.shape[-1] for c in runner.kv_caches} == {fam.head_size}
    assert [c.stride(0) == 0 for c in runner.kv_caches] == \
        [fam.shared_halves] * len(runner.kv_caches)
    assert (runner.window_group is not None) == fam.hybrid
    prompts = _prompts(llm.model_info.vocab_size)[:3]
    prompts.append(list(prompts[2]))
    outs = llm.generate(prompts[:3], SamplingParams(), StoppingParams(max_tokens=MAX_NEW,
                                                                      ignore_eos=True))
    outs += llm.generate(prompts[3:], SamplingParams(), StoppingParams(max_tokens=MAX_NEW,
                                                                       ignore_eos=True))
    near_ties, failures = [], []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        failure = compare_greedy(f"{name}/interpreted/prompt{i}(len {len(p)})", out.token_ids,
                                 hf_greedy(path, tuple(p), MAX_NEW), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
    assert outs[3].num_cached_tokens == 32
    assert_no_leaked_blocks(llm)
