"""A stand-in for pynvml (nvidia-ml-py), for the worker's telemetry tests on machines without a
GPU. It is injected at the one boundary that takes it: NvmlReader's `nvml` argument."""
from __future__ import annotations

import types


class NVMLError(Exception):
    pass


def fake_nvml(power_supported: bool = True, fail_init: bool = False) -> types.ModuleType:
    """pynvml's API for two GPUs; handles are the physical indices or UUIDs asked for."""
    m = types.ModuleType("fake_pynvml")
    m.NVML_CLOCK_SM, m.NVML_TEMPERATURE_GPU = 1, 0
    m.calls = []

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")
        m.calls.append("init")

    def by_index(i):
        if i > 1:
            raise NVMLError("Invalid Argument")
        return ("index", i)

    def power(handle):
        if not power_supported:
            raise NVMLError("Not Supported")
        return 250_500                                   # milliwatts

    m.nvmlInit = init
    m.nvmlDeviceGetHandleByIndex = by_index
    m.nvmlDeviceGetHandleByUUID = lambda uuid: ("uuid", uuid)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 << 30, total=80 << 30,
                                                                free=77 << 30)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetTemperature = lambda h, sensor: 61
    m.nvmlDeviceGetClockInfo = lambda h, clock: 1980     # MHz
    return m
