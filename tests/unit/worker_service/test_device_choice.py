"""`--device` / `LLM(device=...)`: a CUDA device torch does not see is refused up front, naming
the flag and the value, instead of torch's AssertionError at the first allocation (a worker used
to start, say "listening (device cuda)" and fail only at the scheduler's Init)."""
from __future__ import annotations

import pytest
import torch

from engine_common.request.params import ParamError
from worker_service.device_info import resolve_device

_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_cpu_and_auto_resolve_without_a_gpu_question():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if _COUNT else "cpu")


@pytest.mark.skipif(_COUNT > 0, reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_cuda_device_is_refused_naming_the_flag(device):
    with pytest.raises(ParamError) as e:
        resolve_device(device, "--device")
    assert e.value.field == "--device" and e.value.value == device
    assert "'cpu' or 'auto'" in str(e.value)


@pytest.mark.parametrize("device", [f"cuda:{_COUNT}", "cuda:x"])
def test_a_cuda_index_torch_does_not_see_is_refused(device):
    with pytest.raises(ParamError) as e:
        resolve_device(device, "device")
    assert e.value.field == "device" and e.value.value == device


@pytest.mark.skipif(_COUNT > 0, reason="this machine has a CUDA device")
def test_the_offline_llm_refuses_cuda_before_loading_anything(tmp_path):
    from deltaserve.llm import LLM

    with pytest.raises(ParamError) as e:
        LLM(str(tmp_path / "no-such-model"), device="cuda")   # refused before the model dir
    assert e.value.field == "device"
