"""worker_service/runner/host_memory.py: the CPU KV cache's zeroed, huge-page-advised tensors."""
from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from worker_service.runner.host_memory import populate_pages, zeroed_host_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_is_zero_writable_and_contiguous(dtype):
    t = zeroed_host_tensor((2, 33, 16, 3, 64), dtype)
    assert t.shape == (2, 33, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[1, 32, 15, 2, 63] = 1.5
    t[0].fill_(2.0)
    assert t[1, 32, 15, 2, 63].item() == 1.5 and t[0].eq(2.0).all() and t.sum().item() > 0


def test_empty_shape():
    assert zeroed_host_tensor((2, 0, 16, 1, 8), torch.float32).numel() == 0


def _rollup_kib(field: str) -> int | None:
    path = Path("/proc/self/smaps_rollup")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return None


def _anon_huge_kib() -> int | None:
    return _rollup_kib("AnonHugePages")


def test_pages_are_resident_before_first_use_where_the_kernel_can():
    probe = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _rollup_kib("Rss") is None or not populate_pages(probe):
        pytest.skip("no MADV_POPULATE_WRITE (Linux < 5.14) or no /proc/self/smaps_rollup")
    before = _rollup_kib("Rss")
    t = zeroed_host_tensor(((64 << 20) // 4,), torch.float32)    # 64 MiB, never written
    assert _rollup_kib("Rss") - before >= 60 << 10
    assert not t.any()
    lazy = zeroed_host_tensor(((64 << 20) // 4,), torch.float32, populate=False)
    after = _rollup_kib("Rss")
    assert after - before < 100 << 10                            # the lazy one is not resident
    del t, lazy
    gc.collect()


def test_huge_pages_back_the_tensor_where_the_kernel_allows():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if (not hasattr(mmap, "MADV_HUGEPAGE") or not mode.exists()
            or "[never]" in mode.read_text() or _anon_huge_kib() is None):
        pytest.skip("no transparent huge pages here")
    before = _anon_huge_kib()
    t = zeroed_host_tensor(((64 << 20) // 4,), torch.float32)    # 64 MiB
    t.fill_(1.0)
    # The kernel may fall short under memory fragmentation, but not on every 2 MiB of 64.
    assert _anon_huge_kib() - before >= 2 << 10
    del t
    gc.collect()
