"""Live device and process figures for the worker's metrics, read when Prometheus scrapes.

NVIDIA GPUs: NVML through pynvml (PyPI `nvidia-ml-py`), imported on first use. A worker without
it, or where NVML fails (no driver), reports no device figures and logs why once; a figure one
GPU does not support (power on some boards) is left out alone. NVML numbers GPUs physically and
ignores CUDA_VISIBLE_DEVICES, so torch's cuda:r is mapped through that variable (an index or a
GPU-/MIG- UUID per entry) as CUDA does.

Every rank process: CPU seconds and resident memory from /proc/<pid> (Linux; elsewhere none).
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    """One GPU now; None where NVML has no answer. Units: ratio, bytes, watts, Celsius, hertz."""

    utilization: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None


class NvmlReader:
    """`nvml`: a module with pynvml's API (tests inject a stand-in here: there is no GPU in CI);
    None imports pynvml on the first read."""

    def __init__(self, nvml: ModuleType | None = None):
        self._nvml = nvml
        self._ready = False
        self._gave_up = False

    def read(self, device: str) -> GpuReading | None:
        """The figures of torch device `device` ("cuda:N"); None for a CPU or without NVML."""
        if not device.startswith("cuda") or not self._start():
            return None
        nvml = self._nvml
        try:
            handle = self._handle(int(device.partition(":")[2] or 0))
        except Exception as e:  # noqa: BLE001 - NVMLError, or a bad CUDA_VISIBLE_DEVICES entry
            log.warning("NVML has no handle for %s: %s", device, e)
            return None
        memory = _ask(nvml.nvmlDeviceGetMemoryInfo, handle)
        util = _ask(nvml.nvmlDeviceGetUtilizationRates, handle)
        power_mw = _ask(nvml.nvmlDeviceGetPowerUsage, handle)
        clock_mhz = _ask(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
        return GpuReading(
            utilization=None if util is None else util.gpu / 100.0,
            memory_used_bytes=None if memory is None else float(memory.used),
            memory_total_bytes=None if memory is None else float(memory.total),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            temperature_celsius=_ask(nvml.nvmlDeviceGetTemperature, handle,
                                     nvml.NVML_TEMPERATURE_GPU),
            sm_clock_hertz=None if clock_mhz is None else clock_mhz * 1e6)

    def _start(self) -> bool:
        if self._ready:
            return True
        if self._gave_up:
            return False
        try:
            if self._nvml is None:
                self._nvml = importlib.import_module("pynvml")
            self._nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - ImportError, or NVMLError (no driver)
            log.warning("no GPU figures in the metrics: NVML is unavailable (%s: %s); install "
                        "nvidia-ml-py on the worker", type(e).__name__, e)
            self._gave_up = True
            return False
        self._ready = True
        return True

    def _handle(self, ordinal: int):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if not visible:
            return self._nvml.nvmlDeviceGetHandleByIndex(ordinal)
        entry = visible.split(",")[ordinal].strip()
        if entry.startswith(("GPU-", "MIG-")):
            return self._nvml.nvmlDeviceGetHandleByUUID(entry)
        return self._nvml.nvmlDeviceGetHandleByIndex(int(entry))


def _ask(query, *args):
    """One NVML query; None when this GPU does not support it (NVMLError)."""
    try:
        return query(*args)
    except Exception:  # noqa: BLE001 - pynvml raises NVMLError subclasses per code
        return None


@dataclass(frozen=True)
class ProcessReading:
    cpu_seconds: float          # user + system
    resident_bytes: int


def read_process(pid: int) -> ProcessReading | None:
    """CPU seconds and RSS of process `pid` from /proc; None when unreadable (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()   # after "(comm)", which may hold spaces
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    # fields[0] is field 3 (state): utime and stime are fields 14 and 15.
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    return ProcessReading(cpu, resident_pages * os.sysconf("SC_PAGE_SIZE"))
