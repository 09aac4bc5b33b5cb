"""Native CPU GPTQ weights (layers/quant_linear.py) under LoRA and in the worker's memory:
a LoRA adapter on a GPTQ base served natively gives transformers + peft's greedy tokens on the
dequantized twin (float32 path switched on, as test_quant_native_cpu.py does), and loading a
model natively leaves about its packed bytes resident, not the load's freed transients
(models/heap_trim.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.lora_adapters import make_adapter, peft_greedy
from tests.support.paths import REPO
from tests.support.quant_models import make_quantized_pair
from worker_service.layers import quant_linear

MAX_NEW = 8

# RSS growth of load_model in a fresh process, and the model's packed bytes
_RSS_SCRIPT = """
import ctypes, ctypes.util, gc, json, sys
from kernels.attention.torch_ref import TorchAttentionBackend
from kernels.cpu import extension
from worker_service.layers.quant_linear import QuantLinear
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group

def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                if l.startswith("VmRSS"))

def load():
    return load_model(sys.argv[1], single_rank_group(), TorchAttentionBackend(), "cpu",
                      "bfloat16", cpu_quantized_weights=sys.argv[2])

# A first load takes the imports and the allocator's arenas (tens of MiB that vary by machine);
# the second one's growth is the model's own.
extension.load()
model = load()
del model
gc.collect()
ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
before = rss()
model = load()
gc.collect()
layers = [m.cpu_linear for m in model.modules()
          if isinstance(getattr(m, "cpu_linear", None), QuantLinear)]
loaded = rss()
ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
print(json.dumps({"growth": loaded - before, "left_to_trim": loaded - rss(),
                  "packed": sum(q.nbytes for q in layers),
                  "dense": sum(q.out_features * q.in_features * 2 for q in layers)}))
"""


def test_lora_on_a_native_gptq_base_matches_peft_on_the_twin(tiny_models, tmp_path,
                                                             monkeypatch):
    monkeypatch.setattr(quant_linear, "NATIVE_DTYPES", (torch.bfloat16, torch.float32))
    quantized, twin = make_quantized_pair(tiny_models("qwen3"), tmp_path / "q", "gptq",
                                          group_size=32, act_order=False)
    adapter = make_adapter(str(twin), tmp_path / "a", r=8, alpha=32, seed=1)
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=64, enable_lora=True,
              lora_modules=f"a={adapter}", max_loras=1)
    prompts = [[5, 9, 13, 22, 40, 7], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    names = ["a", None, "a"]
    outs = llm.generate(prompts, SamplingParams(), StoppingParams(max_tokens=MAX_NEW,
                                                                 ignore_eos=True),
                        lora_request=names)
    for prompt, name, out in zip(prompts, names, outs):
        want = peft_greedy(str(twin), adapter if name else None, tuple(prompt), MAX_NEW)
        assert tuple(out.token_ids) == want.token_ids, (name, prompt)
    packed = [m.cpu_linear for m in llm.runner.model.modules()
              if isinstance(getattr(m, "cpu_linear", None), quant_linear.QuantLinear)]
    assert len(packed) == 8 and all(q.calls for q in packed)    # 2 layers x 4 linears
    base = peft_greedy(str(twin), None, tuple(prompts[0]), MAX_NEW).token_ids
    assert tuple(outs[0].token_ids) != base          # the adapter changed the tokens


@pytest.mark.slow         # builds and quantizes a 100 MB model: a minute or two on 2 cores
def test_native_load_keeps_about_the_packed_bytes_resident(tiny_models, tmp_path):
    """A 4-layer qwen3 of hidden 768 (25M linear parameters: 50 MiB in bfloat16, 13 MiB
    packed): without the heap trim the native load grew RSS by 57-79 MiB, 22-44 of them
    freed transients a malloc_trim then released; with it ~35 MiB (imports included). The
    script measures a second load (the first takes the imports, which vary by machine)."""
    src = tiny_models("qwen3", hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=96)
    quantized, _ = make_quantized_pair(src, tmp_path / "q", "gptq", group_size=128,
                                       act_order=False)
    run = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(quantized), "native"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["packed"] * 3 < got["dense"]
    assert got["left_to_trim"] < got["dense"] / 10, got
    assert got["growth"] < got["dense"], got
