"""runner/memory_fit.py on an MoE model on the CPU: the experts' panel-packed copies
(kernels/cpu/moe_experts.py) replace most of the weights (the parameters are let go), so the
memory check counts what they hold beyond the dense experts (the padding to whole panels, a
bfloat16 layer's float32 biases), at the size the packing really allocates, and the KV cache's
room shrinks by that."""
from __future__ import annotations

import pytest
import torch

from engine_common.model_files.model_dir import ModelInfo
from kernels.cpu import extension
from kernels.cpu.moe_experts import CpuExperts, bytes_beyond_weights, packed_bytes
from tests.support.paged_prefill import BACKEND, load
from worker_service.config import RunnerConfig
from worker_service.failures import DoesNotFit
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group
from worker_service.runner.memory_fit import (GIB, check_memory_fits,
                                              estimate_cpu_linear_bytes,
                                              estimate_cpu_packed_bytes, estimate_weight_bytes,
                                              kv_room_bytes)

needs_extension = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, hidden, inter", [(3, 40, 20), (2, 64, 32), (1, 33, 7)])
def test_packed_bytes_is_what_the_packing_allocates(dtype, experts, hidden, inter):
    """Shapes off the 32-column panel width too (padded up): the formula equals the panels'
    real bytes."""
    w13 = torch.randn(experts, 2 * inter, hidden).to(dtype)
    w2 = torch.randn(experts, hidden, inter).to(dtype)
    assert packed_bytes(experts, hidden, inter, dtype) == CpuExperts(w13, w2).nbytes
    # GPT-OSS's experts add their biases (float32 copies in a bfloat16 layer)
    b13, b2 = torch.randn(experts, 2 * inter).to(dtype), torch.randn(experts, hidden).to(dtype)
    with_biases = CpuExperts(w13, w2, b13, b2).nbytes
    assert packed_bytes(experts, hidden, inter, dtype, biases=True) == with_biases
    assert (with_biases > CpuExperts(w13, w2).nbytes) == (dtype == torch.bfloat16)


def test_a_dtype_the_kernel_does_not_take_packs_nothing():
    assert packed_bytes(4, 64, 32, torch.float16) == 0
    assert packed_bytes(4, 64, 32, torch.float32) > 0
    assert bytes_beyond_weights(4, 64, 32, torch.float16) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_beyond_the_weights_is_the_padding_and_the_bias_copies(dtype):
    """Whole panels (2I and H multiples of 32) hold exactly the dense experts; H = 40 pads the
    down panels to 64 rows; GPT-OSS's bfloat16 biases add their float32 copies."""
    element = torch.empty((), dtype=dtype).element_size()
    assert bytes_beyond_weights(4, 64, 32, dtype) == 0
    assert bytes_beyond_weights(3, 40, 16, dtype) == 3 * (64 - 40) * 16 * element
    biases = 4 * (2 * 32 + 64) * 4 if dtype == torch.bfloat16 else 0
    assert bytes_beyond_weights(4, 64, 32, dtype, biases=True) == biases


def resident_beyond_weights(model) -> int:
    """The loaded model's packed experts' bytes less the dense experts' (shape x element
    size), after checking each one's stacked parameters were let go (one element resident)."""
    total, num_packed = 0, 0
    for m in model.modules():
        if getattr(m, "cpu_experts", None) is None:
            continue
        num_packed += 1
        params = (m.w13_weight, m.w2_weight)
        assert m.weights_released
        assert all(p.untyped_storage().nbytes() == p.element_size() for p in params)
        total += m.cpu_experts.nbytes - sum(p.numel() * p.element_size() for p in params)
    assert num_packed > 0
    return total


@needs_extension
def test_the_kv_room_shrinks_by_the_measured_packed_bytes(tiny_models):
    """The tiny Qwen3-MoE loaded on the CPU: what its layers' packed experts hold beyond the
    dense experts, measured, is exactly what the KV room loses beside the plain weight estimate
    and the linears' copies; a dense
    model loses the linears' only; and
    the check refuses one byte less than weights + packed copies + KV, naming the copies."""
    path = tiny_models("qwen3_moe")
    measured = resident_beyond_weights(load(path))      # 0: its H and 2I are whole panels
    info = ModelInfo.from_dir(path)
    config = RunnerConfig(model_dir=path, device="cpu", dtype="float32", kv_cache_bytes=GIB)
    assert estimate_cpu_packed_bytes(info.hf_config, torch.float32) == measured
    plain = estimate_weight_bytes(info.hf_config, 4)
    linears = estimate_cpu_linear_bytes(info.hf_config, torch.float32)  # cpu_linear_memory
    assert linears > 0
    have = 2 * GIB
    assert kv_room_bytes(config, info, 1, 1, have) == (have - plain - measured - linears,
                                                       plain + measured + linears,
                                                       measured + linears)

    dense = tiny_models("qwen3")
    dense_info = ModelInfo.from_dir(dense)
    dense_config = RunnerConfig(model_dir=dense, device="cpu", dtype="float32")
    assert kv_room_bytes(dense_config, dense_info, 1, 1, have)[0] == (
        have - estimate_weight_bytes(dense_info.hf_config, 4)
        - estimate_cpu_linear_bytes(dense_info.hf_config, torch.float32))

    exact = plain + measured + linears + GIB
    check_memory_fits(config, info, 1, 1, machine_bytes=exact)
    with pytest.raises(DoesNotFit, match=r"of it the CPU kernels' packed copies\) and its KV "
                                         r"cache 1\.00 GiB per rank"):
        check_memory_fits(config, info, 1, 1, machine_bytes=exact - 1)


@needs_extension
def test_gpt_oss_packed_bytes_with_its_biases_are_estimated(tiny_models):
    """The tiny GPT-OSS loaded in bfloat16 on the CPU: the estimate equals its packed experts'
    bytes beyond the dense experts, the float32 bias copies included."""
    path = tiny_models("gpt_oss")
    model = load_model(path, single_rank_group(), BACKEND, "cpu", "bfloat16")
    measured = resident_beyond_weights(model)
    hf_config = ModelInfo.from_dir(path).hf_config
    estimate = estimate_cpu_packed_bytes(hf_config, torch.bfloat16)
    assert estimate == measured > estimate_cpu_packed_bytes(
        {**hf_config, "architectures": ["Qwen3MoeForCausalLM"]}, torch.bfloat16)
