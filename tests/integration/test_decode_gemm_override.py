"""bench/decode_gemm_override.py wraps every projection of a started engine (not the LM head),
and the wrapped engine still generates what it did: on CPU the wrapper hands every call to the
layer's own path (the split-K kernel is for CUDA inputs)."""
from __future__ import annotations

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams


def test_every_projection_is_wrapped_and_tokens_are_unchanged(tiny_models):
    from bench.decode_gemm_override import apply_decode_gemm

    llm = LLM(tiny_models("qwen3"), dtype="float32", num_kv_blocks=64, max_num_seqs=4,
              max_model_len=128)
    params = (SamplingParams(temperature=0.0), StoppingParams(max_tokens=6, ignore_eos=True))
    prompts = [[5, 6, 7, 8], [9, 10]]
    before = [c.token_ids for c in llm.generate(prompts, *params)]
    layers = llm.runner.model.model.layers
    # qkv, o, gate_up, down per layer; no tile timed on CPU
    assert apply_decode_gemm(llm) == f"split-K Triton in {4 * len(layers)} linear layers"
    assert "matmul" in vars(layers[0].self_attn.o_proj)
    assert "matmul" not in vars(llm.runner.model.lm_head)
    assert [c.token_ids for c in llm.generate(prompts, *params)] == before
