"""Hand the heap's free pages back to the OS after the weights load (glibc's malloc_trim).

Loading allocates and frees many transient tensors (a GPTQ / AWQ band's unpacked codes, their
int32 copy for torch's int4 repack, dequantized slices); glibc keeps freed chunks below its
mmap threshold (which grows to 32 MiB as large blocks are freed) in the heap, resident. With
native CPU quantized weights that is most of what the load touched: a 6-layer qwen3 of
hidden 1024 (75.5M linear parameters, 38 MiB packed) grew the worker's RSS by 181 MiB, 61 MiB
after the trim, while the memory estimate that sizes the KV cache counts 39 MiB.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def trim_heap() -> bool:
    """malloc_trim(0): True when glibc released pages; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        log.debug("malloc_trim unavailable (not glibc): freed heap pages stay resident")
        return False
    return bool(trim(0))
