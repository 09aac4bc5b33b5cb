"""Device telemetry without a GPU: NVML missing, NVML failing, and a stand-in NVML module
injected at the boundary (NvmlReader's `nvml`), the one place a stand-in is used; the rank
processes' CPU and memory from /proc."""
from __future__ import annotations

import os
import sys

import pytest

from tests.support.fake_nvml import fake_nvml
from worker_service.service.device_telemetry import NvmlReader, read_process


def test_a_fake_nvml_gives_every_figure_in_base_units(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = fake_nvml()
    reader = NvmlReader(nvml)
    r = reader.read("cuda:1")
    assert r.utilization == 0.87 and r.memory_used_bytes == 3 << 30
    assert r.memory_total_bytes == 80 << 30 and r.power_watts == 250.5
    assert r.temperature_celsius == 61 and r.sm_clock_hertz == 1980e6
    assert reader.read("cuda:0") is not None and nvml.calls == ["init"]   # initialized once
    assert reader.read("cpu") is None


def test_cuda_visible_devices_maps_torch_ordinals_to_nvml(monkeypatch):
    nvml = fake_nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-1234")
    reader = NvmlReader(nvml)
    seen = []
    real = nvml.nvmlDeviceGetMemoryInfo
    nvml.nvmlDeviceGetMemoryInfo = lambda h: seen.append(h) or real(h)
    reader.read("cuda:0")
    reader.read("cuda:1")
    assert seen == [("index", 1), ("uuid", "GPU-1234")]


def test_an_unsupported_figure_is_left_out_alone():
    r = NvmlReader(fake_nvml(power_supported=False)).read("cuda:0")
    assert r.power_watts is None and r.utilization == 0.87


def test_nvml_missing_means_no_gpu_figures_and_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)       # import pynvml raises ImportError
    reader = NvmlReader()
    assert reader.read("cuda:0") is None and reader.read("cuda:1") is None
    warnings = [r for r in caplog.records if "NVML is unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "nvidia-ml-py" in warnings[0].getMessage()


def test_nvml_without_a_driver_gives_up_quietly():
    reader = NvmlReader(fake_nvml(fail_init=True))
    assert reader.read("cuda:0") is None and reader.read("cuda:0") is None


def test_a_bad_ordinal_gives_no_reading(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert NvmlReader(fake_nvml()).read("cuda:5") is None


def test_read_process_sees_this_process_work():
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("no /proc on this system")
    before = read_process(os.getpid())
    sum(i * i for i in range(2_000_000))                  # burn a little CPU
    after = read_process(os.getpid())
    assert after.cpu_seconds >= before.cpu_seconds > 0
    assert after.resident_bytes > 10 << 20
    assert read_process(2 ** 22 + 7) is None              # no such process
