"""WorkerCoreFactory: an Init whose KV cache holds fewer tokens than max_model_len says so (a
request that outgrows the cache ends there with finish_reason "length", fewer tokens than its
max_tokens; vLLM refuses to start then), and one that holds a whole request says nothing."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from engine_common.configuration.config import SchedulerConfig
from scheduler_service.api import server
from scheduler_service.api.server import WorkerCoreFactory


class _Client:
    """A worker client whose Init reports `num_kv_blocks` on one device."""

    def __init__(self, num_kv_blocks: int):
        self.num_kv_blocks = num_kv_blocks

    def init(self, spec):
        return SimpleNamespace(num_kv_blocks=self.num_kv_blocks, devices=("cpu",))


def _init(caplog, num_kv_blocks: int) -> list[str]:
    config = SchedulerConfig(max_model_len=8192, block_size=16)
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        core = WorkerCoreFactory(_Client(num_kv_blocks), spec=None, config=config)()
    assert core.scheduler is not None
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_cache_smaller_than_max_model_len_is_named_with_both_sizes(caplog):
    (warning,) = _init(caplog, 145)
    assert "2320 tokens, fewer than max_model_len 8192" in warning
    assert "--max-model-len" in warning and "--kv-cache-gib" in warning


def test_a_cache_that_holds_a_whole_request_says_nothing(caplog):
    assert _init(caplog, 512) == []
