"""A LoRA adapter on a bfloat16 GPTQ / AWQ int4 base served natively, with prefills of 8+ rows
(int4_gemm's many-row kernel where the CPU has it): the greedy tokens of the dequantized load
(the bfloat16 rule of test_quant_native_cpu.py), the first token of transformers + peft on the
dequantized twin in bfloat16, and the adapter changes them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from kernels.cpu import int4_gemm
from tests.support.lora_adapters import make_adapter, peft_model
from tests.support.quant_models import make_quantized_pair
from worker_service.layers import quant_linear

MAX_NEW = 6
NATIVE = {"gptq": {"group_size": 32, "act_order": False}, "awq": {"group_size": 32}}
PROMPTS = [list(range(5, 17)), [3, 4, 5, 6, 7, 8, 9, 10, 30, 31], list(range(40, 60))]
NAMES = ["a", None, "a"]


def bfloat16_copy(path: Path) -> str:
    """The model dir with config dtype bfloat16 (the native kernels' dtype)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def peft_bf16_greedy(model_dir: str, adapter_dir: str | None, prompt: list[int]) -> tuple:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = peft_model(model_dir, adapter_dir, torch.bfloat16).generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=MAX_NEW, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def served(model: str, adapter: str, mode: str) -> tuple[list[tuple], LLM]:
    llm = LLM(model, dtype="bfloat16", num_kv_blocks=64, enable_lora=True,
              lora_modules=f"a={adapter}", max_loras=1, cpu_quantized_weights=mode)
    outs = llm.generate(PROMPTS, SamplingParams(),
                        StoppingParams(max_tokens=MAX_NEW, ignore_eos=True), lora_request=NAMES)
    return [tuple(o.token_ids) for o in outs], llm


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_lora_on_a_bfloat16_int4_base_at_many_rows(tiny_models, tmp_path, fmt):
    quantized, twin = make_quantized_pair(tiny_models("qwen3"), tmp_path / "q", fmt,
                                          **NATIVE[fmt])
    adapter = make_adapter(str(twin), tmp_path / "a", r=8, alpha=32, seed=1)
    model = bfloat16_copy(quantized)
    native, llm = served(model, adapter, "native")
    packed = [m.cpu_linear for m in llm.runner.model.modules()
              if isinstance(getattr(m, "cpu_linear", None), quant_linear.QuantLinear)]
    assert packed and all(q.calls for q in packed)
    if int4_gemm.wanted(min(map(len, PROMPTS))):
        assert all(q.many_row_calls for q in packed)
    dequantized, _ = served(model, adapter, "dequantize")
    assert native == dequantized
    # peft's bfloat16 sums run in another order: its greedy tokens part from ours a few steps
    # in (prompt 0, step 5, after a step whose float32 top-2 margin is 0.04; both loads give
    # peft's float32 tokens with dtype float32); the many-row prefill's token is checked
    for prompt, name, got in zip(PROMPTS, NAMES, native):
        want = peft_bf16_greedy(str(twin), adapter if name else None, prompt)
        assert got[0] == want[0], (name, prompt, got, want)
    assert native[0] != peft_bf16_greedy(str(twin), None, PROMPTS[0])   # the adapter acts
