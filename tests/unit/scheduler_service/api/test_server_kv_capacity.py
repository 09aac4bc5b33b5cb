"""WorkerCoreFactory: an Init whose KV cache holds fewer tokens than max_model_len says so (a
request that outgrows the cache ends there with finish_reason "length", fewer tokens than its
max_tokens; vLLM refuses to start then), and one that holds a whole request says nothing."""
from __future__ import annotations

import logging
from engine_common.configuration.config import SchedulerConfig
from scheduler_service.api import server
from scheduler_service.api.server import WorkerCoreFactory
from scheduler_service.workers.worker_spec import InitResult


class _Client:
    """A worker client whose Init reports `num_kv_blocks` on one device."""

    def __init__(self, num_kv_blocks: int, sliding_window: int = 0):
        self.num_kv_blocks = num_kv_blocks
        self.sliding_window = sliding_window

    def init(self, spec):
        return InitResult(epoch=1, num_kv_blocks=self.num_kv_blocks, kv_block_bytes=0,
                          devices=("cpu",), sliding_window=self.sliding_window)


def _init(caplog, num_kv_blocks: int, sliding_window: int = 0) -> list[str]:
    config = SchedulerConfig(max_model_len=8192, block_size=16, max_num_batched_tokens=512)
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        core = WorkerCoreFactory(_Client(num_kv_blocks, sliding_window), spec=None,
                                 config=config)()
    assert core.scheduler.kv.sliding_window == sliding_window
    # asyncio's records are not this Init's: another test's leftover transport may log
    # 'Event loop is closed' when it is collected meanwhile
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name != "asyncio"]


def test_a_cache_smaller_than_max_model_len_is_named_with_both_sizes(caplog):
    (warning,) = _init(caplog, 145)
    assert "2320 tokens, fewer than max_model_len 8192" in warning
    assert "--max-model-len" in warning and "--kv-cache-gib" in warning


def test_a_cache_that_holds_a_whole_request_says_nothing(caplog):
    assert _init(caplog, 512) == []


def test_a_window_on_every_layer_lets_requests_outgrow_the_cache(caplog):
    """The workers report a window: the scheduler frees blocks that left it, so a request is
    not cut to the cache and nothing is said; too small for one chunk and a window, it is."""
    assert _init(caplog, 145, sliding_window=512) == []
    caplog.clear()
    (warning,) = _init(caplog, 20, sliding_window=512)
    assert "320 tokens, fewer than max_model_len 8192" in warning
