"""The spec decode counters: absent until an engine drafts, then the scheduler's counts added
as they grow, across epochs (each epoch's scheduler counts from zero)."""
from __future__ import annotations

from prometheus_client import generate_latest

from scheduler_service.core.spec_decode import SpecStats
from scheduler_service.engine.engine_core import StepStats
from scheduler_service.core.kv_cache_manager import PrefixCacheStats
from scheduler_service.engine.metrics import SchedulerMetrics

M = {"model_name": "m"}


def _value(metrics: SchedulerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value("deltaserve:" + name, {**M, **labels}) or 0.0


def test_counters_follow_the_schedulers_counts_across_epochs():
    metrics = SchedulerMetrics("m")
    step, prefix = StepStats(), PrefixCacheStats()
    metrics.observe_step(step, prefix)
    assert b"spec_decode" not in generate_latest(metrics.registry)
    metrics.observe_step(step, prefix, SpecStats(2, 6, 4, [2, 1, 1]))
    metrics.observe_step(step, prefix, SpecStats(3, 9, 5, [3, 1, 1]))
    assert _value(metrics, "spec_decode_num_drafts_total") == 3
    assert _value(metrics, "spec_decode_num_draft_tokens_total") == 9
    assert _value(metrics, "spec_decode_num_accepted_tokens_total") == 5
    assert _value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3
    assert _value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    metrics.observe_epoch()                       # a new scheduler: its counts restart
    metrics.observe_step(step, prefix, SpecStats(1, 3, 3, [1, 1, 1]))
    assert _value(metrics, "spec_decode_num_drafts_total") == 4
    assert _value(metrics, "spec_decode_num_accepted_tokens_total") == 8
    assert _value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="2") == 2
