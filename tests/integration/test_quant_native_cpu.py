"""GPTQ / AWQ checkpoints kept packed on the CPU (--cpu-quantized-weights native, the default;
layers/quant_linear.py): the linears of a bfloat16 model run torch's int4 / int8 kernels; with
the (scalar, so not used by default) float32 path switched on, greedy tokens equal
transformers' on the dequantized twin in float32 and TP=2 ranks agree with one; act order,
groups the kernels cannot take and float32 models by default stay dequantized; the memory
estimate counts the packed size."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from deltaserve.llm import LLM
from engine_common.model_files.model_dir import ModelInfo
from kernels.attention.torch_ref import TorchAttentionBackend
from kernels.cpu import int4_gemm
from tests.support.engine_checks import _check, _prompts
from tests.support.grpc_harness import free_port
from tests.support.paged_prefill import prefill_logits, tp_ids, tp_worker
from tests.support.quant_models import make_quantized_pair
from worker_service.config import RunnerConfig
from worker_service.layers import quant_linear
from worker_service.layers.quant_linear import QuantLinear
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group
from worker_service.runner.memory_fit import kv_room_bytes

# qwen3 tiny: 2 layers x (qkv, o, gate_up, down)
LINEARS = 8
NATIVE = {"gptq": {"group_size": 32, "act_order": False}, "awq": {"group_size": 32},
          "gptq8": {"group_size": -1}}

# some tests compare the weights the loader writes, read back from the parameters
pytestmark = pytest.mark.usefixtures("keep_dense_weights")


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-native")
    cache = {}

    def get(fmt: str, **kwargs):
        key = (fmt, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = make_quantized_pair(tiny_models("qwen3"), root / str(len(cache)), fmt,
                                             **kwargs)
        return cache[key]
    return get


@pytest.fixture
def float32_native(monkeypatch):
    monkeypatch.setattr(quant_linear, "NATIVE_DTYPES", (torch.bfloat16, torch.float32))


def load(path, mode="native", dtype="float32"):
    return load_model(path, single_rank_group(), TorchAttentionBackend(), "cpu", dtype,
                      cpu_quantized_weights=mode)


def packed_layers(model) -> list[QuantLinear]:
    return [m.cpu_linear for m in model.modules()
            if isinstance(getattr(m, "cpu_linear", None), QuantLinear)]


@pytest.mark.parametrize("fmt", sorted(NATIVE))
def test_native_logits_match_the_dequantized_load(pair, fmt, float32_native):
    quantized, _ = pair(fmt, **NATIVE[fmt])
    native, dense = load(quantized), load(quantized, "dequantize")
    layers = packed_layers(native)
    assert len(layers) == LINEARS and not packed_layers(dense)
    assert {q.kind for q in layers} == {"int8" if fmt == "gptq8" else "int4"}
    got, want = prefill_logits(native, tp_ids()), prefill_logits(dense, tp_ids())
    assert all(q.calls for q in layers)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # the dense weight of a packed layer is never written: one NaN seen as [out, in]
    weight = native.model.layers[0].mlp.down_proj.weight
    assert weight.untyped_storage().nbytes() == 4 and weight.isnan().all()


def test_bfloat16_logits_within_the_kernels_rounding(pair):
    """bfloat16: scale and zero are kept in bfloat16 (the kernel's rule), one rounding more
    than the dequantized weight: logits agree to bfloat16's precision, not bit for bit."""
    quantized, _ = pair("awq", **NATIVE["awq"])
    got = prefill_logits(load(quantized, dtype="bfloat16"), tp_ids()).float()
    want = prefill_logits(load(quantized, "dequantize", dtype="bfloat16"), tp_ids()).float()
    assert float((got - want).abs().max() / want.abs().max()) < 5e-2


def greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens, each step the whole sequence prefilled again (every step many rows)."""
    for _ in range(steps):
        ids = torch.cat([ids, prefill_logits(model, ids)[-1].argmax().view(1)])
    return ids[-steps:].tolist()


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_bfloat16_greedy_matches_the_dequantized_twin(pair, fmt):
    """bfloat16 prefills of 19+ rows take int4_gemm's kernel where the CPU has it: the same
    greedy tokens as the dequantized load."""
    quantized, _ = pair(fmt, **NATIVE[fmt])
    native = load(quantized, dtype="bfloat16")
    dense = load(quantized, "dequantize", dtype="bfloat16")
    assert greedy(native, tp_ids(), 8) == greedy(dense, tp_ids(), 8)
    layers = packed_layers(native)
    assert all(q.calls for q in layers)
    if int4_gemm.wanted(len(tp_ids())):
        assert all(q.many_row_calls == 8 for q in layers)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_greedy_matches_transformers_on_the_twin(pair, fmt, float32_native):
    quantized, twin = pair(fmt, **NATIVE[fmt])
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, str(twin), _prompts(llm.model_info.vocab_size)[:6], f"native/{fmt}")


@pytest.mark.parametrize("fmt,kwargs", [("gptq", {"group_size": 32}),   # act order
                                        ("gptq", {"group_size": 16, "act_order": False}),
                                        ("gptq8", {"group_size": 16})])
def test_what_the_kernels_cannot_take_loads_dequantized(pair, fmt, kwargs, float32_native):
    quantized, twin = pair(fmt, **kwargs)
    model = load(quantized)
    assert not packed_layers(model)
    want = dict(load(twin).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, want[name]), name


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(pair, tmp_path):
    """Two gloo ranks, each packing its band (column-parallel output rows, row-parallel
    groups), in bfloat16 (the spawned ranks take the default NATIVE_DTYPES)."""
    path = pair("awq", **NATIVE["awq"])[0]
    bf16 = tmp_path / "bf16"
    shutil.copytree(path, bf16)
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(cfg))
    one = load(bf16, dtype="auto")
    assert len(packed_layers(one)) == LINEARS
    want = prefill_logits(one, tp_ids()).float()
    mp.spawn(tp_worker, args=(free_port(), [str(bf16)], str(tmp_path), 2), nprocs=2)
    got = [torch.load(tmp_path / f"logits_0_{rank}.pt") for rank in (0, 1)]
    assert torch.equal(got[0], got[1])                  # both ranks hold the reduced sum
    # each rank's partial products are rounded to bfloat16 before the all-reduce
    assert float((got[0].float() - want).abs().max() / want.abs().max()) < 5e-2


def test_float32_models_stay_dequantized_by_default(pair):
    """torch's float32 int4 kernel is scalar: a float32 model keeps the dequantized GEMMs."""
    quantized, _ = pair("awq", **NATIVE["awq"])
    assert not packed_layers(load(quantized))
    assert len(packed_layers(load(quantized, dtype="bfloat16"))) == LINEARS


def test_memory_estimate_counts_the_packed_size(pair):
    quantized, _ = pair("awq", **NATIVE["awq"])
    info = ModelInfo.from_dir(quantized)
    room = {mode: kv_room_bytes(RunnerConfig(model_dir=str(quantized), device="cpu",
                                             dtype="bfloat16", cpu_quantized_weights=mode),
                                info, 1, 1, machine_bytes=1 << 40)[1]
            for mode in ("native", "dequantize")}
    model = load(quantized, dtype="bfloat16")
    packed = sum(q.nbytes for q in packed_layers(model))
    dense = sum(q.out_features * q.in_features * 2 for q in packed_layers(model))
    # dequantized, each linear also holds the CPU GEMMs' panels and pack: one copy more
    assert room["dequantize"] - room["native"] == dense - packed + dense
