"""What a worker's devices are and how much memory they have, measured when asked.

On NVIDIA GPUs the numbers come from NVML (nvidia-ml-py) when it is importable, since NVML sees
memory held by other processes; otherwise from torch.cuda.mem_get_info. On CPU the "device" is
the machine: its CPU model name and system memory (MemTotal / MemAvailable from /proc/meminfo,
falling back to sysconf). Sizes are bytes.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from engine_common.request.params import ParamError


def resolve_device(device: str, flag: str = "--device") -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'. 'cuda' / 'cuda:N' only where torch
    sees that GPU: a ParamError naming `flag` now, not torch's AssertionError at the first
    allocation (or, in a worker, at the scheduler's Init). Anything else is returned as is."""
    if device != "auto" and not device.startswith("cuda"):
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _, _, index = device.partition(":")
    if have == 0:
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else f"torch {torch.__version__} sees no CUDA device")
        raise ParamError(flag, device, f"'cpu' or 'auto' ({why})")
    if index and (not index.isdigit() or int(index) >= have):
        raise ParamError(flag, device, f"'cuda' or 'cuda:N' with N in [0, {have - 1}] (torch "
                                       f"sees {have} CUDA devices)")
    return device


@dataclass(frozen=True)
class DeviceDescription:
    """One device as measured now."""

    kind: str                 # "cpu" or "cuda"
    index: int                # CUDA ordinal as torch sees it; 0 on CPU
    name: str
    total_memory_bytes: int
    free_memory_bytes: int


def describe_device(device: str) -> DeviceDescription:
    """Describe a torch device string such as "cpu", "cuda" or "cuda:1"."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return _describe_cpu()
    if kind == "cuda":
        return _describe_cuda(int(index) if index else 0)
    raise ValueError(f"device={device!r} is invalid: must be 'cpu', 'cuda' or 'cuda:N'")


# -- CPU ----------------------------------------------------------------------------------------

def _describe_cpu() -> DeviceDescription:
    total, free = _system_memory()
    return DeviceDescription("cpu", 0, _cpu_name(), total, free)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _system_memory() -> tuple[int, int]:
    """(total, available) system memory in bytes."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * 1024  # /proc/meminfo counts kB
    except OSError:
        pass
    if "MemTotal" in fields:
        return fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


# -- CUDA ---------------------------------------------------------------------------------------

def _describe_cuda(index: int) -> DeviceDescription:
    import torch

    props = torch.cuda.get_device_properties(index)
    measured = _nvml_memory(props)
    if measured is None:
        free, total = torch.cuda.mem_get_info(index)
    else:
        total, free = measured
    return DeviceDescription("cuda", index, props.name, int(total), int(free))


def _nvml_memory(props) -> tuple[int, int] | None:
    """(total, free) from NVML for the device torch calls `props`, or None when unavailable.

    NVML numbers devices physically, ignoring CUDA_VISIBLE_DEVICES, so the device is found by
    its UUID rather than its torch index.
    """
    try:
        import pynvml
    except ImportError:
        return None
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return int(mem.total), int(mem.free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVMLError, or a uuid format this pynvml rejects
        return None       # torch.cuda.mem_get_info is the fallback either way
