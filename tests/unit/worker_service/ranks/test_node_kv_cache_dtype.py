"""A node's InitResponse.kv_cache_dtype is every rank's allocated cache dtype, not rank 0's:
ranks that resolved `fp8` differently (e4m3 on CUDA, e5m2 on the CPU) are refused by rank."""
from __future__ import annotations

import pytest

from worker_service.ranks.rank_api import node_kv_cache_dtype


def test_ranks_that_agree_give_their_dtype():
    assert node_kv_cache_dtype(["fp8_e4m3", "fp8_e4m3"]) == "fp8_e4m3"
    assert node_kv_cache_dtype(["auto"]) == "auto"


def test_a_rank_that_resolved_differently_is_named():
    with pytest.raises(ValueError, match="rank 0: 'fp8_e4m3', rank 1: 'fp8_e5m2'"):
        node_kv_cache_dtype(["fp8_e4m3", "fp8_e5m2"])
    with pytest.raises(ValueError, match="rank 2: 'auto'"):
        node_kv_cache_dtype(["fp8_e5m2", "fp8_e5m2", "auto"])
